"""ZeRO memory accounting, partitioned construction, fp16 overflow, bf16 training, on real gloo ranks."""

from __future__ import annotations

import math

import pytest

from tests.support.harness import run_ranks
from zkernel_plugins.partitioners._flat import ALIGN
from tests.support.scenarios import LIVE_EXTRAS, PARTITIONED_PREFETCH_BYTES, fp16_overflow, memory_by_stage, partitioned_construction, train

WIDTH, DEPTH = 96, 4
FP32 = 4


def _total(report: dict, category: str) -> int:
    return sum(report[category].values())


def _memory_all_stages():
    by_stage = {stage: memory_by_stage(stage, WIDTH, DEPTH) for stage in ("none", "zero1", "zero2", "zero3")}
    by_stage["zero3 without prefetch"] = memory_by_stage("zero3", WIDTH, DEPTH, prefetch_bytes=0)
    return by_stage


def _two_rank_runs() -> dict:
    """Every two-rank run of this module in one pair of processes (one spawn, not two)."""
    return {"by_stage": _memory_all_stages(), "fp16 overflow": fp16_overflow(1, 2, 4)}


def _four_rank_runs() -> dict:
    """Every four-rank run of this module in one set of processes (one spawn, not two). The memory
    accounting goes first, its `alive` counting every tensor of the process; `partitioned_construction`
    measures the growth of the peak RSS from its own warm-up on, which the small models before it
    leave unchanged (54.5-54.8 MiB per rank in either order, as in processes of its own)."""
    return {"by_stage": _memory_all_stages(), "partitioned": partitioned_construction(1024, 16, 3)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(2, _two_rank_runs)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(4, _four_rank_runs)


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_bytes_follow_zero_accounting(world, request):
    results = [runs["by_stage"] for runs in request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[world])]
    for rank, by_stage in enumerate(results):
        n = by_stage["none"]["numel"]
        # Padding: each unit (DEPTH of them) rounds every rank's slice up to ALIGN elements
        # ([Note: aligned parameters]); this model's parameters need no gaps between them.
        pad = DEPTH * ALIGN * world * FP32 * 2
        full, shard = n * FP32, math.ceil(n / world) * FP32

        def check(stage, category, expected, slack=pad, when="memory"):
            got = _total(by_stage[stage][when], category)
            assert expected <= got <= expected + slack, f"rank {rank} {stage} {category} ({when}): {got} vs {expected}"

        check("none", "optimizer_state", 2 * full)
        check("none", "params", full)
        check("none", "grads", full, when="backward")
        check("none", "grads", 0, slack=0)  # freed after the step, as zero_grad(set_to_none=True)
        check("zero1", "optimizer_state", 2 * shard)
        check("zero1", "params", full)
        # The whole local gradient is reduce-scattered at the boundary; only the shard reaches the step.
        check("zero1", "grads", shard, when="backward")
        check("zero1", "grads", 0, slack=0)
        check("zero2", "optimizer_state", 2 * shard)
        check("zero2", "params", full)
        check("zero2", "grads", shard, when="backward")
        check("zero2", "grads", 0, slack=0)  # freed after the step
        check("zero3", "optimizer_state", 2 * shard)
        # Between steps the units the next forward starts with (within prefetch_bytes: here all of
        # them) are being gathered already ([Note: prefetch across the step]); without prefetch
        # only the shard is held.
        check("zero3", "params", shard + full, slack=2 * pad)
        check("zero3 without prefetch", "params", shard)
        check("zero3", "grads", shard, when="backward")
        check("zero3", "grads", 0, slack=0)
        for stage in by_stage:
            assert _total(by_stage[stage]["memory"], "master_weights") == 0, "fp32 masters alias the parameters"
            # What the report counts is what is actually alive: every tensor storage reachable
            # from Python, less small extras (buffers, placeholders, the step counters).
            reported = sum(_total(by_stage[stage]["memory"], c) for c in by_stage[stage]["memory"])
            alive = by_stage[stage]["alive"]
            assert reported <= alive <= reported + LIVE_EXTRAS, f"rank {rank} {stage}: alive {alive} vs reported {reported}"


def test_partitioned_construction_never_builds_the_whole_model(four_ranks):
    # 16 x 1024^2 fp32 = 64 MiB of parameters. Each of 4 ranks keeps what memory_report() counts
    # (a quarter of the parameters and of the optimizer state, allocated up front) plus one unit
    # while it is built; building the whole model first would need all of it on top.
    results = [runs["partitioned"] for runs in four_ranks]
    for rank, r in enumerate(results):
        transient = r["init_growth"] - r["held_bytes"]
        assert transient < 0.75 * r["full_bytes"], (
            f"rank {rank} grew {r['init_growth']} B during init, {r['held_bytes']} B held (full model {r['full_bytes']} B)"
        )
        # Between steps: the shard, and the first units of the next forward being gathered
        # already, within prefetch_bytes ([Note: prefetch across the step]).
        assert _total(r["memory"], "params") <= r["full_bytes"] / 4 + PARTITIONED_PREFETCH_BYTES + 64 * 1024
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["losses"][-1] < r["losses"][0]


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(two_ranks):
    results = [runs["fp16 overflow"] for runs in two_ranks]
    for r in results:
        assert r["skipped"] == 1
        assert r["scales"] == [1024.0, 1024.0, 512.0, 512.0]
        assert r["checksums"][2] == r["checksums"][1], "the overflowing step must not change the masters"
        assert r["checksums"][3] != r["checksums"][2]


@pytest.mark.parametrize("stage", ["none", "zero2", "zero3"])
def test_bf16_tracks_fp32(stage):
    cfg = {"partitioner": stage, "optimizer": {"lr": 2e-2}, "gradient_clipping": 1.0}
    if stage == "zero3":
        cfg["partitioner_options"] = {"persistence_threshold": 0}
    fp32 = train(cfg, 8, 1, 4, 7)["losses"]
    bf16 = train({**cfg, "precision": "bf16"}, 8, 1, 4, 7)
    assert bf16["memory"]["master_weights"], "bf16 keeps separate fp32 masters"
    for a, b in zip(bf16["losses"], fp32):
        assert abs(a - b) < 0.05 * abs(b), (bf16["losses"], fp32)
    assert bf16["losses"][-1] < bf16["losses"][0]
