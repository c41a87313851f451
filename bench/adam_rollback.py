"""CPU Adam rollback benchmark: `native.adam_rollback` against `native.adam_step` and the memory bound.

Per size: one set of buffers; each round runs a step, then its rollback (so the
state stays where it was), with fp32 and with bf16 gradients, and the Adam
traffic probe (p += g; m += g; v += g, no arithmetic: 28 bytes/param), in an
order that rotates every round. The rollback moves the step's bytes (read p,
g, m, v; write p, m, v: 28 bytes/param with fp32 gradients, 26 with bf16);
GB/s and the share of the probe's GB/s in the same round are printed (medians
over rounds, ratios paired per round; this VM's bandwidth shifts between runs).
--paths also times the rollback on the slower SIMD paths, to show whether the
kernel waits on memory or on arithmetic.

    python3 bench/adam_rollback.py --sizes 10e6,100e6 --paths avx2,scalar
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from zkernel.platform import native

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GRAD_SCALE = 1.0 / 1024


def bench_size(n: int, budget_s: float, paths: list[str]) -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g32 = torch.randn(n, generator=gen) * 1e-2
    g16 = g32.to(torch.bfloat16)
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-4
    zeros = torch.zeros(n)
    step = 1000

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def step_and_rollback(grad, path):
        def run() -> tuple[float, float]:
            native.set_simd_path(path)
            try:
                t_step = timed(lambda: native.adam_step(p, grad, m, v, step=step, grad_scale=GRAD_SCALE, **HYPER))
                t_back = timed(lambda: native.adam_rollback(p, grad, m, v, step=step, grad_scale=GRAD_SCALE, **HYPER))
            finally:
                native.set_simd_path("auto")
            return t_step, t_back
        return run

    impls = {}
    for path in paths:
        impls[f"f32_{path}"] = step_and_rollback(g32, path)
        impls[f"bf16_{path}"] = step_and_rollback(g16, path)
    impls["probe"] = lambda: (timed(lambda: native.probe_adam_pattern(p, zeros, m, v)), 0.0)
    names = list(impls)
    for k in names:  # warm-up
        impls[k]()
    t_round = sum(sum(impls[k]()) for k in names)
    rounds = max(3, min(30, int(budget_s / max(t_round, 1e-9))))
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            times[k].append(impls[k]())

    probe = [t for t, _ in times["probe"]]
    bw = 28 * n / statistics.median(probe) / 1e9
    print(f"\n## n = {n:,} params, {rounds} rounds; Adam-pattern bound {bw:.1f} GB/s")
    print(f"{'workload':<30}{'step s':>9}{'rollback s':>12}{'rollback GB/s':>15}{'% bound':>9}{'rollback/step':>15}")
    for k in names[:-1]:
        grad, path = k.split("_", 1)
        nbytes = (28 if grad == "f32" else 26) * n
        t_step = statistics.median(s for s, _ in times[k])
        t_back = statistics.median(b for _, b in times[k])
        pct = 100 * statistics.median(pr * nbytes / (28 * n) / b for pr, (_, b) in zip(probe, times[k]))
        ratio = statistics.median(b / s for s, b in times[k])
        print(f"{grad + ' grad, ' + path:<30}{t_step:>9.4f}{t_back:>12.4f}{nbytes / t_back / 1e9:>15.1f}"
              f"{pct:>8.0f}%{ratio:>14.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10e6,100e6", help="comma-separated parameter counts")
    parser.add_argument("--budget", type=float, default=15.0, help="seconds of timed rounds per size")
    parser.add_argument("--paths", default="", help="extra SIMD paths to time, e.g. avx2,scalar")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        native.set_threads(args.threads)
        torch.set_num_threads(args.threads)
    best = native.best_simd_path()
    paths = [best] + [x for x in args.paths.split(",") if x and x != best]
    print("# CPU Adam rollback benchmark")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"native threads {native.threads()}, best SIMD path {best}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}")
    for size in args.sizes.split(","):
        bench_size(int(float(size)), args.budget, paths)


if __name__ == "__main__":
    main()
