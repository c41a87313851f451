"""zkernel's profiler ranges: recorded under torch's profiler, free without one."""

from __future__ import annotations

import torch

import zkernel
from zkernel.telemetry.profiling import profiler_range


def test_ranges_appear_in_a_profile_and_cost_nothing_otherwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine = zkernel.initialize(model, {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}})
    x = torch.randn(4, 8)
    assert not isinstance(profiler_range("zkernel::idle"), torch.profiler.record_function)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.backward(engine(x).square().mean())
        engine.step()
    names = {e.name for e in prof.events()}
    assert {"zkernel::forward", "zkernel::backward", "zkernel::step", "zkernel::fetch"} <= names, sorted(
        n for n in names if n.startswith("zkernel")
    )
    engine.close()
