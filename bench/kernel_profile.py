"""Where a training step's GPU time goes, by kernel category and stream, from torch.profiler.

`profile_steps` runs a step function under the profiler and returns, per step:
the wall time, each stream's busy time, the time no kernel ran on the busiest
stream (its gaps), and the kernel time by category (matrix multiplies,
attention, collectives, optimizer, copies and casts, the rest), plus the
kernels that took longest. The benches print it beside their throughput so a
ratio between two modes can be read as "which kernels".
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import defaultdict

# First match wins; names are the CUDA kernels' (mangled C++ names included).
CATEGORIES = (
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|wgmma|cublas", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply", re.I)),
    ("copy/cast", re.compile(r"copy|cast|memcpy|memset|fill|cat_|index|gather|scatter", re.I)),
    ("norm/act/loss", re.compile(r"layer_norm|norm|gelu|softmax|cross_entropy|nll|log_softmax|reduce", re.I)),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "elementwise/other"


def profile_steps(step, steps: int, synchronize) -> dict:
    """Run ``step()`` ``steps`` times under torch.profiler (CUDA activity) and summarise per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        synchronize()
        for _ in range(steps):
            step()
        synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return summarise(events, steps)


def summarise(events: list[dict], steps: int) -> dict:
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    if not kernels:
        return {"error": "no GPU activity recorded"}
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    by_category: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    by_stream: dict[int, list] = defaultdict(list)
    for e in kernels:
        name = e.get("name", "?")
        by_category[category(name)] += e["dur"]
        by_name[name][0] += e["dur"]
        by_name[name][1] += 1
        by_stream[e.get("args", {}).get("stream", -1)].append((e["ts"], e["ts"] + e["dur"]))
    busy = {stream: _union(spans) for stream, spans in by_stream.items()}
    main = max(busy, key=busy.get)
    on_main = sorted((e for e in kernels if e.get("args", {}).get("stream", -1) == main), key=lambda e: e["ts"])
    ms = 1e-3 / steps
    ranges: dict[str, float] = defaultdict(float)  # the engine's own host-side ranges (zkernel::...)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("zkernel::"):
            ranges[e["name"]] += e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "wall_ms": (end - start) * ms,
        "main_stream": main,
        "main_busy_ms": busy[main] * ms,
        "main_idle_ms": ((end - start) - busy[main]) * ms,
        "streams_busy_ms": {str(s): round(b * ms, 2) for s, b in sorted(busy.items(), key=lambda kv: -kv[1])},
        "categories_ms": {k: round(v * ms, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "main_gaps": _gaps(on_main, start),
        "host_ranges_ms": {k: round(v * ms, 2) for k, v in sorted(ranges.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": name[:120], "ms": round(total * ms, 3), "calls": count // steps} for name, (total, count) in top
        ],
    }


def _gaps(ordered: list[dict], start: float, count: int = 12) -> list[dict]:
    """The longest stretches with no kernel on one stream: where, and between which kernels."""
    gaps, reach, last = [], None, None
    for e in ordered:
        if reach is not None and e["ts"] > reach:
            gaps.append({"ms": round((e["ts"] - reach) * 1e-3, 3), "at_ms": round((reach - start) * 1e-3, 2),
                         "after": last["name"][:70], "before": e["name"][:70]})
        if reach is None or e["ts"] + e["dur"] > reach:
            reach, last = e["ts"] + e["dur"], e
    return sorted(gaps, key=lambda g: -g["ms"])[:count]


def _union(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi <= reach:
            continue
        total += hi - max(lo, reach)
        reach = hi
    return total


def format_summary(label: str, summary: dict) -> str:
    if "error" in summary:
        return f"  {label} kernels: {summary['error']}"
    cats = ", ".join(f"{k} {v:.1f}" for k, v in summary["categories_ms"].items())
    gaps = "; ".join(f"{g['ms']:.2f} ms at {g['at_ms']:.1f} ({g['after'][:40]} -> {g['before'][:40]})" for g in summary["main_gaps"][:6])
    return (
        f"  {label} longest idle: {gaps}\n"
        f"  {label} per step: wall {summary['wall_ms']:.1f} ms, main stream busy {summary['main_busy_ms']:.1f} "
        f"(idle {summary['main_idle_ms']:.1f}); kernel ms: {cats}"
    )
