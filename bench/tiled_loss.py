"""The head and its cross-entropy: zkernel.tiled_cross_entropy against F.linear + F.cross_entropy, one run.

    python bench/tiled_loss.py                                   # GPT-1.3B's head at micro-batch 16, on the GPU
    python bench/tiled_loss.py --rows 2048 --classes 8192 --reps 3   # CPU

Times forward+backward (median of ``--reps`` after 3 warm-ups) and the peak memory above what was
allocated before (CUDA) for the untiled head (the anchor) and for the tiled loss at each
``--tile-mib``; then, on CUDA, the two ways of summing one tile's weight gradient into fp32 (a bf16
product added to the sum, and ``addmm`` with ``out_dtype=float32`` into it) and their error.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import zkernel


def _time(fn, reps: int, sync) -> float:
    times = []
    for i in range(reps + 3):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16384, help="tokens (micro-batch x sequence)")
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=50304)
    parser.add_argument("--tile-mib", default="128,256,512,1024,2048", help="comma list of tile_bytes in MiB")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.rows, args.features, device=device, generator=g).to(dtype).requires_grad_()
    weight = (0.02 * torch.randn(args.classes, args.features, device=device, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, args.classes, (args.rows,), device=device, generator=g)

    def run(loss_fn):
        def step():
            hidden.grad = weight.grad = None
            loss_fn().backward()

        ms = _time(step, args.reps, sync)
        peak = None
        if cuda:
            hidden.grad = weight.grad = None
            sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            sync()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        return ms, peak

    print(f"head {args.rows} x {args.features} -> {args.classes} classes, {dtype}, {device}")
    print(f"{'':22} {'ms':>8} {'peak GiB':>9} {'vs untiled':>10}")
    base_ms, peak = run(lambda: F.cross_entropy(F.linear(hidden, weight).float(), target))
    print(f"{'untiled (anchor)':22} {base_ms:8.2f} {peak if peak is not None else float('nan'):9.2f} {1.0:10.3f}")
    for mib in (int(v) for v in args.tile_mib.split(",")):
        ms, peak = run(lambda: zkernel.tiled_cross_entropy(hidden, weight, target, tile_bytes=mib * 2**20))
        label = f"tiled, {mib} MiB tiles"
        print(f"{label:22} {ms:8.2f} {peak if peak is not None else float('nan'):9.2f} {base_ms / ms:10.3f}")

    if not cuda:
        return
    # One tile's weight gradient (GPT-1.3B at 512 MiB tiles: ~2,600 rows) summed into fp32.
    rows = min(args.rows, (512 * 2**20) // (args.classes * 4))
    grad = torch.randn(rows, args.classes, device=device, generator=g).to(dtype)
    h = hidden[:rows].detach()
    into = torch.zeros(args.classes, args.features, device=device)
    exact = grad.t().float() @ h.float()
    print(f"\nsumming one tile's weight gradient ({rows} rows) into fp32:")
    for label, fn, value in (
        ("bf16 product, added", lambda: into.add_(grad.t() @ h), lambda: (grad.t() @ h).float()),
        ("addmm out_dtype fp32", lambda: torch.addmm(into, grad.t(), h, out_dtype=torch.float32, out=into),
         lambda: torch.addmm(torch.zeros_like(into), grad.t(), h, out_dtype=torch.float32)),
    ):
        try:
            ms = _time(fn, 20, sync)
            err = float((value() - exact).norm() / exact.norm())
            print(f"  {label:22} {ms:7.3f} ms, relative error {err:.1e}")
        except (RuntimeError, TypeError) as exc:  # addmm's out_dtype is missing on older torch
            print(f"  {label:22} not available: {str(exc).splitlines()[0][:100]}")


if __name__ == "__main__":
    main()
