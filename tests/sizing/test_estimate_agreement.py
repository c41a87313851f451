"""The planner and `zkernel.estimate` count one placement's bytes alike (one tally, pooled staging included)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zkernel
from zkernel.sizing.estimator import totals
from zkernel.sizing.planning import plan


def stack(depth: int = 6, width: int = 64) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


@pytest.mark.parametrize(
    ("partitioner", "optimizer", "params"),
    [("zero1", "cpu", "none"), ("zero2", "cpu", "none"), ("zero3", "cpu", "cpu"), ("zero3", "none", "cpu")],
)
def test_the_plan_of_a_fixed_placement_has_the_estimates_bytes(partitioner, optimizer, params):
    config = {
        "partitioner": partitioner,
        "precision": "bf16",
        "prefetch_bytes": 0,
        "offload": {"optimizer": optimizer, "params": params},
        # A separate device (bf16 host staging copies are counted), not measured.
        "planner": {"gpu_memory": "1GiB", "ram": "8GiB", "options": {"measure": False}},
    }
    if partitioner == "zero3":
        config["partitioner_options"] = {"persistence_threshold": 0}
    decision = plan(stack(), config, 1, gpus=1, keys=())
    expected = totals(zkernel.estimate(stack(), config, 1, device="cuda"))
    got = {place: kinds["model_states"] for place, kinds in decision.bytes.items() if kinds.get("model_states")}
    assert got == {("device" if place == "cuda" else place): n for place, n in expected.items() if n}


def test_a_window_of_one_backward_holds_no_whole_gradient():
    """With gradient_accumulation_steps = 1, none and zero1 reduce the whole fp32 gradient in the
    backward that made it: after it only the landing buffer is held, as memory_report measures."""
    from tests.sizing.test_estimator import check
    from tests.support.harness import run_ranks
    from tests.support.scenarios import memory_after_step, small_gpt

    cfgs = [
        {"partitioner": partitioner, "precision": precision, "gradient_accumulation_steps": 1, "prefetch_bytes": 0, "offload": {"optimizer": tier}}
        for partitioner, tier, precision in [("zero1", "none", "fp32"), ("zero1", "cpu", "bf16"), ("none", "cpu", "fp32"), ("none", "none", "bf16")]
    ]
    measured = run_ranks(2, memory_after_step, "gpt", cfgs)[0]
    with torch.device("meta"):
        model = small_gpt()
    for cfg, result in zip(cfgs, measured, strict=True):
        predicted = zkernel.estimate(model, cfg, 2, device="cpu")
        assert check(predicted, result, str(cfg)), (cfg, predicted, result)
