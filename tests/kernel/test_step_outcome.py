"""A step is taken whole or not at all, on every rank ([Note: a step is all-or-nothing] in
`zkernel.kernel.step_outcome`, [Note: non-finite gradients] in `zkernel.kernel.step_scaling`): a NaN loss
with clipping off is skipped, counted and logged; a swap-file write that fails in the middle of a step
(a real RLIMIT_FSIZE in one rank's process) makes every rank raise at the same step, and running the
batch again once the disk has room ends at torch's uninterrupted model; the same for a parameter shard's
swap write under zero3 (the step after it fails); where the norm is not read, a device flag skips a
non-finite step. On 2 gloo ranks against torch."""

from __future__ import annotations

import math

import pytest
import torch

import zkernel

from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses
from tests.support.step_outcome_scenarios import (
    LR,
    WD,
    nonfinite_flag,
    nonfinite_loss,
    params_write_failure,
    write_failure_mid_step,
)


def _torch_params(data, clip: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TrickyNet()
    reference_losses(model, data, LR, WD, clip)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_close(got: dict, want: dict, label: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    for name, value in want.items():
        assert torch.isfinite(got[name]).all(), f"{label}: {name} is not finite"
        torch.testing.assert_close(got[name], value.float(), rtol=rtol, atol=atol, msg=lambda m: f"{label}: {name}: {m}")


@pytest.mark.parametrize(
    ("precision", "offload", "poison_ranks", "where"),
    [
        ("fp32", "cpu", (1,), "loss"),
        ("fp32", "cpu", (0, 1), "loss"),
        ("fp32", "cpu", (1,), "embed"),  # other groups stepped during backward: rolled back
        ("bf16", "cpu", (0,), "embed"),
        ("bf16", "cpu", (0,), "loss"),
        ("bf16", "none", (1,), "loss"),
        ("fp32", "none", (0, 1), "loss"),
    ],
)
def test_a_nonfinite_gradient_with_clipping_off_is_skipped_counted_and_logged(precision, offload, poison_ranks, where):
    results = run_ranks(2, nonfinite_loss, precision, offload, poison_ranks, where, timeout=240)
    label = f"{precision} offload={offload} NaN on {poison_ranks} ({where})"
    for rank, r in enumerate(results):
        poisoned, clean = r["poisoned"], r["clean"]
        assert poisoned["skipped"] == 1 and poisoned["global_steps"] == 4, (label, rank)
        assert len(poisoned["warnings"]) == 1 and poisoned["warnings"][0]["action"] == "skipped", (label, rank)
        assert not math.isfinite(poisoned["warnings"][0]["norm"]), (label, rank)
        # Equal to the run that never saw the batch. A rolled-back step leaves a few ulps in the moments,
        # relatively large where the rolled-back gradient dwarfed them, which the next steps carry on.
        # In bf16 such an ulp may round a parameter's bf16 copy the other way, and an element whose
        # gradient is near zero then moves by up to the rate: compared within twice the rate there.
        tol = {"rtol": 1e-6, "atol": 1e-7}
        if where == "embed":
            tol = {"rtol": 1e-3, "atol": 1e-4} if precision == "fp32" else {"rtol": 0.0, "atol": 2 * LR}
        _assert_close(poisoned["params"], clean["params"], f"{label} rank {rank}", **tol)
        if where == "embed" and offload == "cpu":
            assert poisoned["early_steps"] > 0 and poisoned["rollbacks"] > 0, (label, rank)
    if precision == "fp32":
        data = batches(5, 4, 1, 2, 2)
        _assert_close(results[0]["poisoned"]["params"], _torch_params(data[:2] + data[3:], 0.0), label)


@pytest.mark.parametrize(("clip", "accum"), [(0.0, 1), (1.0, 1), (0.0, 2)])
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_write_failure_mid_step_fails_that_step_on_every_rank_and_a_retry_continues_exactly(tmp_path, clip, accum, fail_rank):
    results = run_ranks(2, write_failure_mid_step, str(tmp_path), clip, fail_rank, 6, 2, accum, timeout=90)
    label = f"clip {clip}, accumulation {accum}, the disk of rank {fail_rank} fails"
    first = [r["errors"] for r in results]
    assert all(len(e) == 1 for e in first), (label, first)
    assert first[0][0]["batch"] == first[1][0]["batch"], (label, first)
    assert first[0][0]["global_steps"] == first[1][0]["global_steps"] == first[0][0]["batch"], (label, first)
    # Back at the window's start: its micro-batches run again.
    assert first[0][0]["micro_steps"] == first[1][0]["micro_steps"] == first[0][0]["batch"] * accum, (label, first)
    for rank, r in enumerate(results):
        error = r["errors"][0]
        assert error["errno"] == 27 and error["filename"].endswith(".swap"), (label, rank, error)
        assert any("was not taken on any rank" in note for note in error["notes"]), (label, rank, error)
        assert len(r["refused"]) == 1 and "run this accumulation window's micro-batches again" in r["refused"][0]
        assert r["global_steps"] == 6, (label, rank)
        if clip == 0.0:
            assert r["early_steps"] > 0, (label, rank)
    _assert_close(results[0]["params"], _torch_params(batches(7, 6, accum, 2, 2), clip), label)
    _assert_close(results[1]["params"], results[0]["params"], label, rtol=0, atol=0)


def _warmup_lr(applied: int) -> float:
    """DeepSpeed's linear WarmupLR (min LR/10, max LR, 3 steps) for the step after ``applied`` applied steps."""
    t = applied - 1
    return LR / 10 if t < 0 else LR / 10 + (LR - LR / 10) * min(1.0, t / 3)


def _check_flag_run(results: list, stage: str, precision: str, steps: int, poison_step: int) -> None:
    world = len(results)
    for rank, r in enumerate(results):
        label = f"{stage} {precision} rank {rank} on {r['device']}"
        assert r["pending_after_poison"] is True, label  # read one step late, not at once
        assert r["last_grad_norm"] is None, label  # the norm was never read on the host
        assert r["skipped"] == 1 and r["global_steps"] == steps, label
        assert [(w["step"], w["action"], w["found"], w["log_level"]) for w in r["warnings"]] == [
            (poison_step, "skipped", "device flag", "warning")
        ], label
        assert r["lr"] == pytest.approx(_warmup_lr(steps - 1)), label
    data = batches(5, steps, 1, world, 2)
    kept = data[:poison_step] + data[poison_step + 1 :]
    torch.manual_seed(0)
    model = TrickyNet()
    reference_losses(model, kept, LR, WD, 0.0, schedule=[(_warmup_lr(i), (0.9, 0.999)) for i in range(len(kept))])
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    on_gpu = results[0]["device"].startswith("cuda")
    tol = {"rtol": 1e-4 if on_gpu else 1e-5, "atol": 1e-5 if on_gpu else 1e-6}
    if precision != "fp32":
        tol = {"rtol": 2e-2, "atol": 2e-2}
    _assert_close(results[0]["params"], want, f"{stage} {precision}", **tol)
    for r in results[1:]:
        _assert_close(r["params"], results[0]["params"], f"{stage} {precision} ranks", rtol=0, atol=0)


@pytest.mark.parametrize(("stage", "precision"), [("zero2", "fp32"), ("zero3", "bf16")])
def test_a_nonfinite_gradient_where_the_norm_is_not_read_is_skipped_by_a_device_flag(stage, precision):
    """[Note: a non-finite flag read one step late]: the step is a no-op on the device, the host learns it
    before the next step; skipped, counted, warned, the Adam counts and the schedule as if skipped at once.
    Two gloo ranks on the CPU, where the test asks for the path a GPU takes; NaN on rank 1 only."""
    steps, poison_step = 5, 2
    results = run_ranks(2, nonfinite_flag, stage, precision, steps, poison_step, 1, timeout=120)
    _check_flag_run(results, stage, precision, steps, poison_step)


@pytest.mark.cuda
@pytest.mark.parametrize("implementation", ["auto", "fused"])  # auto: the Triton kernel where Triton imports
@pytest.mark.parametrize(("stage", "precision"), [("zero1", "fp32"), ("zero3", "fp32"), ("zero3", "bf16")])
def test_cuda_a_nonfinite_gradient_is_skipped_by_the_device_flag_without_reading_the_norm(stage, precision, implementation):
    """On one GPU the norm is not read with clipping off (a host wait per step): the device flag skips the
    step, as the CPU test checks with the path forced."""
    steps, poison_step = 5, 2
    results = run_ranks(1, nonfinite_flag, stage, precision, steps, poison_step, 0, implementation, timeout=300)
    assert results[0]["device"].startswith("cuda")
    _check_flag_run(results, stage, precision, steps, poison_step)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_cuda_two_ranks_skip_together_when_one_gradient_shard_is_nonfinite(stage):
    """NCCL: the flag's all-reduce runs on the device; the rank whose shard is clean skips too."""
    steps, poison_step = 5, 2
    results = run_ranks(2, nonfinite_flag, stage, "fp32", steps, poison_step, 1, timeout=300)
    assert all(r["device"].startswith("cuda") for r in results)
    _check_flag_run(results, stage, "fp32", steps, poison_step)


@pytest.mark.parametrize(("optimizer", "clip", "fail_rank"), [("cpu", 0.0, 1), ("none", 0.0, 0)])
def test_a_failed_parameter_swap_write_fails_the_next_step_on_every_rank_and_a_retry_continues_exactly(
    tmp_path, optimizer, clip, fail_rank
):
    """The nvme tier's params role: a shard write of step k that fails (a real RLIMIT_FSIZE on one rank)
    is agreed at step k+1's boundary, which no rank takes; the newest shard stays in host memory, the
    forward reads it, and running the window again ends at torch's uninterrupted model."""
    steps, fail_step = 4, 1
    results = run_ranks(2, params_write_failure, str(tmp_path), optimizer, clip, fail_rank, steps, fail_step, timeout=120)
    label = f"offload.optimizer {optimizer}, clip {clip}, the disk of rank {fail_rank} fails"
    first = [r["errors"] for r in results]
    assert all(len(e) == 1 for e in first), (label, first)
    for rank, r in enumerate(results):
        error = r["errors"][0]
        assert error["batch"] == fail_step + 1 and error["global_steps"] == fail_step + 1, (label, rank, error)
        assert error["micro_steps"] == fail_step + 1, (label, rank, error)
        assert error["errno"] == 27 and error["filename"].endswith(".swap"), (label, rank, error)
        assert "params-" in error["filename"], (label, rank, error)
        assert any("was not taken on any rank" in note for note in error["notes"]), (label, rank, error)
        assert len(r["refused"]) == 1, (label, rank)
        assert r["global_steps"] == steps, (label, rank)
    _assert_close(results[0]["params"], _torch_params(batches(7, steps, 1, 2, 2), clip), label)
    _assert_close(results[1]["params"], results[0]["params"], label, rtol=0, atol=0)


def test_a_failed_parameter_swap_write_of_the_last_step_loses_nothing_at_close(tmp_path):
    """The last step's shard writes fail on one rank and no step follows: nothing raises mid-run (no rank
    leaves the others), and close gives back torch's model, the newest values having stayed in memory."""
    steps = 4
    results = run_ranks(2, params_write_failure, str(tmp_path), "none", 0.0, 1, steps, steps - 1, timeout=120)
    for rank, r in enumerate(results):
        assert r["errors"] == [] and r["global_steps"] == steps, rank
    _assert_close(results[0]["params"], _torch_params(batches(7, steps, 1, 2, 2), 0.0), "last step")
    _assert_close(results[1]["params"], results[0]["params"], "last step ranks", rtol=0, atol=0)


def test_a_checkpoint_saved_before_the_flag_is_read_resumes_exactly(tmp_path):
    """A save right after a step the device flag skipped, before anything read it: the checkpoint holds
    the corrected Adam counts and skipped_steps, so a resume continues as the run itself does."""
    from tests.support.step_outcome_scenarios import WARMUP

    cfg = {"partitioner": "zero1", "gradient_clipping": 0.0, "lr_schedule": WARMUP,
           "optimizer": {"name": "adamw", "lr": LR, "weight_decay": WD}}
    data = batches(5, 5, 1, 1, 2)

    def train(engine, first: int, last: int, poison: int | None = None) -> None:
        for i in range(first, last):
            tokens, targets = data[i][0][0]
            loss = engine(tokens, targets)
            engine.backward(loss * float("nan") if i == poison else loss)
            engine.step()

    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, cfg)
    engine.scaling.norm_is_free = False  # the path a GPU takes ([Note: a non-finite flag read one step late])
    train(engine, 0, 2, poison=1)
    assert engine.pipeline.found_inf_pending
    engine.save_checkpoint(tmp_path)
    train(engine, 2, 5)
    assert engine.skipped_steps == 1
    engine.close()
    torch.manual_seed(1)
    resumed = TrickyNet()
    again = zkernel.initialize(resumed, cfg)
    again.scaling.norm_is_free = False
    again.load_checkpoint(tmp_path)
    assert again.skipped_steps == 1 and again.global_steps == 2
    train(again, 2, 5)
    again.close()
    _assert_close(dict(resumed.named_parameters()), {n: p.detach() for n, p in model.named_parameters()}, "resumed",
                  rtol=0, atol=0)
