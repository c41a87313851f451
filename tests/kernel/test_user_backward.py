"""``loss.backward()`` through the engine's outputs trains as `Engine.backward` does and as torch does.

[Note: a backward the engine is not told of] in `zkernel.kernel.user_backward`. The scenarios of
DeepSpeed's PyTorch-compatible backward (a loss function outside the model, a non-scalar
``output.backward(gradient)``, one backward over two engines' losses, ``scale_wrt_gas=False``,
``engine.scale``), on 2 gloo ranks with accumulation and clipping, against torch AdamW with DDP's
gradient; the single-process cases a script hits (retained graphs, ``torch.autograd.grad``,
evaluation, a backward that raises, activation checkpointing) beside them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

import zkernel
from tests.support.harness import run_ranks
from tests.support.user_backward_scenarios import (
    ACCUM,
    Net,
    batch,
    config,
    every_way,
    fp16_backward_without_scale,
    reference,
    reference_two_engines,
)

CONFIGS = {
    "zero1": config("zero1"),
    "zero2": config("zero2"),
    "zero3": config("zero3"),
    "zero3, optimizer on cpu": config("zero3", "cpu"),
}


def _close(result: dict, expected: dict, label: str) -> None:
    assert result.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(result[name].float(), value, rtol=1e-5, atol=1e-6, msg=f"{label}: {name}")


def _equal(result: dict, expected: dict, label: str) -> None:
    for name, value in expected.items():
        assert torch.equal(result[name], value), f"{label}: {name} differs from engine.backward's"


@pytest.mark.parametrize("label", list(CONFIGS))
def test_a_plain_backward_trains_as_engine_backward_and_as_torch(label):
    for rank_result in run_ranks(2, every_way, CONFIGS[label]):
        ways, two = rank_result["ways"], rank_result["two"]
        for way in ("loss.backward", "model loss", "engine.scale"):
            _equal(ways[way], ways["engine.backward"], f"{label}, {way}")
        _equal(ways["output.backward"], ways["engine.backward sum"], f"{label}, output.backward")
        for way, state in ways.items():
            _close(state, reference(way, 2), f"{label}, {way}")
        for i, (state, expected) in enumerate(zip(two, reference_two_engines(2), strict=True)):
            _close(state, expected, f"{label}, engine {i} of two under one backward")


def test_fp16_needs_engine_scale_for_a_plain_backward():
    for result in run_ranks(2, fp16_backward_without_scale):
        assert result["message"] is not None and "Loss scaling is required" in result["message"]
        assert "engine.scale(loss).backward()" in result["message"]
        assert result["counted"] == 0
        _equal(result["states"]["engine.scale"], result["states"]["engine.backward"], "fp16 engine.scale")


# -- one process -------------------------------------------------------------------------


def _engine(**extra):
    torch.manual_seed(0)
    return zkernel.initialize(Net(), config("zero3", **extra))


def test_two_backwards_without_a_step_raise_and_a_raised_backward_is_not_counted():
    engine = _engine()
    x, y = batch(0, 0, 0)
    F.mse_loss(engine(x), y).backward()
    with pytest.raises(RuntimeError, match="without engine.step"):
        F.mse_loss(engine(x), y).backward()
    engine.step()
    assert engine.micro_steps == 1
    # A backward that raises inside the model's graph: nothing counted, the next micro-batch trains.
    out = engine(x)
    boom = out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        F.mse_loss(out, y).backward()
    boom.remove()
    with capture_logs() as logs:
        engine.step()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["zkernel.step.no_backward"]
    F.mse_loss(engine(x), y).backward()
    engine.step()
    assert engine.micro_steps == 2
    engine.close()


def test_retained_graph_autograd_grad_and_evaluation():
    engine = _engine()
    x, y = batch(0, 0, 0)
    x.requires_grad_(True)
    out = engine(x)
    # torch.autograd.grad accumulates into no parameter: not a training backward, not scaled.
    (gx,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    plain = Net()
    torch.manual_seed(0)
    plain = Net()
    (expected,) = torch.autograd.grad(plain(x).sum(), x)
    torch.testing.assert_close(gx, expected)
    assert engine.micro_steps == 0 and not engine._backward_done
    loss = F.mse_loss(out, y)
    loss.backward(retain_graph=True)
    engine.step()
    loss.backward()  # the retained graph, a second micro-batch: the window's end
    engine.step()
    assert (engine.micro_steps, engine.global_steps) == (2, 1)
    with torch.no_grad():
        engine(x)
    assert engine.backward_pass._outputs == []  # evaluation marks nothing
    engine.close()


def test_activation_checkpointing_recomputes_under_a_plain_backward():
    states = []
    for way in ("engine.backward", "loss.backward"):
        engine = _engine(activation_checkpointing={"modules": ["fc1", "fc2"]})
        for step in range(2):
            for micro in range(ACCUM):
                x, y = batch(step, micro, 0)
                loss = F.mse_loss(engine(x), y)
                engine.backward(loss) if way == "engine.backward" else loss.backward()
                engine.step()
        states.append(engine.state_dict())
        engine.close()
    _equal(states[1], states[0], "checkpointed, loss.backward")


def test_two_forwards_one_backward_and_a_penalty_outside_the_outputs():
    """Two micro-batches' forwards under one plain backward count one micro-batch; a penalty on a
    weight read outside the forward reaches the parameter outside the outputs, and opens the pass
    there if it comes first (with one accumulation step nothing is divided: exact)."""
    engine = _engine()
    (x0, y0), (x1, y1) = batch(0, 0, 0), batch(0, 1, 0)
    (F.mse_loss(engine(x0), y0) + F.mse_loss(engine(x1), y1)).backward()
    engine.step()
    assert engine.micro_steps == 1
    engine.close()
    states = []
    for way in ("engine.backward", "loss.backward"):
        torch.manual_seed(0)
        engine = zkernel.initialize(Net(), config("zero3", gradient_accumulation_steps=1))
        for step in range(3):
            x, y = batch(step, 0, 0)
            loss = engine.module.fc1.weight.pow(2).sum() * 0.01 + F.mse_loss(engine(x), y)
            engine.backward(loss) if way == "engine.backward" else loss.backward()
            engine.step()
        states.append(engine.state_dict())
        engine.close()
    _equal(states[1], states[0], "penalty on a weight, loss.backward")


def test_chained_engines_under_engine_backward_train_as_torch_and_a_plain_one_warns():
    """``b(a(x))``: ``b.backward(loss)`` divides once, and ``a`` counts its micro-batch (torch's
    result); a plain backward would divide at both outputs, and says so ([Note: an output fed to a
    forward])."""
    torch.manual_seed(0)
    a = zkernel.initialize(Net(), config("zero3"))
    torch.manual_seed(1)
    b = zkernel.initialize(Net(), config("zero2"))
    torch.manual_seed(0)
    ref_a = Net()
    torch.manual_seed(1)
    ref_b = Net()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (ref_a, ref_b)]
    for step in range(2):
        for micro in range(ACCUM):
            x, y = batch(step, micro, 0)
            b.backward(F.mse_loss(b(a(x)), y))
            a.step()
            b.step()
            (F.mse_loss(ref_b(ref_a(x)), y) / ACCUM).backward()
        for m, opt in zip((ref_a, ref_b), opts):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    assert (a.global_steps, b.global_steps) == (2, 2)
    for engine, ref in ((a, ref_a), (b, ref_b)):
        _close(engine.state_dict(), ref.state_dict(), "chained")
    x, y = batch(0, 0, 0)
    with capture_logs() as logs:
        F.mse_loss(b(a(x)), y).backward()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["zkernel.backward.output_fed_to_forward"]
    a.close()
    b.close()


def test_a_plain_backward_is_a_backward_span_of_the_timeline():
    engine = _engine(timeline=True)
    x, y = batch(0, 0, 0)
    F.mse_loss(engine(x), y).backward()
    assert [r.label for r in engine.timeline._host if r.label in ("forward", "backward")] == ["forward", "backward"]
    engine.close()
