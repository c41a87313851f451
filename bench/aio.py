"""Async file I/O benchmark: zkernel's AioHandle against fio (O_DIRECT) on the same file.

For each size in --sizes (GiB) one file is preallocated under --path, then each
round runs on that same file the writes of zkernel, fio iodepth 8 and fio
iodepth 32, then their reads, rotating which tool goes first every round (a
read right after a burst of writes is slower on a host-cached virtual disk). fio uses 1 MiB blocks,
--direct=1, libaio (io_uring or psync where libaio is missing), one job.
zkernel writes/reads one buffer from `zkernel.aio.aligned_empty` (page-locked
when CUDA is available) with one request, timed from submit to wait.
Medians over rounds are printed, with the paired per-round ratio of zkernel to
fio's best iodepth in that round. No fsync on either side.

    python3 bench/aio.py --path /tmp --sizes 1,4
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

import torch

from zkernel import aio

GIB = 1 << 30


def _fio_engine() -> str | None:
    if shutil.which("fio") is None:
        return None
    out = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout
    for engine in ("libaio", "io_uring", "psync"):
        if engine in out.split():
            return engine
    return "psync"


def _fio(path: str, nbytes: int, rw: str, iodepth: int, engine: str) -> float:
    """GB/s of one fio sequential run over the whole file."""
    cmd = [
        "fio", "--name=zkbench", f"--filename={path}", f"--rw={rw}", "--bs=1M", f"--size={nbytes}",
        "--direct=1", f"--ioengine={engine}", f"--iodepth={iodepth}", "--numjobs=1",
        "--output-format=json",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def _zk(handle: aio.AioHandle, buf: torch.Tensor, path: str, write: bool) -> float:
    t0 = time.perf_counter()
    request = handle.submit_write(buf, path, 0) if write else handle.submit_read(buf, path, 0)
    handle.wait(request)
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def bench_size(gib: float, args, engine: str | None) -> None:
    nbytes = int(gib * GIB) // (1 << 20) * (1 << 20)
    path = os.path.join(args.path, f"zkernel_aio_bench_{gib:g}g.bin")
    aio.preallocate(path, nbytes)
    buf = aio.aligned_empty(nbytes)
    buf.fill_(7)
    handle = aio.AioHandle(block_size=args.block_size, threads=args.threads, queue_depth=args.queue_depth)
    depths = (8, 32)
    rows: dict[str, list[float]] = {"zk_write": [], "zk_read": []}
    for d in depths:
        rows[f"fio_write_qd{d}"] = []
        rows[f"fio_read_qd{d}"] = []
    try:
        _zk(handle, buf, path, write=True)  # warm-up: the file's blocks written once
        tools = ["zk"] + ([f"fio{d}" for d in depths] if engine else [])
        for r in range(args.rounds):
            order = tools[r % len(tools):] + tools[: r % len(tools)]  # rotate who goes first
            for kind in ("write", "read"):
                for tool in order:
                    if tool == "zk":
                        rows[f"zk_{kind}"].append(_zk(handle, buf, path, write=kind == "write"))
                    else:
                        d = int(tool[3:])
                        rows[f"fio_{kind}_qd{d}"].append(_fio(path, nbytes, kind, d, engine))
    finally:
        handle.close()
        if not args.keep:
            os.unlink(path)

    print(f"\n## {nbytes / GIB:g} GiB, {args.rounds} alternating rounds on one preallocated file (median GB/s)")
    print(f"{'tool':<28}{'write GB/s':>12}{'read GB/s':>12}")
    print(f"{'zkernel AioHandle':<28}{statistics.median(rows['zk_write']):>12.2f}{statistics.median(rows['zk_read']):>12.2f}")
    if not engine:
        print("fio not found: no fio comparison (apt-get install -y fio)")
        return
    for d in depths:
        w, r = statistics.median(rows[f"fio_write_qd{d}"]), statistics.median(rows[f"fio_read_qd{d}"])
        print(f"{f'fio {engine} iodepth {d}':<28}{w:>12.2f}{r:>12.2f}")
    for kind in ("write", "read"):
        best = [max(rows[f"fio_{kind}_qd{d}"][i] for d in depths) for i in range(args.rounds)]
        ratio = statistics.median(z / f for z, f in zip(rows[f"zk_{kind}"], best))
        print(f"zkernel / fio best {kind}: {ratio:.2f} (paired per round; target >= 0.90)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="/tmp", help="directory on the file system to measure")
    parser.add_argument("--sizes", default="1,4", help="comma-separated sizes in GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=aio.DEFAULT_THREADS)
    parser.add_argument("--block-size", type=int, default=aio.DEFAULT_BLOCK_SIZE)
    parser.add_argument("--queue-depth", type=int, default=aio.DEFAULT_QUEUE_DEPTH)
    parser.add_argument("--keep", action="store_true", help="keep the test files")
    args = parser.parse_args()
    engine = _fio_engine()
    print("# Async file I/O benchmark")
    print(f"path {args.path} ({os.statvfs(args.path).f_bavail * os.statvfs(args.path).f_frsize / GIB:.0f} GiB free), "
          f"{os.cpu_count()} CPUs, zkernel threads {args.threads}, block {args.block_size >> 10} KiB, "
          f"pinned buffers {torch.cuda.is_available()}, python {sys.version.split()[0]}")
    print(f"fio: {engine + ' engine' if engine else 'fio not found'}")
    for size in args.sizes.split(","):
        bench_size(float(size), args, engine)


if __name__ == "__main__":
    main()
