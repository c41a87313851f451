"""Training with the optimizer on NVMe, beside the disk's own O_DIRECT bandwidth, in one run on one file system.

    python bench/nvme_step.py --nvme-path /local/nvme --steps 3          # GPT-1.3B on one CUDA GPU
    python bench/nvme_step.py --nvme-path /tmp/zk --steps 1 --model tiny --seq 32 --micro-batch 1 --disk-gib 0.05

1. The disk: fio's sequential O_DIRECT write, then read (1 MiB blocks,
   iodepth 32, libaio, else io_uring or psync) of a ``--disk-gib`` file under
   ``--nvme-path``, then both at once (fio ``--rw=rw``: half the requests
   read, half write), since the optimizer phase reads one group's state
   while it writes another's. Without fio: the same three passes with
   zkernel's own async I/O engine (`zkernel.platform.aio.AioHandle`: O_DIRECT, 1 MiB
   requests, 32 in flight, what the nvme tier uses; the mixed pass reads the
   file's first half while it writes its second), and the table says so.
2. The step: the anchors' GPT (``--model``, bench/gpt_model.py, built on the
   meta device) under zkernel zero3 with ``offload.optimizer = "nvme"``
   (``cpu_adam``; masters and Adam moments in swap files under
   ``--nvme-path``; ``--params`` places the parameter shards too), gradient
   clipping 1.0, bf16 on CUDA (fp32 on the CPU). ``--warmup`` steps, then
   ``--steps`` timed ones in the normal training flow (the next forward waits
   per group for its update). Tokens/s over the timed steps as one block, from
   a settled start (nothing pending) until the last step's updates and
   write-backs are done: an optimizer phase runs on into the next step, so
   timing each iteration alone would leave the last one's out. Per timed step:
   the bytes the tiers read and wrote (mean), and the timeline's NVMe read and
   write bandwidth (bytes over the time some read, or some write, was in
   flight; median).
   Then one *isolated* step: everything pending finished, ``engine.step()``,
   and every update and write-back waited for: (bytes read + written) over
   that time is the disk throughput of the optimizer phase alone.

It prints one table: tokens/s, the step's read and write GB/s beside the
disk's, and the ratios (target for issue 7: >= 0.90 of the disk's O_DIRECT
bandwidth during the step). The optimizer phase, which reads and writes at
once, is set beside the disk's mixed pass (read + written over its time) and
beside the harmonic mean of its one-way passes (what reading everything, then
writing everything, would take).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
MIB = 1 << 20


# -- the disk's ceiling ---------------------------------------------------------------------------


def _fio_engine() -> str | None:
    if shutil.which("fio") is None:
        return None
    out = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout.split()
    return next((e for e in ("libaio", "io_uring") if e in out), "psync")


def _fio(path: str, nbytes: int, rw: str, engine: str) -> float:
    """GB/s of one fio pass over the whole file (``rw``: write, read, or rw, which counts both directions)."""
    cmd = [
        "fio", "--name=zknvme", f"--filename={path}", f"--rw={rw}", "--bs=1M", f"--size={nbytes}", "--direct=1",
        f"--ioengine={engine}", "--iodepth=32", "--numjobs=1", "--output-format=json",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
    directions = {"write": ("write",), "read": ("read",), "rw": ("read", "write")}[rw]
    return sum(job[d]["bw_bytes"] for d in directions) / 1e9


AIO_DEPTH = 32  # requests in flight, as the nvme tier keeps them


def _aio_buffers() -> list:
    """One aligned 1 MiB buffer per request in flight, filled so that writes carry data."""
    from zkernel.platform import aio

    buffers = [aio.aligned_empty(MIB) for _ in range(AIO_DEPTH)]
    for b in buffers:
        b.fill_(7)
    return buffers


def _aio(path: str, nbytes: int, write: bool) -> float:
    """GB/s of one sequential O_DIRECT pass with zkernel's engine: 1 MiB requests, 32 in flight."""
    from zkernel.platform import aio

    depth, buffers = AIO_DEPTH, _aio_buffers()
    with aio.AioHandle(queue_depth=depth) as handle:
        start = time.perf_counter()
        for i, offset in enumerate(range(0, nbytes, MIB)):
            if handle.pending >= depth:
                handle.wait_any()
            buf = buffers[i % depth]
            (handle.submit_write if write else handle.submit_read)(buf, path, offset)
        handle.wait_all()
        return nbytes / (time.perf_counter() - start) / 1e9


def _aio_mixed(path: str, nbytes: int) -> float:
    """GB/s (read + written) of reading the file's first half while writing its second half,
    alternating 1 MiB requests, 32 in flight."""
    from zkernel.platform import aio

    depth, buffers = AIO_DEPTH, _aio_buffers()
    half = nbytes // 2 // MIB * MIB
    with aio.AioHandle(queue_depth=depth) as handle:
        start = time.perf_counter()
        for i, offset in enumerate(range(0, half, MIB)):
            for j, submit in enumerate((handle.submit_read, handle.submit_write)):
                if handle.pending >= depth:
                    handle.wait_any()
                submit(buffers[(2 * i + j) % depth], path, offset + j * half)
        handle.wait_all()
        return 2 * half / (time.perf_counter() - start) / 1e9


def disk_ceiling(directory: Path, gib: float) -> tuple[str, float, float, float]:
    """(how it was measured, sequential write GB/s, sequential read GB/s, read + write at once GB/s)
    on ``directory``'s file system."""
    from zkernel.platform import aio

    nbytes = max(MIB, int(gib * GIB) // MIB * MIB)
    path = str(directory / "zkernel_nvme_step_disk.bin")
    aio.preallocate(path, nbytes)
    engine = _fio_engine()
    try:
        if engine is not None:
            label = f"fio --direct=1 --ioengine={engine} --bs=1M --iodepth=32"
            write, read = _fio(path, nbytes, "write", engine), _fio(path, nbytes, "read", engine)
            mixed = _fio(path, nbytes, "rw", engine)
        else:
            label = "zkernel AioHandle O_DIRECT, 1 MiB x 32 in flight (fio is not installed)"
            write = _aio(path, nbytes, True)
            read = _aio(path, nbytes, False)
            mixed = _aio_mixed(path, nbytes)
    finally:
        os.unlink(path)
    return label, write, read, mixed


# -- training with the optimizer on NVMe ----------------------------------------------------------


def _tiers(engine) -> list:
    return list({id(t): t for t in (engine.optimizer_tier, engine.params_tier)}.values())


def _moved(engine) -> tuple[int, int]:
    tiers = _tiers(engine)
    return sum(getattr(t, "bytes_read", 0) for t in tiers), sum(getattr(t, "bytes_written", 0) for t in tiers)


def _settle(engine, cuda: bool) -> None:
    """Every pending update applied and every swap-file write done."""
    engine.pipeline.wait_all()
    for tier in _tiers(engine):
        if hasattr(tier, "wait_writes"):
            tier.wait_writes()
    if cuda:
        torch.cuda.synchronize()


def train(args) -> dict:
    import zkernel
    from zkernel.telemetry.timeline import SpanKind

    sys.path.insert(0, str(HERE))
    from gpt_model import GPT, PRESETS, VOCAB

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(**PRESETS[args.model], seq=args.seq)
    numel = sum(p.numel() for p in model.parameters())
    config = {
        "partitioner": "zero3",
        "precision": "bf16" if cuda else "fp32",
        "gradient_clipping": 1.0,
        "timeline": True,
        "optimizer": {"name": "cpu_adam", "lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "partitioner_options": {"units": args.units},
        "offload": {"optimizer": "nvme", "params": args.params, "nvme_path": str(args.nvme_path),
                    "optimizer_options": json.loads(args.tier_options or "{}")},
    }
    if args.params != "none":
        config["offload"]["params_options"] = json.loads(args.params_tier_options or "{}")
    started = time.perf_counter()
    engine = zkernel.initialize(model, config)
    init_s = time.perf_counter() - started
    g = torch.Generator().manual_seed(1)
    tokens = args.micro_batch * args.seq

    def one_step() -> None:
        idx = torch.randint(0, VOCAB, (args.micro_batch, args.seq), generator=g).to(device)
        engine.backward(engine(idx, torch.roll(idx, -1, 1)))
        engine.step()

    for _ in range(args.warmup):
        one_step()
    _settle(engine, cuda)
    before, t0 = _moved(engine), time.perf_counter()
    for _ in range(args.steps):
        one_step()
    _settle(engine, cuda)  # the last step's updates and write-backs count too
    step_s = (time.perf_counter() - t0) / args.steps
    after = _moved(engine)
    read_gb, written_gb = ((b - a) / args.steps / 1e9 for a, b in zip(before, after))
    # The optimizer phase alone: nothing pending before, everything written after.
    idx = torch.randint(0, VOCAB, (args.micro_batch, args.seq), generator=g).to(device)
    engine.backward(engine(idx, torch.roll(idx, -1, 1)))
    _settle(engine, cuda)
    before, t0 = _moved(engine), time.perf_counter()
    engine.step()
    _settle(engine, cuda)
    isolated_s = time.perf_counter() - t0
    after = _moved(engine)
    peak_gib = torch.cuda.max_memory_allocated(device) / GIB if cuda else 0.0
    report = engine.memory_report()
    on_nvme = sum(v.get("nvme", 0) for v in report.values())
    summaries = engine.timeline.summaries[args.warmup : args.warmup + args.steps]
    engine.close()
    per_kind = {}
    for kind in (SpanKind.NVME_READ, SpanKind.NVME_WRITE):
        figures = [s.gbps[kind] for s in summaries if kind in s.gbps]
        per_kind[kind.value] = statistics.median(figures) if figures else 0.0
    return {
        "device": f"CUDA bf16 ({torch.cuda.get_device_name(device)})" if cuda else "CPU fp32",
        "numel": numel,
        "init_s": init_s,
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "read_gb": read_gb,
        "written_gb": written_gb,
        "read_gbps": per_kind["nvme_read"],
        "write_gbps": per_kind["nvme_write"],
        "isolated_s": isolated_s,
        "isolated_gbps": (after[0] - before[0] + after[1] - before[1]) / isolated_s / 1e9,
        "peak_gib": peak_gib,
        "nvme_gib": on_nvme / GIB,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", type=Path, required=True, help="a directory on the disk to measure (offload.nvme_path)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", default="1.3b", help="bench/gpt_model.py preset: tiny, 350m, 1.3b, 6.7b")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--disk-gib", type=float, default=4.0, help="size of the file the disk's ceiling is measured on")
    parser.add_argument("--units", default="blocks", choices=("modules", "blocks"), help="zero3 units (= optimizer groups)")
    parser.add_argument("--params", default="none", choices=("none", "cpu", "nvme"), help="offload.params")
    parser.add_argument("--tier-options", default="", help="offload.optimizer_options as JSON, e.g. '{\"buffer_bytes\": 8589934592}'")
    parser.add_argument("--params-tier-options", default="", help="offload.params_options as JSON")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where CUDA is available")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    label, disk_write, disk_read, disk_mixed = disk_ceiling(args.nvme_path, args.disk_gib)
    r = train(args)
    rows = [
        ("model", f"GPT-{args.model}, {r['numel'] / 1e9:.3f}B parameters, zero3 ({args.units}), {r['device']}"),
        ("setup", f"offload.optimizer=nvme (cpu_adam), offload.params={args.params}, clip 1.0, "
                  f"micro-batch {args.micro_batch} x {args.seq} tokens, {args.steps} timed steps after {args.warmup}"),
        ("file system", f"{args.nvme_path} ({r['nvme_gib']:.2f} GiB of swap files, laid out in {r['init_s']:.1f} s)"),
        ("disk ceiling", f"{label} over {args.disk_gib:g} GiB"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f} ({r['step_s']:.3f} s per step, the timed steps until settled; "
                     f"peak GPU {r['peak_gib']:.1f} GiB)"),
        ("per step", f"{r['read_gb']:.2f} GB read + {r['written_gb']:.2f} GB written"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print()
    print(f"{'':<24}{'during the step':>18}{'disk O_DIRECT':>16}{'ratio':>8}")
    print(f"{'NVMe read GB/s':<24}{r['read_gbps']:>18.2f}{disk_read:>16.2f}{r['read_gbps'] / disk_read:>8.3f}")
    print(f"{'NVMe write GB/s':<24}{r['write_gbps']:>18.2f}{disk_write:>16.2f}{r['write_gbps'] / disk_write:>8.3f}")
    serial = 2 / (1 / disk_read + 1 / disk_write)
    phase = r["isolated_gbps"]
    print(f"{'optimizer phase GB/s':<24}{phase:>18.2f}{disk_mixed:>16.2f}{phase / disk_mixed:>8.3f}  (disk: read + write at once)")
    print(f"{'':<24}{'':>18}{serial:>16.2f}{phase / serial:>8.3f}  (disk: one-way passes, harmonic mean)")
    print()
    print("read/write GB/s during the step: the timeline's optimizer-state bytes over the time some read (write) of "
          "them was in flight, median of the timed steps (parameter reads of --params nvme count in the bytes per step "
          "only); optimizer phase: (read + written) / time of one isolated engine.step() until every write-back is "
          f"done ({r['isolated_s']:.2f} s), against the disk reading and writing at once and against its harmonic "
          "mean of read and write")


if __name__ == "__main__":
    main()
