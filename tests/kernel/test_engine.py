"""Engine lifecycle: accumulation counting, release of everything it holds."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import zkernel


@pytest.mark.parametrize("stage", ["none", "zero1", "zero2", "zero3"])
def test_dropped_engine_and_model_are_freed(stage):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    engine = zkernel.initialize(model, {"partitioner": stage, "partitioner_options": {"persistence_threshold": 0}} if stage == "zero3" else {"partitioner": stage})
    engine.backward(engine(torch.randn(3, 8)).sum())
    engine.step()
    refs = [weakref.ref(engine), weakref.ref(model), weakref.ref(engine.groups[0])]
    del engine, model
    gc.collect()
    assert all(r() is None for r in refs), "hooks must not keep a dropped engine alive"


def test_step_applies_only_at_accumulation_boundary():
    model = torch.nn.Linear(2, 1)
    engine = zkernel.initialize(model, {"gradient_accumulation_steps": 3, "optimizer": {"lr": 0.1}})
    before = model.weight.detach().clone()
    for i in range(3):
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
        changed = not torch.equal(before, model.weight.detach())
        assert changed == (i == 2)
    assert engine.global_steps == 1 and engine.micro_steps == 3


@pytest.mark.parametrize("accumulation", [1, 3])
def test_a_second_backward_before_step_is_an_error_that_loses_nothing(accumulation):
    """step() counts micro-batches (DeepSpeed's contract): backward per micro-batch and one step at
    the end of the window would silently stretch the window; it is refused, and training goes on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reference = torch.nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    engine = zkernel.initialize(model, {"gradient_accumulation_steps": accumulation, "optimizer": {"name": "adamw", "lr": 0.1}})
    opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0)
    batches = [torch.randn(3, 4) for _ in range(accumulation)]
    for i, x in enumerate(batches):
        engine.backward(engine(x).square().mean())
        if i == 0:
            with pytest.raises(RuntimeError, match=r"twice without engine.step\(\).*gradient_accumulation_steps = " + str(accumulation)):
                engine.backward(engine(x).square().mean())
        engine.step()
        (reference(x).square().mean() / accumulation).backward()
    opt.step()
    assert engine.global_steps == 1
    torch.testing.assert_close(model.weight.detach(), reference.weight.detach(), rtol=1e-6, atol=1e-7)


def test_train_and_eval_switch_the_model_as_deepspeeds_engine_does():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    engine = zkernel.initialize(model, {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}})
    x = torch.randn(4, 8)
    assert engine.eval() is engine and not engine.training and not model[1].training
    with torch.no_grad():
        assert torch.equal(engine(x), engine(x))  # no dropout
    assert engine.train() is engine and engine.training and model[1].training
    engine.backward(engine(x).sum())
    engine.step()
    engine.close()


def _wide():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16, bias=False))


class _LossNet(torch.nn.Module):
    """A model whose forward returns its loss, as a training script's usually does."""

    def __init__(self):
        super().__init__()
        self.body = _wide()

    def forward(self, x):
        return self.body(x).pow(2).mean()


def test_num_parameters_counts_released_zero3_parameters_whole():
    """Under zero3 a released parameter reports numel() == 0; num_parameters() counts the whole model."""
    model = _wide()
    whole = sum(p.numel() for p in model.parameters())
    model[2].weight.requires_grad_(False)
    engine = zkernel.initialize(model, {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}})
    try:
        assert sum(p.numel() for p in engine.module.parameters()) < whole  # released: the count a script sees
        assert engine.num_parameters() == whole
        assert engine.num_parameters(trainable_only=True) == whole - 32 * 16
    finally:
        engine.close()


def test_a_loss_divided_by_the_accumulation_steps_warns_once():
    from structlog.testing import capture_logs

    engine = zkernel.initialize(_LossNet(), {"gradient_accumulation_steps": 2})
    try:
        with capture_logs() as logs:
            for _ in range(2):  # the porting mistake, twice: one warning
                engine.backward(engine(torch.randn(3, 16)) / 2)
                engine.step()
        scaled = [e for e in logs if e["event"] == "zkernel.backward.loss_scaled_twice"]
        assert len(scaled) == 1 and scaled[0]["gradient_accumulation_steps"] == 2
    finally:
        engine.close()
    engine = zkernel.initialize(_LossNet(), {"gradient_accumulation_steps": 2})
    try:
        with capture_logs() as logs:
            engine.backward(engine(torch.randn(3, 16)) * 0.5)  # the same, as a product
            engine.step()
            engine.backward(engine(torch.randn(3, 16)))
            engine.step()
        assert [e["event"] for e in logs].count("zkernel.backward.loss_scaled_twice") == 1
    finally:
        engine.close()


def test_an_unscaled_loss_or_another_divisor_does_not_warn():
    from structlog.testing import capture_logs

    engine = zkernel.initialize(_LossNet(), {"gradient_accumulation_steps": 2})
    try:
        with capture_logs() as logs:
            for divisor in (1, 3, 4):
                out = engine(torch.randn(3, 16))
                engine.backward(out if divisor == 1 else out / divisor)
                engine.step()
        assert "zkernel.backward.loss_scaled_twice" not in [e["event"] for e in logs]
    finally:
        engine.close()
