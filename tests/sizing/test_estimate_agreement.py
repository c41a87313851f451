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
