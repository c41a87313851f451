"""Async file I/O benchmark: zkernel's AioHandle against fio and DeepSpeed's aio (O_DIRECT) on the same file.

For each size in --sizes (GiB) one file is preallocated under --path, then each
round runs on that same file the writes of zkernel, DeepSpeed's aio_handle (when
available), fio iodepth 8 and fio iodepth 32, then their reads, rotating which
tool goes first every round (a read right after a burst of writes is slower on a
host-cached virtual disk); by default there is one round per tool, so each leads
once. fio uses 1 MiB blocks, --direct=1, libaio (io_uring or psync where libaio
is missing), one job. zkernel writes/reads one buffer from
`zkernel.platform.aio.aligned_empty` (page-locked when CUDA is available) with one
request, timed from submit to wait. DeepSpeed writes/reads one buffer from its
own `new_cpu_locked_tensor` (mlock'ed, its no-bounce-buffer path) with one
`async_pwrite`/`async_pread` + `wait()`, timed the same way; its settings are
printed (default block 1 MiB, queue depth 8 per thread, intra_op_parallelism 4,
overlap_events on, single_submit off). zkernel also runs on that same
DeepSpeed buffer: on this kind of VM two equally allocated buffers can differ
by 10-20% in O_DIRECT throughput, so zkernel vs DeepSpeed is only a fair
comparison on one buffer. DeepSpeed is optional: when it does not import or its
aio op does not build/load, one line says why and the rest runs.
Medians over rounds are printed, with paired per-round ratios (zkernel to fio's
best iodepth in that round, zkernel to DeepSpeed on the same buffer, DeepSpeed
to fio's best). No fsync on any side. --checksum adds a zkernel column with
CRC32C on (``checksum=True`` on writes and reads: the I/O threads checksum
each chunk as they move it) and the paired ratio to zkernel without checksums
in the same round. Reads are not given ``expect_crc``: fio rewrites the file
between rounds, and the comparison that ``expect_crc`` adds is one integer
compare at completion; the last read is then checked against a fresh
checksummed write of the same buffer.

    python3 bench/aio.py --path /tmp --sizes 1,4
    /tmp/dsenv/bin/python bench/aio.py --path /tmp --sizes 1,4   # with DeepSpeed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from zkernel.platform import aio, native

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


def _load_deepspeed_aio():
    """(the aio op module, version) or (None, why it is absent); never raises."""
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001 - any import failure just means "no DeepSpeed column"
        return None, f"deepspeed not importable ({type(exc).__name__}: {exc})"
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, (f"deepspeed {deepspeed.__version__}: aio op not compatible here "
                          "(libaio headers missing? apt-get install -y libaio-dev)")
        print(f"loading DeepSpeed {deepspeed.__version__} aio op (the first use JIT-builds it, minutes)", flush=True)
        # Its build log goes to stdout/stderr: keep it out of the table unless the load fails.
        with tempfile.TemporaryFile(mode="w+") as log:
            saved = [os.dup(1), os.dup(2)]
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
            try:
                module = builder.load(verbose=False)
            except BaseException:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                log.seek(0)
                tail = log.read()[-2000:]
                if tail:
                    print(tail, file=sys.stderr)
                raise
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                os.close(saved[0]), os.close(saved[1])
        return module, deepspeed.__version__
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        return None, f"DeepSpeed aio op did not build/load ({type(exc).__name__}: {str(exc)[:300]})"


def _ds(handle, buf: torch.Tensor, path: str, write: bool) -> float:
    t0 = time.perf_counter()
    rc = handle.async_pwrite(buf, path, 0) if write else handle.async_pread(buf, path, 0)
    done = handle.wait()
    elapsed = time.perf_counter() - t0
    if rc != 0 or done < 1:
        raise RuntimeError(f"DeepSpeed aio {'write' if write else 'read'} failed (submit rc {rc}, wait {done})")
    return buf.numel() / elapsed / 1e9


def _zk(handle: aio.AioHandle, buf: torch.Tensor, path: str, write: bool, checksum: bool = False) -> float:
    t0 = time.perf_counter()
    if write:
        request = handle.submit_write(buf, path, 0, checksum=checksum)
    else:
        request = handle.submit_read(buf, path, 0, checksum=checksum)
    handle.wait(request)
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def _ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


def bench_size(gib: float, args, engine: str | None, ds_aio) -> None:
    nbytes = int(gib * GIB) // (1 << 20) * (1 << 20)
    path = os.path.join(args.path, f"zkernel_aio_bench_{gib:g}g.bin")
    aio.preallocate(path, nbytes)
    buf = aio.aligned_empty(nbytes)
    buf.fill_(7)
    handle = aio.AioHandle(block_size=args.block_size, threads=args.threads, queue_depth=args.queue_depth)
    ds_handle = ds_buf = None
    depths = (8, 32)
    tools = (["zk"] + (["zkc"] if args.checksum else []) + (["ds", "zkds"] if ds_aio is not None else [])
             + ([f"fio{d}" for d in depths] if engine else []))
    rounds = args.rounds or len(tools)
    rows: dict[str, list[float]] = {f"{t}_{kind}": [] for t in tools for kind in ("write", "read")}
    try:
        if ds_aio is not None:
            ds_handle = ds_aio.aio_handle(args.ds_block_size, args.ds_queue_depth, False, True, args.ds_threads)
            ds_buf = ds_handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
            ds_buf.fill_(7)
        _zk(handle, buf, path, write=True)  # warm-up: the file's blocks written once
        if ds_handle is not None:
            _ds(ds_handle, ds_buf, path, write=True)  # and DeepSpeed's first submission untimed too
        for r in range(rounds):
            order = tools[r % len(tools):] + tools[: r % len(tools)]  # rotate who goes first
            for kind in ("write", "read"):
                write = kind == "write"
                for tool in order:
                    if tool == "zk":
                        gbs = _zk(handle, buf, path, write)
                    elif tool == "zkc":
                        gbs = _zk(handle, buf, path, write, checksum=True)
                    elif tool == "ds":
                        gbs = _ds(ds_handle, ds_buf, path, write)
                    elif tool == "zkds":
                        gbs = _zk(handle, ds_buf, path, write)
                    else:
                        gbs = _fio(path, nbytes, kind, int(tool[3:]), engine)
                    rows[f"{tool}_{kind}"].append(gbs)
        if args.checksum:  # the checksummed path end to end: write, verified read, same CRC as in memory
            crc = handle.write(buf, path, 0, checksum=True)
            if handle.read(buf, path, 0, expect_crc=crc) != crc or native.crc32c(buf) != crc:
                raise RuntimeError("CRC32C of the read differs from the written one")
    finally:
        handle.close()
        if ds_buf is not None:
            ds_handle.free_cpu_locked_tensor(ds_buf)
        if not args.keep:
            os.unlink(path)

    def line(name: str, tool: str) -> None:
        w, r = statistics.median(rows[f"{tool}_write"]), statistics.median(rows[f"{tool}_read"])
        print(f"{name:<44}{w:>12.2f}{r:>12.2f}")

    print(f"\n## {nbytes / GIB:g} GiB, {rounds} alternating rounds on one preallocated file (median GB/s)")
    print(f"{'tool':<44}{'write GB/s':>12}{'read GB/s':>12}")
    line("zkernel AioHandle", "zk")
    if args.checksum:
        line("zkernel AioHandle, CRC32C on", "zkc")
    if ds_aio is not None:
        line(f"DeepSpeed aio (qd {args.ds_queue_depth}, {args.ds_threads} threads)", "ds")
        line("zkernel AioHandle, DeepSpeed's buffer", "zkds")
    for d in depths if engine else ():
        line(f"fio {engine} iodepth {d}", f"fio{d}")
    if not engine:
        print("fio not found: no fio comparison (apt-get install -y fio)")
    for kind in ("write", "read"):
        parts = []
        if args.checksum:
            parts.append(f"zkernel with / without CRC32C {_ratio(rows[f'zkc_{kind}'], rows[f'zk_{kind}']):.2f}")
        if engine:
            best = [max(rows[f"fio{d}_{kind}"][i] for d in depths) for i in range(rounds)]
            parts.append(f"zkernel / fio best {_ratio(rows[f'zk_{kind}'], best):.2f} (target >= 0.90)")
        if ds_aio is not None:
            parts.append(f"zkernel / DeepSpeed, same buffer {_ratio(rows[f'zkds_{kind}'], rows[f'ds_{kind}']):.2f} "
                         f"(target >= 1.00; own buffer {_ratio(rows[f'zk_{kind}'], rows[f'ds_{kind}']):.2f})")
            if engine:
                parts.append(f"DeepSpeed / fio best {_ratio(rows[f'ds_{kind}'], best):.2f}")
        if parts:
            print(f"{kind} (paired per round): " + "; ".join(parts))
    if args.raw:
        for key, values in rows.items():
            print(f"  {key:<16}" + " ".join(f"{v:.2f}" for v in values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="/tmp", help="directory on the file system to measure")
    parser.add_argument("--sizes", default="1,4", help="comma-separated sizes in GiB")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per size (default: one per tool)")
    parser.add_argument("--threads", type=int, default=aio.DEFAULT_THREADS)
    parser.add_argument("--block-size", type=int, default=aio.DEFAULT_BLOCK_SIZE)
    parser.add_argument("--queue-depth", type=int, default=aio.DEFAULT_QUEUE_DEPTH)
    parser.add_argument("--ds-block-size", type=int, default=1 << 20, help="DeepSpeed aio block size")
    parser.add_argument("--ds-queue-depth", type=int, default=8, help="DeepSpeed aio queue depth (per thread)")
    parser.add_argument("--ds-threads", type=int, default=4, help="DeepSpeed aio intra_op_parallelism")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed column")
    parser.add_argument("--raw", action="store_true", help="also print every round's GB/s")
    parser.add_argument("--checksum", action="store_true", help="add a zkernel column with CRC32C on")
    parser.add_argument("--keep", action="store_true", help="keep the test files")
    args = parser.parse_args()
    engine = _fio_engine()
    print("# Async file I/O benchmark")
    print(f"path {args.path} ({os.statvfs(args.path).f_bavail * os.statvfs(args.path).f_frsize / GIB:.0f} GiB free), "
          f"{os.cpu_count()} CPUs, zkernel threads {args.threads}, block {args.block_size >> 10} KiB, "
          f"pinned buffers {torch.cuda.is_available()}, python {sys.version.split()[0]}")
    print(f"fio: {engine + ' engine' if engine else 'fio not found'}")
    if args.no_deepspeed:
        ds_aio, why = None, "skipped (--no-deepspeed)"
    else:
        ds_aio, why = _load_deepspeed_aio()
    if ds_aio is None:
        print(f"DeepSpeed: absent: {why}")
    else:
        print(f"DeepSpeed {why} aio_handle: block {args.ds_block_size >> 10} KiB, queue depth {args.ds_queue_depth}, "
              f"intra_op_parallelism {args.ds_threads}, overlap_events on, single_submit off, "
              "mlock'ed buffer from new_cpu_locked_tensor")
    for size in args.sizes.split(","):
        bench_size(float(size), args, engine, ds_aio)


if __name__ == "__main__":
    main()
