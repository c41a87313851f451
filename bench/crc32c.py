"""CRC32C benchmark: `zkernel.platform.native.crc32c` per core and over the pool, hardware and table paths.

For each size in --sizes (bytes; suffixes K, M, G): one random buffer,
checksummed by each variant in turn (the order rotates every round; medians
over rounds): the SSE4.2 path on one thread, the SSE4.2 path on the whole
native pool (1 MiB pieces combined), the slicing-by-8 table path on one thread,
and a memory read bound (numpy sum of the buffer as uint64 words, one pass,
one thread; numpy does not thread it). Small sizes stay in the caches and show
the instruction's rate; large ones show what a core gets from memory. Besides
wall-clock GB/s, "GB/s per CPU-s" divides by the process's CPU time: on a
shared VM whose cores other jobs also use, that is the per-core rate (for the
pool variant, per core of the threads' summed time).

    python3 bench/crc32c.py --sizes 256K,64M,1G
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

from zkernel.platform import native


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def bench_size(n: int, budget_s: float) -> None:
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    words = data[: n // 8 * 8].view(np.uint64)
    repeat = max(1, (64 << 20) // n)  # small buffers: repeat the call inside one timing

    def variant(path: str, threads: int | None):
        def run() -> None:
            native.set_crc32c_path(path)
            try:
                for _ in range(repeat):
                    native.crc32c(data, threads=threads)
            finally:
                native.set_crc32c_path("auto")
        return run

    impls = {"sse4.2, 1 thread": variant("sse4.2", 1), f"sse4.2, {native.threads()} threads": variant("sse4.2", None),
             "table, 1 thread": variant("table", 1),
             "read bound (numpy sum, 1 thread)": lambda: [words.sum() for _ in range(repeat)]}
    if native.best_crc32c_path() != "sse4.2":
        impls = {k: v for k, v in impls.items() if not k.startswith("sse4.2")}

    def timed(fn) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    names = list(impls)
    t_round = sum(timed(impls[k])[0] for k in names)
    rounds = max(3, min(25, int(budget_s / max(t_round, 1e-9))))
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            times[k].append(timed(impls[k]))
    print(f"\n## {n:,} bytes (x{repeat} per timing), {rounds} rounds")
    print(f"{'variant':<36}{'GB/s':>8}{'GB/s per CPU-s':>16}")
    for k in names:
        wall = statistics.median(w for w, _ in times[k])
        cpu = statistics.median(c for _, c in times[k])
        print(f"{k:<36}{repeat * n / wall / 1e9:>8.2f}{repeat * n / max(cpu, 1e-9) / 1e9:>16.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256K,64M,1G", help="comma-separated sizes in bytes (K, M, G suffixes)")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds of timed rounds per size")
    args = parser.parse_args()
    print("# CRC32C benchmark")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, native threads "
          f"{native.threads()}, best path {native.best_crc32c_path()}, python {sys.version.split()[0]}")
    for size in args.sizes.split(","):
        bench_size(_size(size), args.budget)


if __name__ == "__main__":
    main()
