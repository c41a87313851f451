"""CPU Adam benchmark: zkernel's native kernel against torch (and DeepSpeed if importable).

Two workloads, each at every size in --sizes:

(a) plain fp32 AdamW step (fp32 grads): zkernel vs torch ``_fused_adamw`` (fused=True)
    and foreach, and DeepSpeedCPUAdam when ``import deepspeed`` works;
(b) the offload step: bf16 grads in, grad_scale applied, AdamW, bf16 params out.
    zkernel does it in one pass; torch's sequence is upcast (copy_ into a
    preallocated fp32 buffer), mul_, fused AdamW, copy_ into bf16.

Bandwidth bounds, measured in the same run on the same buffers: a STREAM-like
copy (native memcpy per chunk, read+write bytes counted) and the Adam traffic
pattern with no arithmetic (p += g; m += g; v += g: 28 bytes/param).

All implementations share one set of buffers and are alternated call by call
(the starting one rotates every round), so each round gives paired ratios;
medians over rounds are printed. This VM's memory bandwidth flips between two
levels, which is why separate runs must not be compared.

    python3 bench/cpu_adam.py --sizes 10e6,100e6,1e9
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from torch.optim import adamw as torch_adamw

from zkernel.platform import native

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1
GRAD_SCALE = 1.0 / 1024


def _deepspeed_adam():
    """Return (callable(step, p, g, m, v), note) for DeepSpeed's CPU Adam, or (None, why)."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as exc:  # ImportError, or its own import-time errors
        return None, f"deepspeed not importable ({type(exc).__name__}: {str(exc)[:80]})"
    try:
        ds = CPUAdamBuilder().load()
        ds.create_adam(0, LR, BETAS[0], BETAS[1], EPS, WD, True, False)
    except Exception as exc:
        return None, f"DeepSpeed CPUAdam op build failed ({type(exc).__name__}: {str(exc)[:120]})"

    def step(t, p, g, m, v):
        ds.adam_update(0, t, LR, BETAS[0], BETAS[1], EPS, WD, True, p, g, m, v)

    return step, f"deepspeed {deepspeed.__version__}"


def _torch_adamw(p, g, m, v, step_t, *, fused):
    torch_adamw.adamw(
        [p], [g], [m], [v], [], [step_t],
        foreach=not fused, fused=fused, amsgrad=False, beta1=BETAS[0], beta2=BETAS[1],
        lr=LR, weight_decay=WD, eps=EPS, maximize=False,
    )


def bench_size(n: int, budget_s: float, ds_step) -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g32 = torch.randn(n, generator=gen) * 1e-2
    m = torch.zeros(n)
    v = torch.zeros(n)
    g16 = g32.to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    scratch = torch.zeros(n)  # probe source of zeros (+= 0 keeps the state finite) and copy target
    tmp32 = torch.empty(n)  # torch sequence's upcast buffer
    step_t = torch.zeros((), dtype=torch.float32)
    counter = {"t": 0}

    def ours_plain():
        counter["t"] += 1
        native.adam_step(p, g32, m, v, step=counter["t"], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def torch_fused():
        _torch_adamw(p, g32, m, v, step_t, fused=True)

    def torch_foreach():
        _torch_adamw(p, g32, m, v, step_t, fused=False)

    def ours_offload():
        counter["t"] += 1
        native.adam_step(p, g16, m, v, step=counter["t"], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         grad_scale=GRAD_SCALE, copy_out=out16)

    def torch_offload():
        tmp32.copy_(g16)
        tmp32.mul_(GRAD_SCALE)
        _torch_adamw(p, tmp32, m, v, step_t, fused=True)
        out16.copy_(p)

    def probe_adam():
        native.probe_adam_pattern(p, scratch, m, v)

    def probe_copy():
        native.probe_copy(p, scratch)

    impls = {
        "zk_plain": ours_plain, "torch_fused": torch_fused, "torch_foreach": torch_foreach,
        "zk_offload": ours_offload, "torch_offload": torch_offload,
        "bw_adam_pattern": probe_adam, "bw_copy": probe_copy,
    }
    if ds_step is not None:
        def ds_plain():
            counter["t"] += 1
            ds_step(counter["t"], p, g32, m, v)
        impls["deepspeed"] = ds_plain

    def run(fn) -> float:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if fn is probe_copy:
            scratch.zero_()  # untimed: scratch must be zeros again for the Adam probe
        return dt

    names = list(impls)
    t_round = sum(run(impls[k]) for k in names)  # warm-up (first touch) ...
    t_round = sum(run(impls[k]) for k in names)  # ... and an estimate of one round
    rounds = max(3, min(25, int(budget_s / t_round)))
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for k in order:
            times[k].append(run(impls[k]))

    med = {k: statistics.median(ts) for k, ts in times.items()}

    def paired(a: str, b: str) -> float:  # median over rounds of time_b / time_a (a's speedup over b)
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

    bw_adam = 28 * n / med["bw_adam_pattern"] / 1e9
    bw_copy = 8 * n / med["bw_copy"] / 1e9
    print(f"\n## n = {n:,} params, {rounds} alternating rounds (medians; ratios are paired per round)")
    print(f"bandwidth bound: Adam pattern (4R+3W) {bw_adam:6.1f} GB/s | STREAM-like copy {bw_copy:6.1f} GB/s")
    print(f"{'workload':<34}{'s/step':>10}{'Gparam/s':>10}{'GB/s':>8}{'% Adam bw':>11}{'zk speedup':>12}")

    def row(label, key, bytes_per_param, vs=None):
        t = med[key]
        gbs = bytes_per_param * n / t / 1e9
        pct = 100 * (bytes_per_param * n / t) / (28 * n / med["bw_adam_pattern"])
        speed = f"{paired(vs, key):>11.2f}x" if vs else f"{'':>12}"
        print(f"{label:<34}{t:>10.4f}{n / t / 1e9:>10.2f}{gbs:>8.1f}{pct:>10.0f}%{speed}")

    print("(a) plain fp32 AdamW step")
    row("  zkernel native", "zk_plain", 28)
    row("  torch AdamW fused=True", "torch_fused", 28, vs="zk_plain")
    row("  torch AdamW foreach", "torch_foreach", 28, vs="zk_plain")
    if "deepspeed" in impls:
        row("  DeepSpeedCPUAdam", "deepspeed", 28, vs="zk_plain")
    print("(b) offload step: bf16 grad * scale -> AdamW -> bf16 params")
    row("  zkernel native, one pass", "zk_offload", 28)
    row("  torch upcast+mul_+fused+copy", "torch_offload", 48, vs="zk_offload")
    ratio_a = paired("zk_plain", "torch_fused")
    ratio_b = paired("zk_offload", "torch_offload")
    pct_a = 100 * statistics.median(ta / tz for ta, tz in zip(times["bw_adam_pattern"], times["zk_plain"]))
    pct_b = 100 * statistics.median(ta / tz for ta, tz in zip(times["bw_adam_pattern"], times["zk_offload"]))
    print(f"targets: (a) {ratio_a:.2f}x torch fused (>= 1.0) and {pct_a:.0f}% of Adam-pattern bound (>= 85) "
          f"| (b) {ratio_b:.2f}x torch sequence (>= 1.5) and {pct_b:.0f}% of bound (>= 85)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10e6,100e6", help="comma-separated parameter counts, e.g. 10e6,100e6,1e9")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds of timed rounds per size")
    parser.add_argument("--threads", type=int, default=None, help="native and torch threads (default: all cores)")
    args = parser.parse_args()
    if args.threads:
        native.set_threads(args.threads)
        torch.set_num_threads(args.threads)
    ds_step, ds_note = _deepspeed_adam()
    print("# CPU Adam benchmark")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"native threads {native.threads()}, torch threads {torch.get_num_threads()}, "
          f"SIMD path {native.simd_path()}, torch {torch.__version__}, python {sys.version.split()[0]}")
    print("native loops run on "
          + ("the pool's own threads (ZKERNEL_NATIVE_OPENMP=0)" if os.environ.get("ZKERNEL_NATIVE_OPENMP") == "0"
             else "torch's OpenMP team (main thread; ZKERNEL_NATIVE_OPENMP=0 for the pool's own threads)"))
    print(f"DeepSpeed: {ds_note}")
    for size in args.sizes.split(","):
        bench_size(int(float(size)), args.budget, ds_step)


if __name__ == "__main__":
    main()
