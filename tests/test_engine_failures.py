"""An engine after a failure: dropped, it frees its threads and swap files; closed, it gives the model back once.

Real faults: a swap file altered on disk (a CRC32C mismatch on the next read), an optimizer that raises in
its step on the host worker. The error is caught the way a training loop catches it (and not kept: a kept
exception keeps its frames, and so the engine, alive by Python's rules).
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch

import zkernel
from tests.models import TrickyNet
from tests.nvme_scenarios import RUN_GLOB, nvme_config, steps
from zkernel.platform.aio import ChecksumError
from zkernel.spec import hookimpl

JOIN_S = 10.0  # how long the engine's threads may take to end once it is dropped


class FailingStep:
    """Optimizer ``cpu_adam_failing``: cpu_adam whose step raises from the engine's third step on
    (TrickyNet under zero3 with ``persistence_threshold = 0``: ``group_count`` trainable groups a step)."""

    @hookimpl
    def zkernel_register_optimizers(self, registry):
        from zkernel_plugins.optimizers.cpu_adam import CpuAdam

        class Failing(CpuAdam):
            calls = 0

            @hookimpl
            def zkernel_step_optimizer(self, group, options):
                Failing.calls += 1
                if Failing.calls > 2 * group_count:
                    raise RuntimeError("injected: the optimizer step failed")
                return super().zkernel_step_optimizer(group, options)

        registry.add("cpu_adam_failing", Failing, description="cpu_adam raising at step 3 (test)")


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def failed_engine(path: Path, fault: str):
    """(engine, model, the error's text) after two good steps and a third that failed with ``fault``."""
    torch.manual_seed(0)
    model = TrickyNet()
    if fault == "step":
        engine = zkernel.initialize(model, nvme_config(path, params="nvme", name="cpu_adam_failing"), plugins=[FailingStep()])
    elif fault in ("params_file", "frozen_file"):
        engine = zkernel.initialize(model, nvme_config(path, optimizer="cpu", params="nvme"))
    else:
        engine = zkernel.initialize(model, nvme_config(path, stage="zero2"))
    steps(engine, 2)
    engine.pipeline.wait_all()
    if fault == "params_file":
        engine.params_tier.wait_writes()
        _flip(sorted(engine.params_tier.run_dir.path.glob("params-*.swap"))[0], 3)
    elif fault == "frozen_file":
        engine.params_tier.wait_writes()
        [frozen] = [g for g in engine.groups if not g.requires_grad]
        _flip(engine.params_tier.run_dir.path / f"params-{frozen.index:05d}.swap", 3)
    elif fault == "optimizer_file":
        engine.optimizer_tier.wait_writes()
        _flip(sorted(engine.optimizer_tier.run_dir.path.glob("optimizer-*.swap"))[-1], 4096 + 5)
    error = None
    try:
        steps(engine, 1, start=2)
        engine.pipeline.wait_all()
    except Exception as exc:  # noqa: BLE001 - as a training loop would; only its text is kept
        error = f"{type(exc).__name__}: {exc}"
    assert error is not None, f"the {fault} fault did not fail the step"
    return engine, model, error


group_count = 6
FAULTS = ("params_file", "optimizer_file", "step")


@pytest.mark.parametrize("fault", FAULTS)
def test_a_dropped_engine_after_a_failure_ends_its_threads_and_removes_its_swap_files(tmp_path, fault):
    before = set(threading.enumerate())
    engine, model, _ = failed_engine(tmp_path, fault)
    started = [t for t in threading.enumerate() if t not in before]
    assert any(t.name.startswith("zkernel-") for t in started), [t.name for t in started]
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    for thread in started:
        thread.join(timeout=JOIN_S)
    assert dropped() is None, "the dropped engine is still alive"
    assert [t.name for t in started if t.is_alive()] == []
    assert not list(tmp_path.glob(RUN_GLOB))


@pytest.mark.parametrize("fault", FAULTS)
def test_close_after_a_failure_gives_the_model_back_and_reports_once(tmp_path, fault):
    before = set(threading.enumerate())
    engine, model, error = failed_engine(tmp_path, fault)
    started = [t for t in threading.enumerate() if t not in before]
    try:
        engine.close()
    except Exception as exc:  # noqa: BLE001 - close may report what failed, once
        reported = f"{type(exc).__name__}: {exc}"
    else:
        reported = None
    assert engine.closed
    engine.close()  # a no-op now
    if reported is not None:
        assert reported.split(":")[0] == error.split(":")[0], (reported, error)
    for thread in started:
        thread.join(timeout=JOIN_S)
    assert [t.name for t in started if t.is_alive()] == []
    assert not list(tmp_path.glob(RUN_GLOB))
    # The model is the user's again: own classes, real values, and it trains on its own.
    assert all(type(p) is torch.nn.Parameter and not p.is_meta and p.numel() > 0 for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    tokens = torch.randint(0, 29, (2, 6))
    model(tokens, tokens).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    zkernel.initialize(model, {"partitioner": "zero2", "optimizer": {"lr": 1e-3}}).close()


def test_close_gives_values_it_cannot_read_back_as_meta_tensors_and_says_so(tmp_path, caplog):
    """A frozen parameter's only copy is its shard: altered on disk, close cannot read it back."""
    engine, model, error = failed_engine(tmp_path, "frozen_file")
    assert "CRC32C mismatch" in error
    with pytest.raises(ChecksumError) as info:
        engine.close()
    assert any("could not be read; its parameters are meta tensors now" in n for n in info.value.__notes__)
    del info
    assert engine.closed
    engine.close()
    assert any("zkernel.close.values_lost" in r.getMessage() for r in caplog.records)
    lost = {n for n, p in model.named_parameters() if p.is_meta}
    assert lost == {"frozen_proj.weight"}
    assert model.frozen_proj.weight.shape == (13, 13) and type(model.frozen_proj.weight) is torch.nn.Parameter
    assert all(type(p) is torch.nn.Parameter and torch.isfinite(p).all() for n, p in model.named_parameters() if n not in lost)
    assert not list(tmp_path.glob(RUN_GLOB))
