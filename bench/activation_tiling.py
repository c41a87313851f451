"""Activation checkpointing (with CPU offload) and memory-centric tiling: memory and tokens/s, from one run.

    python bench/activation_tiling.py --model 1.3b --micro-batch 16
    python bench/activation_tiling.py --model 6.7b --micro-batch 8 --offload-optimizer cpu
    python bench/activation_tiling.py --modes linear_whole,linear_tiled          # one huge Linear under a budget
    python bench/activation_tiling.py --model tiny --seq 64 --micro-batch 2 --linear 256,1024 --linear-rows 64 --steps 2 --warmup 1   # CPU

Each mode runs in its own process, one after another, on one device:

* ``none``: zkernel (zero3 by default, bf16) training the anchors' GPT (bench/gpt_model.py);
* ``ckpt``: every ``Block`` checkpointed (``[activation_checkpointing] modules = ["Block"]``);
* ``ckpt_offload``: the same with ``offload = "cpu"`` (saved block inputs in pinned host memory);
* ``tiled_mlp``: no checkpointing, every block's MLP Linears (``fc``, ``out``) split into ``--tiles`` tiles;
* ``linear_whole`` / ``linear_tiled``: a model that is one huge Linear (``--linear IN,OUT``, fed
  ``--linear-rows`` rows a step) and a small head, optimizer state on the host, under a device
  memory budget (``--budget-gib``, default: what the model holds after initialize plus 1.5x the
  layer's bf16 bytes plus 1 GiB for activations, enforced with
  ``torch.cuda.set_per_process_memory_fraction``): whole, the layer and its gradient cannot be
  held at once (OOM expected); tiled (``--linear-tiles``), it trains.

With ``--tiled-loss`` every GPT mode computes the tied head and the loss through
``zkernel.tiled_cross_entropy``: the logits (the largest activation: 16 x 1024 x 50,304 in bf16, in
fp32 again for the loss, and their gradient) are never whole.

Reported per mode: tokens/s (median step), peak device memory over the timed steps, and the peak
of forward+backward above what was allocated before the forward, less the gradient shards that
backward allocates and the step frees ("act GiB": saved activations, recomputation, gathered
parameters and gradients in flight; the gradient shards are model state, shown apart as "grads
GiB": 4 bytes per parameter under zero3 with the optimizer on the device). Targets (issue 10):
``ckpt_offload`` activation memory >= 5x below ``none`` at <= 5% tokens/s below ``ckpt``;
``tiled_mlp`` <= 5% tokens/s below ``none``; ``linear_tiled`` trains where ``linear_whole`` cannot.
Without CUDA the same runs go on the CPU: no device memory columns, no budget; the linear modes
show zkernel's peak of gathered parameter bytes (``engine.memory_report()`` after every fetch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
GPT_MODES = ("none", "ckpt", "ckpt_offload", "tiled_mlp")
LINEAR_MODES = ("linear_whole", "linear_tiled")


def _config(args, mode: str) -> dict:
    config = {
        "partitioner": args.partitioner,
        "precision": args.precision,
        "optimizer": {
            "name": "cpu_adam" if args.offload_optimizer in ("cpu", "nvme") else "adamw",
            "lr": ADAMW["lr"],
            "betas": list(ADAMW["betas"]),
            "weight_decay": ADAMW["weight_decay"],
        },
        "offload": {"optimizer": args.offload_optimizer},
        "gradient_accumulation_steps": args.accum,
    }
    if args.options:
        config["partitioner_options"] = json.loads(args.options)
    if args.tier_options:
        config["offload"]["optimizer_options"] = json.loads(args.tier_options)
    if args.prefetch_mb is not None:
        config["prefetch_bytes"] = int(args.prefetch_mb * 2**20)
    if mode in ("ckpt", "ckpt_offload"):
        config["activation_checkpointing"] = {"modules": ["Block"], "offload": "cpu" if mode == "ckpt_offload" else "none"}
    if mode == "tiled_mlp":
        config["tiling"] = {"modules": ["blocks.*.fc", "blocks.*.out"], "tiles": args.tiles}
    if mode in LINEAR_MODES:
        config["offload"] = {"optimizer": "cpu"}
        config["prefetch_bytes"] = 0
        config["partitioner"] = "zero3"
        config["partitioner_options"] = {"persistence_threshold": 0}
        if mode == "linear_tiled":
            config["tiling"] = {"modules": ["proj"], "tiles": args.linear_tiles}
    return config


class _GatheredPeak:
    """Most parameter bytes held beyond the shards, sampled after every fetch (CPU runs only: it costs time)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.base = self._params()
        self.peak = 0

    def _params(self) -> int:
        return sum(self.engine.memory_report()["params"].values())

    def sample(self) -> None:
        self.peak = max(self.peak, self._params() - self.base)


def _worker(args) -> None:
    import torch
    from torch import nn

    import zkernel
    from zkernel.spec.hookspecs import hookimpl

    sys.path.insert(0, str(HERE))
    from gpt_model import GPT, PRESETS, VOCAB, flops_per_token

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    mode = args.mode
    config = _config(args, mode)
    seq = args.seq

    if mode in LINEAR_MODES:
        d_in, d_out = (int(v) for v in args.linear.split(","))

        class BigLinear(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.proj = nn.Linear(d_in, d_out)
                self.head = nn.Linear(d_out, 1)

            def forward(self, x, _targets):
                return (self.head(torch.nn.functional.gelu(self.proj(x))).float() - 1).pow(2).mean()

        with torch.device("meta"):
            model = BigLinear()
        rows = args.linear_rows

        def batch(g):
            return torch.randn(rows, d_in, device=device, generator=g), None

        fpt = 6 * (d_in * d_out + d_out * 2)
        layer_bytes = d_in * d_out * 2
    else:
        preset = PRESETS[args.model]
        meta = config["partitioner"] == "zero3"
        with torch.device("meta") if meta else device:
            model = GPT(**preset, seq=seq)
        model.tiled_loss = args.tiled_loss
        with torch.device("meta"):
            fpt = flops_per_token(GPT(**preset, seq=seq), seq)

        def batch(g):
            idx = torch.randint(0, VOCAB, (args.micro_batch, seq), device=device, generator=g)
            return idx, torch.roll(idx, -1, 1)

    engine = zkernel.initialize(model, config)
    meter = None
    if not cuda and mode in LINEAR_MODES:
        meter = _GatheredPeak(engine)

        class Sampler:
            @hookimpl(wrapper=True)
            def zkernel_fetch_params(self, group, phase):
                result = yield
                meter.sample()
                return result

        engine.plugin_manager.register(Sampler())
    budget = None
    if cuda and mode in LINEAR_MODES:
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(args.budget_gib * 2**30) if args.budget_gib else torch.cuda.memory_allocated() + int(1.5 * layer_bytes) + 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)

    def device_grads() -> int:
        return engine.memory_report()["grads"].get(str(device), 0)

    g = torch.Generator(device=device).manual_seed(1)
    times, act_peaks = [], []
    overall = 0
    grads_made: dict[int, int] = {}  # micro-batch -> gradient bytes its backward allocated (a warm-up step)
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        act = 0
        for micro in range(args.accum):
            inputs = batch(g)
            measure = cuda and i == 0
            grads_before = device_grads() if measure else 0
            if cuda:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            loss = engine(*inputs)
            engine.backward(loss)
            if measure:
                grads_made[micro] = device_grads() - grads_before
            if cuda:
                act = max(act, torch.cuda.max_memory_allocated() - base - grads_made.get(micro, 0))
                overall = max(overall, torch.cuda.max_memory_allocated())
            engine.step()
        loss.item()
        if cuda:
            torch.cuda.synchronize()
            overall = max(overall, torch.cuda.max_memory_allocated())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            act_peaks.append(act)
    step = statistics.median(times)
    per_micro = args.linear_rows if mode in LINEAR_MODES else args.micro_batch * seq
    result = {
        "mode": mode,
        "step_s": step,
        "tokens_per_s": per_micro * args.accum / step,
        "tflops": fpt * per_micro * args.accum / step / 1e12,
        "peak_gib": overall / 2**30 if cuda else None,
        "act_gib": max(act_peaks) / 2**30 if cuda else None,
        "grads_gib": max(grads_made.values(), default=0) / 2**30 if cuda else None,
        "gathered_mib": meter.peak / 2**20 if meter else None,
        "budget_gib": budget / 2**30 if budget else None,
        "loss": float(loss),
    }
    print("RESULT " + json.dumps(result), flush=True)
    engine.close()


def _run_mode(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--mode", mode]
    for key in ("model", "micro_batch", "seq", "steps", "warmup", "accum", "partitioner", "precision",
                "offload_optimizer", "options", "tier_options", "tiles", "linear", "linear_tiles", "linear_rows", "budget_gib",
                "prefetch_mb"):
        value = getattr(args, key)
        if value is not None and value != "":
            cmd += ["--" + key.replace("_", "-"), str(value)]
    if args.tiled_loss:
        cmd.append("--tiled-loss")
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
    oom = any("OutOfMemory" in t or "out of memory" in t for t in tail)
    if not oom:
        print(f"[{mode}] failed (exit {proc.returncode}): " + " | ".join(tail)[-800:], flush=True)
    return {"mode": mode, "error": "OOM" if oom else f"exit {proc.returncode}"}


def _fmt(value, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.3b", help="GPT preset of bench/gpt_model.py (tiny, 350m, 1.3b, 6.7b)")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps (tokens/s counts every micro-batch)")
    parser.add_argument("--partitioner", default="zero3")
    parser.add_argument("--precision", default=None, help="bf16 with CUDA, else fp32 (bf16 backward is slow on CPU)")
    parser.add_argument("--offload-optimizer", default="none",
                        help="offload.optimizer tier (cpu for GPT-6.7B on one H100; offloaded runs use cpu_adam)")
    parser.add_argument("--options", default="", help="partitioner_options as JSON")
    parser.add_argument("--tier-options", default="", help="offload.optimizer_options as JSON (gpu_share, say)")
    parser.add_argument("--prefetch-mb", type=float, default=None)
    parser.add_argument("--tiles", type=int, default=4, help="tiles per MLP Linear in tiled_mlp")
    parser.add_argument("--tiled-loss", action="store_true", help="head and loss through zkernel.tiled_cross_entropy")
    parser.add_argument("--linear", default="16384,65536", help="IN,OUT features of the huge Linear")
    parser.add_argument("--linear-tiles", type=int, default=8)
    parser.add_argument("--linear-rows", type=int, default=2048, help="rows (tokens) per step of the linear modes")
    parser.add_argument("--budget-gib", type=float, default=None, help="device memory budget of the linear modes")
    parser.add_argument("--modes", default=None, help=f"comma list of {', '.join(GPT_MODES + LINEAR_MODES)}")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.precision is None:
        import torch

        args.precision = "bf16" if torch.cuda.is_available() else "fp32"
    if args.worker:
        _worker(args)
        return
    modes = args.modes.split(",") if args.modes else list(GPT_MODES + LINEAR_MODES)
    unknown = [m for m in modes if m not in GPT_MODES + LINEAR_MODES]
    if unknown:
        parser.error(f"unknown mode {unknown[0]!r}; valid: {', '.join(GPT_MODES + LINEAR_MODES)}")
    results = {m: _run_mode(args, m) for m in modes}
    print(f"\nGPT-{args.model}, seq {args.seq}, micro-batch {args.micro_batch} x accum {args.accum}, "
          f"{args.partitioner}, {args.precision}, optimizer tier {args.offload_optimizer}, "
          f"loss {'tiled' if args.tiled_loss else 'whole logits'}; "
          f"huge Linear {args.linear} ({args.linear_tiles} tiles), MLP tiles {args.tiles}")
    print(f"{'mode':13} {'tokens/s':>10} {'TFLOP/s':>8} {'peak GiB':>9} {'act GiB':>8} {'grads GiB':>9} "
          f"{'gathered MiB':>13} {'budget GiB':>10}  vs")
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:13} {r['error']:>10}" + ("  (expected under the budget)" if mode == "linear_whole" and r["error"] == "OOM" else ""))
            continue
        comparisons = []
        for other, label in (("none", "none"), ("ckpt", "ckpt")):
            ref = results.get(other)
            if other != mode and ref and "error" not in ref and mode in GPT_MODES:
                ratio = f"tok/s {r['tokens_per_s'] / ref['tokens_per_s']:.3f}"
                if r["act_gib"] and ref["act_gib"]:
                    ratio += f", act 1/{ref['act_gib'] / r['act_gib']:.1f}"
                comparisons.append(f"{label}: {ratio}")
        print(f"{mode:13} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.1f} {_fmt(r['peak_gib'], '9.1f')} "
              f"{_fmt(r['act_gib'], '8.2f')} {_fmt(r.get('grads_gib'), '9.2f')} {_fmt(r['gathered_mib'], '13.1f')} "
              f"{_fmt(r['budget_gib'], '10.1f')}  "
              + "; ".join(comparisons))


if __name__ == "__main__":
    main()
