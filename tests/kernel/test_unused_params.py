"""Parameters that get no gradient in a window are skipped as torch skips them, in every grouping.

A branch not taken, or a parameter frozen after `initialize`, shares its flat group (a zero1/zero2
bucket, a zero3 block unit) with parameters that did get gradients: stepping it on a zero gradient
would move it (weight decay, momentum) and advance its step count. See [Note: parameters without a
gradient] and [Note: per-parameter steps].
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.unused_scenarios import (
    TWO_RANK_CONFIGS,
    config,
    reference,
    reference_rank_routes,
    resume_switching,
    train_switching,
    two_rank_runs,
)
from zkernel.spec.groups import Fragment, ParamGroup, ShardLayout
from zkernel_plugins.optimizers._adam_state import Run, step_runs


def _check(result: dict, expected: dict, label: str) -> None:
    for i, (a, b) in enumerate(zip(result["losses"], expected["losses"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{label} step {i}: {a} vs {b}"
    assert result["state"].keys() == expected["state"].keys()
    # A step on a zero gradient moves a parameter by lr * weight_decay * |p| (2e-4 here) or more; two
    # GPUs against this CPU oracle differ by up to 1.5e-6 (as plain data parallel does there).
    for name, value in expected["state"].items():
        torch.testing.assert_close(result["state"][name].float(), value.float(), rtol=1e-5, atol=1e-5, msg=f"{label}: {name}")


CONFIGS = {
    "none": config("none"),
    "zero1": config("zero1"),
    "zero2 clipped": config("zero2", gradient_clipping=0.5),
    "zero3 blocks": config("zero3"),
    "zero3 blocks, params and optimizer on cpu": config("zero3", "cpu", "cpu"),
    "zero1, optimizer on cpu, speculative": config("zero1", "cpu", gradient_clipping=50.0),
}


@pytest.mark.parametrize("label", list(CONFIGS))
def test_parameters_without_a_gradient_are_skipped_as_torch_skips_them(label):
    _check(train_switching(CONFIGS[label]), reference(1, CONFIGS[label].get("gradient_clipping", 0.0)), label)


def test_speculative_steps_rolled_back_at_per_parameter_counts():
    """Small buckets step during backward on the coefficient that assumes no clipping and roll
    back when the window clips after all; a bucket holding both branches of a block has its
    parameters at different counts (the right branch skipped the first step), so the rollback
    undoes each run at its own count."""
    cfg = config("zero1", "cpu", gradient_clipping=1.0, partitioner_options={"bucket_size": 200})
    cfg["offload"]["optimizer_options"] = {"speculate": "always"}
    result = train_switching(cfg)
    assert result["rollbacks"] > 0
    _check(result, reference(1, 1.0), "zero1 small buckets, speculative, rolled back")


def test_optimizer_on_nvme_skips_them_too(tmp_path):
    cfg = config("zero2", "nvme", gradient_clipping=0.5)
    _check(train_switching(cfg, str(tmp_path)), reference(1, 0.5), "zero2, optimizer on nvme")


@pytest.mark.parametrize("partitioner", ["zero2", "zero3"])
def test_an_optimizer_that_does_not_skip_itself_has_the_skipped_elements_put_back(partitioner):
    """A third-party SGD with momentum that ignores ``skip_params``: the kernel restores the skipped
    parameters' master, momentum and compute copy, so it matches torch's SGD, which skips them."""
    cfg = config(partitioner)
    cfg["optimizer"] = {"name": "momentum_sgd", "lr": 2e-2}
    _check(train_switching(cfg), reference(1, momentum_sgd=True), f"{partitioner}, momentum SGD")


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The two-rank runs, one pair of processes for all (each rank's results by run)."""
    return run_ranks(2, two_rank_runs)


@pytest.mark.parametrize("label", list(TWO_RANK_CONFIGS))
def test_two_ranks_agree_on_what_to_skip(two_ranks, label):
    expected = reference(2, TWO_RANK_CONFIGS[label].get("gradient_clipping", 0.0))
    for rank, runs in enumerate(two_ranks):
        _check(runs[label], expected, f"{label}, rank {rank}")


def test_a_parameter_one_rank_used_is_stepped_on_every_rank(two_ranks):
    """Rank 0 takes one branch and rank 1 the other (both in one zero2 bucket): as under DDP, a
    parameter either rank gave a gradient is stepped everywhere, and only the branch neither took
    (the right one, at the first step) is skipped."""
    for rank, (runs, expected) in enumerate(zip(two_ranks, reference_rank_routes(2))):
        _check(runs["rank routes"], expected, f"zero2, rank {rank}")


def test_a_checkpoint_keeps_each_parameters_step_count_across_groupings(tmp_path):
    """zero3 with one unit per module steps the two branches' groups different numbers of times; the
    checkpoint keeps a count per parameter, so zero2's buckets (both branches in one) resume exactly.
    Loading refused such a checkpoint when a group held one count."""
    saved = config("zero3", partitioner_options={"persistence_threshold": 0, "units": "modules"})
    result = resume_switching(saved, config("zero2"), str(tmp_path / "ckpt"))
    _check(result, reference(1), "zero3 modules -> zero2")


def _group(counts_len: int, fragments: list[tuple[int, int, int]], numel: int) -> ParamGroup:
    frags = tuple(Fragment(param=p, start=0, numel=n, offset=o) for p, o, n in fragments)
    params = tuple(torch.nn.Parameter(torch.zeros(1)) for _ in range(counts_len))
    return ParamGroup(index=0, name="g", params=params, param_names=tuple("abcd"[:counts_len]), requires_grad=True,
                      master=torch.zeros(numel), shard_layout=ShardLayout(numel=numel, fragments=frags))


def test_runs_cover_the_stepped_parameters_at_their_own_counts():
    # Parameters 0-3 at offsets 0, 16, 48, 64 (gaps after 1 and 2), the shard padded to 96.
    group = _group(4, [(0, 0, 10), (1, 16, 20), (2, 48, 5), (3, 64, 30)], 96)
    assert step_runs(group, [3, 3, 3, 3], frozenset()) == [Run(0, 96, 4)], "one call over the whole shard"
    assert step_runs(group, [3, 3, 3, 3], frozenset({2})) == [Run(0, 36, 4), Run(64, 94, 4)]
    assert step_runs(group, [3, 1, 1, 3], frozenset()) == [Run(0, 10, 4), Run(16, 53, 2), Run(64, 94, 4)]
    assert step_runs(group, [3, 1, 1, 3], frozenset(), advance=0) == [Run(0, 10, 3), Run(16, 53, 1), Run(64, 94, 3)]
    # A parameter with no elements on this rank still has its count; the rest join up.
    part = _group(3, [(0, 0, 16), (2, 16, 8)], 32)
    assert step_runs(part, [2, 0, 2], frozenset({1})) == [Run(0, 24, 3)]
