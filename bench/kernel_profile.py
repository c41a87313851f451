"""Where a training step's GPU time goes, by kernel category and stream, from torch.profiler.

`profile_steps` runs a step function under the profiler and returns, per step:
the wall time, each stream's busy time, the time no kernel ran on the busiest
stream (its gaps), and the kernel time by category (matrix multiplies,
attention, collectives, optimizer, copies and casts, the rest), plus the
kernels that took longest. The benches print it beside their throughput so a
ratio between two modes can be read as "which kernels".
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
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


def profile_steps(step, steps: int, synchronize, trace_path: str | None = None) -> dict:
    """Run ``step()`` ``steps`` times under torch.profiler (CUDA activity) and summarise per step;
    ``trace_path``: also keep the Chrome trace there, gzipped."""
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
        if trace_path:
            with open(path, "rb") as f, gzip.open(trace_path, "wb") as out:
                shutil.copyfileobj(f, out)
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
        **_idle(on_main, start, HostIndex(events), ms),
        "host_ranges_ms": {k: round(v * ms, 2) for k, v in sorted(ranges.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": name[:120], "ms": round(total * ms, 3), "calls": count // steps} for name, (total, count) in top
        ],
    }


class HostIndex:
    """The host side of a trace: which call launched each kernel, and what each host thread ran."""

    HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")

    def __init__(self, events: list[dict]) -> None:
        self.launches: dict[int, dict] = {}
        self.threads: dict[tuple, list[dict]] = defaultdict(list)
        for e in events:
            if e.get("ph") != "X" or e.get("cat") not in self.HOST_CATEGORIES:
                continue
            self.threads[(e.get("pid"), e.get("tid"))].append(e)
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
                self.launches[e["args"]["correlation"]] = e

    def explain(self, kernel: dict, idle_from: float) -> dict:
        """Why ``kernel`` started only after the stream sat idle from ``idle_from``: the host
        launched it late (and what the launching thread ran meanwhile), or it waited on the device
        (another stream's event) though launched in time."""
        launch = self.launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return {"cause": "unknown"}
        late = launch["ts"] - idle_from
        if late <= 0.1 * (kernel["ts"] - idle_from):
            return {"cause": "device wait", "launched_ms_before": round(-late * 1e-3, 3)}
        window = (idle_from, launch["ts"])
        spans = []
        for e in self.threads[(launch.get("pid"), launch.get("tid"))]:
            overlap = min(window[1], e["ts"] + e["dur"]) - max(window[0], e["ts"])
            if overlap > 0:
                spans.append((overlap, e))
        covering = [e for o, e in spans if o >= 0.5 * late and e.get("cat") not in ("cuda_runtime", "cuda_driver")]
        deepest = min(covering, key=lambda e: e["dur"])["name"][:60] if covering else None
        calls = [(o, e) for o, e in spans if e.get("cat") in ("cuda_runtime", "cuda_driver") and o >= 0.2 * late]
        blocking = max(calls, key=lambda oe: oe[0])[1]["name"] if calls else None
        return {"cause": "host late", "late_ms": round(late * 1e-3, 3), "host_in": deepest, "blocking_call": blocking,
                "launched_by": launch["name"]}


def _idle(ordered: list[dict], start: float, host: HostIndex, ms: float, count: int = 12) -> dict:
    """The stream's longest gaps, and its idle time per step by cause (host late: by what the
    launching thread ran meanwhile)."""
    gaps = _gaps(ordered, start, host)
    by_cause: dict[str, float] = defaultdict(float)
    host_late_in: dict[str, float] = defaultdict(float)
    for g in gaps:
        why = g.get("why", {})
        by_cause[why.get("cause", "unknown")] += g["ms"]
        if why.get("cause") == "host late":
            host_late_in[str(why.get("blocking_call") or why.get("host_in"))] += why["late_ms"]
    per_step = ms * 1e3
    return {
        "main_gaps": sorted(gaps, key=lambda g: -g["ms"])[:count],
        "main_idle_by_cause_ms": {k: round(v * per_step, 2) for k, v in by_cause.items()},
        "host_late_in_ms": {k: round(v * per_step, 2) for k, v in sorted(host_late_in.items(), key=lambda kv: -kv[1])[:10]},
    }


def _gaps(ordered: list[dict], start: float, host: HostIndex | None = None) -> list[dict]:
    """The longest stretches with no kernel on one stream: where, between which kernels, and why."""
    gaps, reach, last = [], None, None
    for e in ordered:
        if reach is not None and e["ts"] > reach:
            gap = {"ms": round((e["ts"] - reach) * 1e-3, 3), "at_ms": round((reach - start) * 1e-3, 2),
                   "after": last["name"][:70], "before": e["name"][:70]}
            if host is not None:
                gap["why"] = host.explain(e, reach)
            gaps.append(gap)
        if reach is None or e["ts"] + e["dur"] > reach:
            reach, last = e["ts"] + e["dur"], e
    return gaps


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
    gaps = "; ".join(
        f"{g['ms']:.2f} ms at {g['at_ms']:.1f} ({g['after'][:40]} -> {g['before'][:40]}; {_why(g.get('why'))})"
        for g in summary["main_gaps"][:8]
    )
    causes = ", ".join(f"{k} {v:.1f}" for k, v in summary.get("main_idle_by_cause_ms", {}).items())
    late = "; ".join(f"{k} {v:.2f}" for k, v in summary.get("host_late_in_ms", {}).items())
    return (
        f"  {label} longest idle: {gaps}\n"
        f"  {label} idle ms per step by cause: {causes}; host late in: {late}\n"
        f"  {label} per step: wall {summary['wall_ms']:.1f} ms, main stream busy {summary['main_busy_ms']:.1f} "
        f"(idle {summary['main_idle_ms']:.1f}); kernel ms: {cats}"
    )


def _why(why: dict | None) -> str:
    if not why:
        return "?"
    if why["cause"] != "host late":
        return why["cause"]
    text = f"host late {why['late_ms']:.2f} ms in {why['host_in']}"
    return text + (f", blocked in {why['blocking_call']}" if why["blocking_call"] else "")
