"""A step is taken whole or not at all, on every rank ([Note: a step is all-or-nothing] in
`zkernel.kernel.step_outcome`, [Note: non-finite gradients] in `zkernel.kernel.engine`): a NaN loss
with clipping off is skipped, counted and logged; a swap-file write that fails in the middle of a step
(a real RLIMIT_FSIZE in one rank's process) makes every rank raise at the same step, and running the
batch again once the disk has room ends at torch's uninterrupted model. On 2 gloo ranks against torch."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses
from tests.support.step_outcome_scenarios import LR, WD, nonfinite_loss, write_failure_mid_step


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
