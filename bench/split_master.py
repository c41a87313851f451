"""The split master's codec: native split and join (CPU) or Triton's (CUDA) against the torch path and a plain copy.

One master of --n fp32 elements (random bit patterns, a third of them ties or
their neighbours), split into its low halves and tie bits and joined back from
its bf16 rounding, by:

- the native codec (`zkernel.platform.native.split_master` / `join_master`,
  the default SIMD path), on the default thread pool and on one thread;
- the torch path of `zkernel.platform.split_master` (chunked torch operations,
  what CPU tensors got before the native codec);
- a plain fp32 copy of the master, native (`native.probe_copy`, the same pool
  and chunking) and torch (``Tensor.copy_``): the memory bound.

Bytes per element, as counted for GB/s: split reads 4 and writes 2 + 1/8
(6.125); join reads 2 + 2 + 1/8 and writes 4 (8.125); the copy reads 4 and
writes 4 (8). The variants share one set of buffers and alternate (the first
rotates every round); medians over rounds. "x copy GB/s" is a variant's GB/s
over the native copy's: above 1 where its streaming stores skip the reads
that the copy's plain stores make (uncounted) before writing. The torch path runs --torch-rounds
times (tens of ns an element: seconds per call at this size).

    python3 bench/split_master.py --n 300e6
    python3 bench/split_master.py --n 300e6 --torch-rounds 0 --simd scalar

With ``--device cuda`` the same master lives on the GPU and the variants are
the Triton kernels (`zkernel.platform.split_master_triton`, what
`split_master` / `join_master` run for CUDA tensors; left out where Triton
is not installed), the torch path (the
same functions with Triton taken away) and a plain fp32 ``Tensor.copy_``,
each call timed between two ``torch.cuda.synchronize()``, medians over
--rounds (the torch path over --torch-rounds). ``--block`` and ``--warps``
try other shapes of the kernels:

    python3 bench/split_master.py --device cuda --n 2e9 --rounds 11 --torch-rounds 3
    python3 bench/split_master.py --device cuda --n 2e9 --block 8192 --warps 8
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch

from zkernel.platform import native
from zkernel.platform import split_master as codec
from zkernel.platform import split_master_triton

SPLIT_BYTES = 4 + 2 + 1 / 8
JOIN_BYTES = 2 + 2 + 1 / 8 + 4
COPY_BYTES = 4 + 4


def _master(n: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator(device).manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, device=device, generator=gen).to(torch.int32)
    near = torch.rand(n, device=device, generator=gen) < 1 / 3
    bits = torch.where(near, (bits & ~0xFFFF) | 0x8000, bits)
    return bits.view(torch.float32)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=float, default=300e6, help="elements of the master")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of the native codec and the copies")
    parser.add_argument("--torch-rounds", type=int, default=1, help="timed rounds of the torch path (0: none)")
    parser.add_argument("--simd", default="auto", help="the native SIMD path: auto, avx512, avx2 or scalar")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the master lives")
    parser.add_argument("--block", type=int, default=split_master_triton.BLOCK,
                        help="elements a Triton program handles (cuda; a power of 2, at least 8)")
    parser.add_argument("--warps", type=int, default=split_master_triton.NUM_WARPS, help="warps a Triton program runs (cuda)")
    args = parser.parse_args()
    n = int(args.n)
    if args.device == "cuda":
        cuda_main(args, n)
        return
    native.set_simd_path(args.simd)
    print("# The split master's codec")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, native threads "
          f"{native.threads()}, SIMD path {native.simd_path()}, torch threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}, python {sys.version.split()[0]}")
    master = _master(n)
    high = master.to(torch.bfloat16)
    low = torch.zeros(n, dtype=torch.int16)
    ties = torch.zeros(codec.tie_bytes(n), dtype=torch.uint8)
    out = torch.zeros(n)
    copy = torch.zeros(n)

    def torch_path(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with mock.patch.object(native, "has_split_master", return_value=False):
                fn()

        return run

    variants: dict[str, tuple[float, Callable[[], None]]] = {
        "native split": (SPLIT_BYTES, lambda: native.split_master(master, low, ties)),
        "native join": (JOIN_BYTES, lambda: native.join_master(high, low, ties, out)),
        "native split, 1 thread": (SPLIT_BYTES, lambda: native.split_master(master, low, ties, threads=1)),
        "native join, 1 thread": (JOIN_BYTES, lambda: native.join_master(high, low, ties, out, threads=1)),
        "native copy (probe_copy)": (COPY_BYTES, lambda: native.probe_copy(master, copy)),
        "torch copy (Tensor.copy_)": (COPY_BYTES, lambda: copy.copy_(master)),
    }
    slow: dict[str, tuple[float, Callable[[], None]]] = {
        "torch path split": (SPLIT_BYTES, torch_path(lambda: codec.split_master(master, low, ties))),
        "torch path join": (JOIN_BYTES, torch_path(lambda: codec.join_master(high, low, ties, out))),
    }
    for _, fn in variants.values():
        fn()  # fault the pages in
    times = _time_rounds(variants, slow, args.rounds, args.torch_rounds, _timed)
    # The last call joined the split of the master: check it round-tripped.
    native.split_master(master, low, ties)
    native.join_master(high, low, ties, out)
    finite = ~master.isnan()
    assert torch.equal(out.view(torch.int32)[finite], master.view(torch.int32)[finite])

    copy_gbs = COPY_BYTES * n / statistics.median(times["native copy (probe_copy)"]) / 1e9
    print(f"\n## n = {n:,} ({args.rounds} rounds, torch path {args.torch_rounds})")
    _print_table(variants | slow, times, n, copy_gbs, "{:>10.1f}{:>12.3f}{:>8.2f}")


def _cuda_timed(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def cuda_main(args: argparse.Namespace, n: int) -> None:
    """The GPU table: Triton split and join, the torch path's, and an fp32 copy, all of ``n`` elements."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.block < 8 or args.block & (args.block - 1):
        raise SystemExit(f"--block must be a power of 2 of at least 8 (a whole number of tie bytes), got {args.block}")
    device = torch.device("cuda")
    has_triton = split_master_triton.available(device)
    split_master_triton.BLOCK = args.block
    split_master_triton.NUM_WARPS = args.warps
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed (no Triton rows)"
    print("# The split master's codec on the GPU")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"Triton {triton_version}, BLOCK {args.block}, warps {args.warps}, python {sys.version.split()[0]}")
    master = _master(n, device.type)
    high = master.to(torch.bfloat16)
    low = torch.zeros(n, dtype=torch.int16, device=device)
    ties = torch.zeros(codec.tie_bytes(n), dtype=torch.uint8, device=device)
    out = torch.zeros(n, device=device)
    copy = torch.zeros(n, device=device)

    def torch_path(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with mock.patch.object(split_master_triton, "available", return_value=False):
                fn()

        return run

    variants: dict[str, tuple[float, Callable[[], None]]] = {}
    if has_triton:
        variants["triton split"] = (SPLIT_BYTES, lambda: split_master_triton.split_master(master, low, ties))
        variants["triton join"] = (JOIN_BYTES, lambda: split_master_triton.join_master(high, low, ties, out))
    variants["torch copy (Tensor.copy_)"] = (COPY_BYTES, lambda: copy.copy_(master))
    slow: dict[str, tuple[float, Callable[[], None]]] = {
        "torch path split": (SPLIT_BYTES, torch_path(lambda: codec.split_master(master, low, ties))),
        "torch path join": (JOIN_BYTES, torch_path(lambda: codec.join_master(high, low, ties, out))),
    }
    for _, fn in variants.values():
        fn()  # compile the kernels, warm the allocator
    times = _time_rounds(variants, slow, args.rounds, args.torch_rounds, _cuda_timed)
    # The last calls joined the split of the master: check it round-tripped.
    codec.split_master(master, low, ties)
    codec.join_master(high, low, ties, out)
    torch.cuda.synchronize()
    finite = ~master.isnan()
    assert torch.equal(out.view(torch.int32)[finite], master.view(torch.int32)[finite])

    copy_gbs = COPY_BYTES * n / statistics.median(times["torch copy (Tensor.copy_)"]) / 1e9
    print(f"\n## n = {n:,} ({args.rounds} rounds, torch path {args.torch_rounds})")
    _print_table(variants | slow, times, n, copy_gbs, "{:>10.2f}{:>12.4f}{:>8.0f}")


def _time_rounds(variants: dict, slow: dict, rounds: int, torch_rounds: int, timer: Callable) -> dict[str, list[float]]:
    """Each of ``variants`` timed ``rounds`` times and each of ``slow`` ``torch_rounds`` times, in
    rotating order (so no variant always runs first after another), by ``timer``."""
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names + list(slow)}
    for r in range(max(rounds, torch_rounds)):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r < torch_rounds:
            order += list(slow)
        if r >= rounds:
            order = [k for k in order if k in slow]
        for k in order:
            times[k].append(timer((variants | slow)[k][1]))
    return times


def _print_table(variants: dict, times: dict[str, list[float]], n: int, copy_gbs: float, fmt: str) -> None:
    """One row per timed variant: median ms, ns per element, GB/s and the ratio to the copy's GB/s."""
    print(f"{'variant':<28}{'ms':>10}{'ns/element':>12}{'GB/s':>8}{'x copy GB/s':>13}")
    for k, (nbytes, _) in variants.items():
        if not times[k]:
            continue
        t = statistics.median(times[k])
        gbs = nbytes * n / t / 1e9
        print(f"{k:<28}" + fmt.format(t * 1e3, t / n * 1e9, gbs) + f"{gbs / copy_gbs:>13.2f}")


if __name__ == "__main__":
    main()
