"""Host-side gradient accumulation: adding a micro-batch's gradient into the fp32 landing buffer.

The offload tiers land the first micro-batch of a window straight into an fp32
buffer in host memory and add every later one there (`CpuTier` with gradient
accumulation). With ``grad_dtype = "fp32"`` that is an fp32 + fp32 add; with
``"bf16"`` the gradient crossed the link in bf16 and is widened as it is added.
Compared, alternated round by round on the same buffers (medians printed, as
G elements/s and GB/s of gradient read):

* anchor: torch's fp32 add (``landing.add_(fp32)``), the memory-bound rate;
* torch's mixed-dtype add (``landing.add_(bf16)``);
* zkernel's widening add (`_widening_add`: cache-sized fp32 pieces).

Then the squared norm of the accumulated fp32 gradient (the clip coefficient of
an accumulated window), in ms and relative error against a float64 sum:
torch's ``pow(2).sum()`` (anchor), ``linalg.vector_norm`` squared, and
zkernel's `sq_norm` (fp32 pieces, their sums added in double).

    python3 bench/host_accumulate.py --numel 100e6 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zkernel_plugins.offload_tiers._host_grad import _widening_add, sq_norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=100e6)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = int(args.numel)
    gen = torch.Generator().manual_seed(0)
    landing = torch.zeros(n)
    fp32 = torch.randn(n, generator=gen)
    bf16 = fp32.to(torch.bfloat16)
    cases = {
        "torch fp32 add (anchor)": (lambda: landing.add_(fp32), 4),
        "torch mixed add, bf16": (lambda: landing.add_(bf16), 2),
        "zkernel widening add, bf16": (lambda: _widening_add(landing, bf16), 2),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds + 1):
        names = list(cases)
        names = names[r % len(names):] + names[: r % len(names)]
        for name in names:
            start = time.perf_counter()
            cases[name][0]()
            if r:  # the first round warms the pages and caches
                times[name].append(time.perf_counter() - start)
    anchor = statistics.median(times["torch fp32 add (anchor)"])
    print(f"{n / 1e6:.0f} M elements, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print(f"{'case':30s} {'G elem/s':>9s} {'GB/s grad':>10s} {'vs anchor':>10s}")
    for name, (_, width) in cases.items():
        t = statistics.median(times[name])
        print(f"{name:30s} {n / t / 1e9:9.2f} {n * width / t / 1e9:10.2f} {anchor / t:10.2f}")
    _norms(fp32, args.rounds)


def _norms(grad: torch.Tensor, rounds: int) -> None:
    exact = float(grad.double().pow(2).sum())
    cases = {
        "torch pow(2).sum() (anchor)": lambda: float(grad.pow(2).sum()),
        "torch linalg.vector_norm ** 2": lambda: float(torch.linalg.vector_norm(grad)) ** 2,
        "zkernel sq_norm": lambda: sq_norm(grad),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    values: dict[str, float] = {}
    for r in range(rounds + 1):
        for name, run in cases.items():
            start = time.perf_counter()
            values[name] = run()
            if r:
                times[name].append(time.perf_counter() - start)
    anchor = statistics.median(times["torch pow(2).sum() (anchor)"])
    print(f"{'squared norm':30s} {'ms':>9s} {'rel. error':>10s} {'vs anchor':>10s}")
    for name in cases:
        t = statistics.median(times[name])
        print(f"{name:30s} {t * 1e3:9.1f} {abs(values[name] - exact) / exact:10.1e} {anchor / t:10.2f}")


if __name__ == "__main__":
    main()
