"""`Engine.memory_report()` says which parameters zero3 holds whole on a rank, and why ([Note: parameters kept whole])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.harness import run_ranks
from tests.support.memory_whole_scenarios import zero3_reports
from zkernel_plugins.partitioners._flat import FlatLayout


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(2, zero3_reports)


def _padded_fp32_bytes(*shapes) -> int:
    return FlatLayout.of([nn.Parameter(torch.empty(s)) for s in shapes], 2, 0).padded * 4


def test_units_under_the_persistence_threshold_are_named_with_the_key_to_change(ranks):
    results = [rank[100, 0] for rank in ranks]
    for result in results:
        (entry,) = result["whole"]
        # The first Linear (8x8 + 8 = 72 elements) is under 100; the others are sharded.
        assert entry.params == 2 and entry.nbytes == _padded_fp32_bytes((8, 8), (8,))
        assert entry.setting == "partitioner_options.persistence_threshold"
        assert "persistence_threshold = 100 elements" in entry.why
        (line,) = result["lines"]
        assert line.startswith("2 parameters (") and "set partitioner_options.persistence_threshold" in line, line
        # What is whole is part of the report's params, beside this rank's shards.
        assert result["report"]["params"]["cpu"] > entry.nbytes
        assert result["gathered_whole"] == [r["whole"] for r in results]  # reports keep it across ranks


def test_units_gathered_ahead_of_the_next_forward_are_named_and_nothing_else(ranks):
    for rank in ranks:
        (entry,) = rank[0, 2**20]["whole"]
        assert entry.setting == "prefetch_bytes" and "prefetch_bytes = 1.00 MiB" in entry.why
        assert entry.params >= 2  # at least the first unit, gathered for the next forward
        assert rank[0, 0]["whole"] == ()  # nothing whole: every unit sharded, none gathered ahead
