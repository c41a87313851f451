"""Ranks' side of tests/kernel/test_memory_whole.py: a zero3 step and its memory report."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zkernel


def zero3_report(persistence_threshold: int, prefetch_bytes: int) -> dict:
    """One zero3 step of a tiny (72 elements) and a larger (4,160) Linear; this rank's report,
    and every rank's as rank 0 gathers them (`all_gather_object`, as the demo does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 8))
    cfg = {
        "partitioner": "zero3",
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "prefetch_bytes": prefetch_bytes,
        "partitioner_options": {"persistence_threshold": persistence_threshold},
    }
    engine = zkernel.initialize(model, cfg)
    loss = engine(torch.randn(4, 8)).square().mean()
    engine.backward(loss)
    engine.step()
    report = engine.memory_report()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    engine.close()
    return {"report": dict(report), "whole": report.whole, "lines": report.whole_lines(), "gathered_whole": [r.whole for r in gathered]}


def zero3_reports() -> dict:
    """`zero3_report` under each (persistence_threshold, prefetch_bytes) the test reads, in one set of ranks."""
    return {settings: zero3_report(*settings) for settings in ((100, 0), (0, 2**20), (0, 0))}
