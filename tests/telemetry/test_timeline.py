"""The step timeline: interval arithmetic, step summaries, logs, the Chrome trace, threads, CUDA events."""

from __future__ import annotations

import contextlib

import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from structlog.testing import capture_logs

from zkernel.telemetry import intervals
from zkernel.telemetry.gpu_clock import MAX_RATE, ClockFit
from zkernel.telemetry.timeline import SpanKind, StepSummary, Timeline, summarize

K = SpanKind
CPU = torch.device("cpu")


# -- interval arithmetic ---------------------------------------------------------------


@pytest.mark.parametrize(
    "given,expected",
    [
        ([], []),
        ([(3.0, 3.0), (5.0, 4.0)], []),  # empty and reversed intervals drop out
        ([(5.0, 6.0), (0.0, 1.0)], [(0.0, 1.0), (5.0, 6.0)]),  # sorted
        ([(0.0, 2.0), (1.0, 3.0)], [(0.0, 3.0)]),  # overlap
        ([(0.0, 1.0), (1.0, 2.0)], [(0.0, 2.0)]),  # touching
        ([(0.0, 10.0), (2.0, 3.0), (4.0, 5.0)], [(0.0, 10.0)]),  # contained
        ([(4.0, 6.0), (0.0, 1.0), (0.5, 4.5), (8.0, 9.0)], [(0.0, 6.0), (8.0, 9.0)]),
    ],
)
def test_union(given, expected):
    assert intervals.union(given) == expected


@pytest.mark.parametrize(
    "a,b,expected",
    [
        ([], [(0.0, 1.0)], []),
        ([(0.0, 1.0)], [(1.0, 2.0)], []),  # touching only
        ([(0.0, 10.0)], [(2.0, 3.0), (5.0, 12.0)], [(2.0, 3.0), (5.0, 10.0)]),
        ([(0.0, 2.0), (3.0, 5.0), (6.0, 8.0)], [(1.0, 7.0)], [(1.0, 2.0), (3.0, 5.0), (6.0, 7.0)]),
        ([(1.0, 2.0)], [(0.0, 3.0)], [(1.0, 2.0)]),
    ],
)
def test_intersection_is_symmetric_and_right(a, b, expected):
    assert intervals.intersection(a, b) == expected
    assert intervals.intersection(b, a) == expected


def test_length():
    assert intervals.length([]) == 0
    assert intervals.length([(0.0, 1.5), (2.0, 4.0)]) == pytest.approx(3.5)


# -- summaries ---------------------------------------------------------------------------


def test_summary_by_hand():
    spans = [
        (K.COMPUTE, 0.0, 6.0, 0),
        (K.COMPUTE, 5.0, 10.0, 0),  # overlaps the first compute span: compute busy 10, not 11
        (K.D2H, 2.0, 4.0, 1_000),
        (K.D2H, 3.0, 6.0, 2_000),  # d2h union: [2,6] and [9,12] = 7
        (K.D2H, 9.0, 12.0, 4_000),
        (K.CPU_STEP, 13.0, 15.0, 0),  # nothing computes then
        (K.NVME_READ, 1.0, 1.0, 0),  # zero length
    ]
    s = summarize(7, reversed(spans))
    assert s.step == 7
    assert s.wall_s == pytest.approx(15.0)
    assert s.busy_s == pytest.approx({K.COMPUTE: 10.0, K.D2H: 7.0, K.CPU_STEP: 2.0, K.NVME_READ: 0.0})
    assert s.hidden_s == pytest.approx({K.COMPUTE: 10.0, K.D2H: 5.0, K.CPU_STEP: 0.0, K.NVME_READ: 0.0})
    assert s.exposed_s == pytest.approx({K.COMPUTE: 0.0, K.D2H: 2.0, K.CPU_STEP: 2.0, K.NVME_READ: 0.0})
    assert s.exposed_total_s == pytest.approx(4.0)  # d2h [10,12] and cpu_step [13,15]
    assert s.idle_s == pytest.approx(1.0)  # [12,13]
    assert s.nbytes == {K.D2H: 7_000}
    assert s.gbps == pytest.approx({K.D2H: 7_000 / 7.0 / 1e9})
    assert s.count == {K.COMPUTE: 2, K.D2H: 3, K.CPU_STEP: 1, K.NVME_READ: 1}


def test_summary_of_overlapping_transfer_kinds_counts_exposed_time_once():
    # h2d and nvme_read overlap each other outside compute: the step lost [0, 4] once, not 3 + 3.
    s = summarize(0, [(K.H2D, 0.0, 3.0, 0), (K.NVME_READ, 1.0, 4.0, 0), (K.COMPUTE, 4.0, 5.0, 0)])
    assert s.exposed_s[K.H2D] == pytest.approx(3.0) and s.exposed_s[K.NVME_READ] == pytest.approx(3.0)
    assert s.exposed_total_s == pytest.approx(4.0)
    assert s.idle_s == 0


def test_empty_step_summary():
    s = summarize(3, [])
    assert (s.step, s.wall_s, s.exposed_total_s, s.busy_s, s.gbps) == (3, 0.0, 0.0, {}, {})
    assert s.log_fields() == {"step": 3, "wall_ms": 0.0, "exposed_ms": 0.0, "idle_ms": 0.0}


def test_log_fields_per_kind():
    s = summarize(2, [(K.COMPUTE, 0.0, 0.010, 0), (K.H2D, 0.008, 0.012, 4_000_000)])
    assert s.log_fields() == {
        "step": 2,
        "wall_ms": 12.0,
        "exposed_ms": 2.0,
        "idle_ms": 0.0,
        "compute_ms": 10.0,
        "h2d_ms": 4.0,
        "h2d_exposed_ms": 2.0,
        "h2d_gbps": 1.0,
    }


# -- the clock fit (GPU timer -> perf_counter) ---------------------------------------------


def _simulate_fit(rate, delays, seconds=60.0, step_s=0.3, per_step=20, seed=0):
    """Feed a ClockFit the samples of a GPU timer running at ``rate``; returns its error (s) per step."""
    import random

    rng = random.Random(seed)
    host0 = 1000.0
    fit = ClockFit(host0=host0, uncertainty_s=3e-6)
    errors = []
    gpu = 0.0
    while gpu < seconds:
        samples = []
        for _ in range(per_step):
            gpu += step_s / per_step
            truth = host0 + (1 + rate) * gpu
            samples.append((gpu, truth - delays(rng)))  # submitted some time before the event ran
        fit.calibrate(samples)
        errors.append(fit.host_of(gpu) - (host0 + (1 + rate) * gpu))
    return fit, errors


def test_clock_fit_follows_the_rate_from_delayed_samples():
    # 3 us minimum latency, usually tens of microseconds, now and then 5 ms behind other work.
    def delays(rng):
        return 3e-6 + (5e-3 if rng.random() < 0.05 else rng.expovariate(1 / 30e-6))

    fit, errors = _simulate_fit(25e-6, delays)
    assert fit.rate == pytest.approx(25e-6, abs=0.5e-6)
    assert max(abs(e) for e in errors[10:]) < 5e-6  # a fixed offset would be 1.5 ms off by the end
    assert abs(errors[3]) < 30e-6  # before 1 s of baseline: the offset alone, 25 ppm x 1 s at most


def test_clock_fit_when_every_sample_is_late():
    # An idle GPU wakes ~50 us late for each sample: a constant error of that size, not a growing one.
    fit, errors = _simulate_fit(-18e-6, lambda rng: 50e-6 + rng.expovariate(1 / 10e-6))
    assert max(abs(e) for e in errors[10:]) < 55e-6
    assert abs(errors[-1]) < 50e-6


def test_clock_fit_ignores_impossible_rates():
    fit = ClockFit(host0=0.0, uncertainty_s=0.0)
    fit.calibrate([(2.0, 2.0 + 2 * MAX_RATE * 2.0)])  # would need the clocks 2e-3 apart
    assert fit.rate == 0.0
    fit.calibrate([])
    fit.calibrate([(4.0, 4.0 + 4 * 10e-6)])
    assert fit.rate == pytest.approx(10e-6)


# -- host spans -------------------------------------------------------------------------


def test_host_spans_resolve_at_end_step_and_are_logged(zkernel_debug_logs):
    tl = Timeline(CPU, enabled=True)
    t = time.perf_counter()
    tl.host_span(K.COMPUTE, t, t + 0.010)
    tl.host_span("nvme_write", t + 0.009, t + 0.013, "group 3", nbytes=8_000_000)  # kind by its short name
    with capture_logs() as logs:
        summary = tl.end_step(0)
        assert tl.end_step(1).wall_s == 0.0  # an empty step still gets its line
    assert isinstance(summary, StepSummary) and summary.step == 0
    assert summary.busy_s[K.NVME_WRITE] == pytest.approx(0.004)
    assert summary.hidden_s[K.NVME_WRITE] == pytest.approx(0.001)
    assert [e["event"] for e in logs] == ["zkernel.step.timeline"] * 2
    assert logs[0]["log_level"] == "info"
    assert logs[0]["step"] == 0 and logs[0]["nvme_write_exposed_ms"] == pytest.approx(3.0)
    assert logs[0]["nvme_write_gbps"] == pytest.approx(2.0)
    assert [s.step for s in tl.summaries] == [0, 1]
    tl.close()


def test_span_times_its_block_and_takes_bytes_known_inside():
    tl = Timeline(CPU, enabled=True)
    with tl.span(K.COMPUTE):
        time.sleep(0.03)
        with tl.span(K.COLLECTIVE, label="all_reduce") as sp:
            time.sleep(0.01)
            sp.nbytes = 1_000_000
    with pytest.raises(RuntimeError, match="boom"), tl.span(K.CPU_STEP):  # a failing block is still timed
        time.sleep(0.005)
        raise RuntimeError("boom")
    s = tl.end_step(0)
    assert s.busy_s[K.COMPUTE] >= 0.04
    assert 0.01 <= s.busy_s[K.COLLECTIVE] <= s.hidden_s[K.COLLECTIVE] + 1e-9  # nested inside compute
    assert s.nbytes == {K.COLLECTIVE: 1_000_000}
    assert s.busy_s[K.CPU_STEP] >= 0.005 and s.exposed_s[K.CPU_STEP] == pytest.approx(s.busy_s[K.CPU_STEP])
    tl.close()


def test_span_straddling_end_step_counts_in_the_next_step():
    tl = Timeline(CPU, enabled=True)
    with tl.span(K.CPU_STEP):
        with tl.span(K.COMPUTE):
            pass
        assert set(tl.end_step(0).busy_s) == {K.COMPUTE}
    assert set(tl.end_step(1).busy_s) == {K.CPU_STEP}
    tl.close()


def test_spans_from_many_threads_are_all_counted():
    tl = Timeline(CPU, enabled=True)
    per_thread, threads = 3000, 4
    start = threading.Barrier(threads + 1)

    def work(i):
        start.wait()
        for _ in range(per_thread):
            with tl.span(K.D2H if i % 2 else K.NVME_READ, nbytes=1):
                pass
            t = time.perf_counter()
            tl.host_span(K.CPU_STEP, t, t)

    workers = [threading.Thread(target=work, args=(i,), name=f"worker{i}") for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    steps = 0
    while any(w.is_alive() for w in workers):
        tl.end_step(steps)  # racing the workers' appends
        steps += 1
        time.sleep(0.01)  # a busy loop would close more steps than the timeline keeps summaries of
    for w in workers:
        w.join()
    tl.end_step(steps)
    tl.close()
    totals = {kind: sum(s.count.get(kind, 0) for s in tl.summaries) for kind in (K.D2H, K.NVME_READ, K.CPU_STEP)}
    assert totals == {K.D2H: 2 * per_thread, K.NVME_READ: 2 * per_thread, K.CPU_STEP: threads * per_thread}
    assert sum(s.nbytes.get(K.D2H, 0) for s in tl.summaries) == 2 * per_thread


def test_bad_input_is_an_error_that_names_what_is_valid():
    tl = Timeline(CPU, enabled=True)
    with pytest.raises(ValueError, match="unknown timeline span kind 'gpu'.*compute, d2h, h2d"):
        tl.span("gpu")
    with pytest.raises(ValueError, match="ends before it starts"):
        tl.host_span(K.H2D, 2.0, 1.0)
    with pytest.raises(ValueError, match="needs a CUDA timeline"):
        tl.gpu_span(K.H2D, None, None)
    tl.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_device_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        Timeline(torch.device("cuda"), enabled=True)


def test_stream_argument_is_ignored_without_cuda():
    tl = Timeline(CPU, enabled=True)
    with tl.span(K.H2D, stream=object(), nbytes=5):  # no CUDA device: a host span
        pass
    assert tl.end_step(0).nbytes == {K.H2D: 5}
    tl.close()


# -- disabled ---------------------------------------------------------------------------


def test_disabled_timeline_is_a_cheap_no_op(tmp_path, zkernel_debug_logs):
    tl = Timeline(CPU, enabled=False, trace_path=tmp_path / "trace.json")
    assert tl.span(K.H2D) is tl.span(K.COMPUTE, label="x")  # one shared null span, nothing allocated
    n = 100_000

    def run(span):
        start = time.perf_counter()
        for _ in range(n):
            with span(K.H2D, label="layer"):
                pass
        return time.perf_counter() - start

    null = contextlib.nullcontext()

    def bare(_kind, label):  # the cheapest call a context manager can be
        return null

    # Best of 5 of each, interleaved (the machine is shared): within a small factor of nothing.
    elapsed = min(run(tl.span) for _ in range(5))
    baseline = min(run(bare) for _ in range(5))
    assert elapsed < 4 * baseline, f"{n} disabled spans took {elapsed:.3f} s, bare context managers {baseline:.3f} s"
    with tl.span(K.H2D) as sp:
        sp.nbytes = 10  # settable, ignored
    tl.host_span(K.H2D, 2.0, 1.0)  # not even validated
    tl.gpu_span(K.H2D, None, None)
    with capture_logs() as logs:
        assert tl.end_step(0) is None
    tl.close()
    tl.close()
    assert logs == [] and tl.summaries == () and list(tmp_path.iterdir()) == []


def test_enabled_host_span_cost():
    import gc

    tl = Timeline(CPU, enabled=True)
    n = 4_000
    gc.collect()  # the suite's earlier tests leave a large heap: a full collection inside the loop is theirs
    batches = []
    for _ in range(5):  # the best batch: the span's own cost, not a busy machine's
        start = time.perf_counter()
        for _ in range(n):
            with tl.span(K.H2D):
                pass
        batches.append((time.perf_counter() - start) / n)
    per_span = min(batches)
    tl.end_step(0)
    tl.close()
    assert per_span < 20e-6, f"an enabled host span costs {per_span * 1e6:.1f} us"


# -- the Chrome trace -------------------------------------------------------------------


def _load_trace(path):
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    return trace, events, complete, lanes


def test_chrome_trace_structure(tmp_path, zkernel_debug_logs):
    path = tmp_path / "trace-{rank}.json"
    tl = Timeline(CPU, enabled=True, trace_path=path, rank=3)
    t = time.perf_counter()
    tl.host_span(K.COMPUTE, t, t + 0.010, "forward")
    tl.host_span(K.H2D, t + 0.001, t + 0.004, "g0", nbytes=1 << 20)
    tl.host_span(K.H2D, t + 0.002, t + 0.005, "g1", nbytes=1 << 20)  # overlaps g0: a second h2d lane
    tl.host_span(K.H2D, t + 0.006, t + 0.007, "g2")  # fits the first h2d lane again
    tl.end_step(0)
    tl.host_span(K.CPU_STEP, t + 0.011, t + 0.020, thread="cpu-adam")
    tl.end_step(1)
    tl.host_span(K.D2H, t + 0.021, t + 0.022)  # after the last end_step: trace only
    final = tmp_path / "trace-3.json"
    assert tl.trace_path == final
    assert not final.exists()  # published only at close
    with capture_logs() as logs:
        tl.close()
    tl.close()
    assert logs == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace-3.json"]  # no temporary file left
    trace, events, complete, lanes = _load_trace(final)
    assert trace["displayTimeUnit"] == "ms"
    for e in events:
        assert {"ph", "pid", "tid", "name"} <= e.keys() and e["pid"] == 3
    for e in complete:
        assert {"ts", "dur", "cat", "args"} <= e.keys() and e["dur"] >= 0
    assert {"name": "process_name", "args": {"name": "zkernel rank 3"}}.items() <= next(
        e for e in events if e["name"] == "process_name"
    ).items()
    names = sorted(e["name"] for e in complete)
    assert names == sorted(
        ["compute forward", "h2d g0", "h2d g1", "h2d g2", "cpu_step", "d2h", "step 0", "step 1"]
    )
    by_name = {e["name"]: e for e in complete}
    assert by_name["h2d g0"]["args"] == {"thread": "MainThread", "step": 0, "bytes": 1 << 20}
    assert by_name["cpu_step"]["args"]["thread"] == "cpu-adam"
    assert by_name["h2d g1"]["tid"] != by_name["h2d g0"]["tid"] == by_name["h2d g2"]["tid"]
    assert lanes[by_name["h2d g0"]["tid"]] == "h2d" and lanes[by_name["h2d g1"]["tid"]] == "h2d #2"
    assert by_name["h2d g1"]["ts"] - by_name["h2d g0"]["ts"] == pytest.approx(1000, abs=1)  # microseconds
    assert by_name["h2d g0"]["dur"] == pytest.approx(3000, abs=1)
    assert by_name["step 0"]["dur"] == pytest.approx(10_000, abs=1)
    assert by_name["step 0"]["args"]["h2d_exposed_ms"] == pytest.approx(0.0, abs=1e-3)
    # Within a lane nothing overlaps, so a viewer can draw it.
    for tid in lanes:
        slices = sorted((e["ts"], e["ts"] + e["dur"]) for e in complete if e["tid"] == tid)
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(slices, slices[1:], strict=False))


def test_trace_in_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot write the timeline trace .*missing"):
        Timeline(CPU, enabled=True, trace_path=tmp_path / "missing" / "trace.json")


def test_a_full_disk_drops_the_trace_with_a_warning_and_training_goes_on(tmp_path):
    # A real write failure: the file-size limit (EFBIG, like ENOSPC for the writer) in a child process.
    script = textwrap.dedent(
        """
        import json, resource, signal, sys, time
        from structlog.testing import capture_logs
        from zkernel.telemetry.timeline import SpanKind, Timeline

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        tl = Timeline("cpu", enabled=True, trace_path=sys.argv[1])
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        with capture_logs() as logs:
            for step in range(30):
                t = time.perf_counter()
                for i in range(100):
                    tl.host_span(SpanKind.H2D, t + i, t + i + 0.5, f"group {i}", nbytes=1 << 20)
                assert tl.end_step(step).step == step
            tl.close()
        print(json.dumps([e for e in logs if e["log_level"] == "warning"]))
        """
    )
    path = tmp_path / "trace.json"
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    warnings = json.loads(done.stdout.strip().splitlines()[-1])
    assert [w["event"] for w in warnings] == ["zkernel.timeline.trace_dropped"]
    assert warnings[0]["path"] == str(path) and "File too large" in warnings[0]["error"]
    assert list(tmp_path.iterdir()) == []  # neither a partial trace nor the temporary file


def test_unclosed_timeline_publishes_its_trace_when_collected(tmp_path):
    path = tmp_path / "trace.json"
    tl = Timeline(CPU, enabled=True, trace_path=path)
    t = time.perf_counter()
    tl.host_span(K.COMPUTE, t, t + 0.001)
    tl.end_step(0)
    del tl
    _, _, complete, _ = _load_trace(path)
    assert sorted(e["name"] for e in complete) == ["compute", "step 0"]


# -- CUDA: events on streams ------------------------------------------------------------


def _cuda_timeline(**kwargs):
    torch.backends.cuda.matmul.allow_tf32 = False
    return Timeline(torch.device("cuda"), enabled=True, **kwargs)


@pytest.mark.cuda
def test_copy_on_a_side_stream_hides_behind_a_matmul(tmp_path):
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    src = torch.randn(32 << 20, device=dev)  # 128 MiB
    dst = torch.empty(src.shape, pin_memory=True)
    a @ a  # warm up cuBLAS
    torch.cuda.synchronize()
    tl = _cuda_timeline(trace_path=tmp_path / "trace.json")
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
    # Overlapped: the copy runs on its own stream while the compute stream multiplies.
    with tl.span(K.COMPUTE, stream=compute, label="matmuls"):
        for _ in range(10):
            a @ a
    with torch.cuda.stream(side), tl.span(K.D2H, stream=side, nbytes=src.nbytes):
        dst.copy_(src, non_blocking=True)
    overlapped = tl.end_step(0)
    # Serial: the same copy queued behind the matmuls on the compute stream.
    with tl.span(K.COMPUTE, stream=compute):
        for _ in range(10):
            a @ a
    with tl.span(K.D2H, stream=compute, nbytes=src.nbytes):
        dst.copy_(src, non_blocking=True)
    tl.end_step(1)
    tl.close()
    s0, s1 = tl.summaries
    assert overlapped is None or overlapped.step == 0
    assert s0.busy_s[K.D2H] > 0 and s0.hidden_s[K.D2H] >= 0.95 * s0.busy_s[K.D2H]
    assert s0.gbps[K.D2H] > 5  # pinned device-to-host
    assert s1.hidden_s[K.D2H] <= 0.05 * s1.busy_s[K.D2H]
    assert s1.wall_s == pytest.approx(s1.busy_s[K.COMPUTE] + s1.busy_s[K.D2H], rel=0.02)
    _, _, complete, lanes = _load_trace(tmp_path / "trace.json")
    streams = {e["args"].get("stream") for e in complete if e["cat"] == "d2h"}
    assert len(streams) == 2 and None not in streams


@pytest.mark.cuda
def test_end_step_does_not_wait_for_the_device():
    tl = _cuda_timeline()
    stream = torch.cuda.current_stream()
    with tl.span(K.COMPUTE, stream=stream):
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time
    start = time.perf_counter()
    assert tl.end_step(0) is None  # still running: nothing resolved, nothing waited for
    assert time.perf_counter() - start < 0.01
    torch.cuda.synchronize()
    with tl.span(K.COMPUTE, stream=stream):
        pass
    tl.end_step(1)
    torch.cuda.synchronize()
    assert tl.end_step(2).step in (1, 2)  # resolved without close once the device caught up
    tl.close()
    assert [s.step for s in tl.summaries] == [0, 1, 2]
    assert tl.summaries[0].busy_s[K.COMPUTE] > 0.02


@pytest.mark.cuda
def test_clock_alignment_holds():
    """A synchronised GPU span lies inside the host span around it, to within a few microseconds, for seconds.

    Without following the clocks' rate (9-26 ppm apart on H100s) the error after 6 s would be 54-156 us.
    """
    tl = _cuda_timeline()
    assert 0 < tl.clock_uncertainty_s < 100e-6
    stream = torch.cuda.current_stream()
    bounds = []
    for step in range(24):
        time.sleep(0.25)
        t0 = time.perf_counter()
        with tl.span(K.COMPUTE, stream=stream):
            torch.cuda._sleep(int(2e7))  # ~10 ms
        stream.synchronize()
        t1 = time.perf_counter()
        tl.host_span(K.CPU_STEP, t0, t1)
        bounds.append(t1 - t0)
        tl.end_step(step)
    tl.close()
    assert len(tl.summaries) == 24
    for s, host_len in zip(tl.summaries, bounds, strict=True):
        # The GPU span starts a few microseconds after t0 and ends before t1.
        assert s.hidden_s[K.CPU_STEP] == pytest.approx(s.busy_s[K.COMPUTE], abs=30e-6), s.step
        assert s.wall_s == pytest.approx(host_len, abs=30e-6), s.step


@pytest.mark.cuda
def test_gpu_span_events_and_steps_resolved_out_of_order_on_the_device(tmp_path):
    """A later step's span that ran on the GPU before an earlier step's is placed right (negative offsets)."""
    tl = _cuda_timeline(trace_path=tmp_path / "trace.json")
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
    torch.cuda._sleep(int(2e8))  # the compute stream is busy for ~0.1 s
    with tl.span(K.COMPUTE, stream=compute, label="late"):
        torch.cuda._sleep(int(1e6))
    tl.end_step(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(side)
    torch.cuda._sleep(0)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e6))
    end.record(side)
    tl.gpu_span(K.H2D, start, end, "early")
    never = torch.cuda.Event(enable_timing=True)
    with capture_logs() as logs:
        tl.gpu_span(K.ALL_GATHER, never, never, "unrecorded")  # dropped with one warning
        torch.cuda.synchronize()
        tl.end_step(1)
        tl.close()
    assert [e["event"] for e in logs].count("zkernel.timeline.unreadable_event") == 1
    assert set(tl.summaries[1].busy_s) == {K.H2D}
    _, _, complete, _ = _load_trace(tmp_path / "trace.json")
    by_name = {e["name"]: e for e in complete}
    assert by_name["h2d early"]["ts"] + by_name["h2d early"]["dur"] < by_name["compute late"]["ts"]
    assert by_name["compute late"]["ts"] - by_name["h2d early"]["ts"] > 50_000  # µs: ~0.1 s apart


@pytest.mark.cuda
def test_events_are_reused_across_steps():
    tl = _cuda_timeline()
    stream = torch.cuda.current_stream()
    x = torch.ones(1 << 20, device="cuda")
    for step in range(20):
        for _ in range(5):
            with tl.span(K.COMPUTE, stream=stream):
                x.mul_(1.0)
        torch.cuda.synchronize()
        tl.end_step(step)
    assert len(tl._free_events) <= 25  # a step or two's worth (5 pairs and a probe each), not 220
    # The last step resolves once its probe event is done: at a later end_step or at close (the
    # end_step just before may find it not done yet).
    tl.close()
    assert len(tl.summaries) == 20 and all(s.count[K.COMPUTE] == 5 for s in tl.summaries)
    assert tl._free_events == []

