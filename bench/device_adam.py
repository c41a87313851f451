"""One GPU Adam step over a flat fp32 shard: the ``adamw`` optimizer's Triton kernel beside torch's fused AdamW.

    python bench/device_adam.py --numel 650e6

Both do what the ``adamw`` optimizer's step does for a zero3 shard in bf16
training: scale the gradient by the step's coefficient (unscale times clip),
update master and moments, and write the bf16 copy the next gather reads.
torch's path is the one the optimizer takes without Triton: the scaled
gradient into a temporary, ``_fused_adamw_``, then ``copy_`` into the bf16
copy. Prints the time of each and the bytes each moves per second against the
device's memory bandwidth as a copy measures it.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
from torch.optim import adamw as torch_adamw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    from zkernel_plugins.optimizers import _triton_adam

    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=float, default=650e6)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--grad-scale", type=float, default=0.5, help="the step's coefficient (1 skips torch's temporary)")
    args = parser.parse_args()
    n = int(args.numel)
    device = torch.device("cuda")
    master, grad = torch.randn(n, device=device), torch.randn(n, device=device)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    copy = torch.empty(n, dtype=torch.bfloat16, device=device)
    step_tensor, steps = torch.zeros((), device=device), itertools.count(1)

    def ours():
        _triton_adam.adam_step(master, grad, exp_avg, exp_avg_sq, step=next(steps),
                               grad_scale=args.grad_scale, copy_out=copy, **HYPER)

    def torch_fused():
        g = grad * args.grad_scale if args.grad_scale != 1.0 else grad
        torch_adamw.adamw([master], [g], [exp_avg], [exp_avg_sq], [], [step_tensor], amsgrad=False,
                                beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], lr=HYPER["lr"],
                                weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], maximize=False, fused=True)
        copy.copy_(master)

    def fused_kernel_only():
        torch_adamw.adamw([master], [grad], [exp_avg], [exp_avg_sq], [], [step_tensor], amsgrad=False,
                                beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], lr=HYPER["lr"],
                                weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], maximize=False, fused=True)

    scratch = torch.empty_like(master)
    for fn in (ours, torch_fused, fused_kernel_only):
        fn()
    copy_s = _time(lambda: scratch.copy_(master), args.repeats)
    bandwidth = 2 * 4 * n / copy_s
    rows = []
    for label, fn, nbytes in (
        ("triton (scale, update, bf16 copy: one pass)", ours, 30 * n),
        ("torch: scaled temporary + fused AdamW + copy_", torch_fused, (30 + (8 if args.grad_scale != 1.0 else 0)) * n),
        ("torch fused AdamW kernel alone", fused_kernel_only, 28 * n),
    ):
        s = _time(fn, args.repeats)
        rows.append((label, s, nbytes))
    print(f"{torch.cuda.get_device_name()}, {n / 1e6:.0f} M elements, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    base = rows[1][1]
    for label, s, nbytes in rows:
        print(f"  {label:48s} {s * 1e3:7.2f} ms  {nbytes / s / 1e12:5.2f} TB/s ({nbytes / s / bandwidth:4.0%} of copy)"
              f"  {base / s:5.2f}x torch's path")


if __name__ == "__main__":
    main()
