"""Defaults against tuned settings: the same GPT trained by configurations that differ only there, in one call.

    python bench/defaults.py --model 6.7b --micro-batch 8 --accum 4 --checkpoint \\
        --run defaults='{"offload": {"optimizer": "cpu"}}' \\
        --run tuned='{"offload": {"optimizer": "cpu", "optimizer_options": {"gpu_share": 0.3}}}'
    python bench/defaults.py --model 1.3b --micro-batch 16 \\
        --run auto='{"partitioner": "auto", "offload": {"optimizer": "auto", "params": "auto"}, "planner": {"micro_batch": 16}}' \\
        --run fixed='{"partitioner": "zero3"}'

Each ``--run NAME=JSON`` is a zkernel config merged over the common recipe
(bf16, ``cpu_adam`` where the optimizer is offloaded, else ``adamw``,
AdamW(lr 1e-4, betas 0.9/0.95, wd 0.1), clipping ``--clip``,
``--accum`` micro-batches a step; ``--checkpoint`` adds every ``Block`` to
``activation_checkpointing`` unless the run sets that section or plans it);
the model is initialised as GPT-2 is (built on the meta device, materialised
by the partitioner), on learnable data (bench/zero_throughput.py's ``--data learnable --init gpt2``).
Every run is its own process, one after another on the same GPU; steps are
timed from one synchronized end to the next, as bench/zero_throughput.py
does (host steps running into the next forward count where they delay it),
median of ``--steps`` after ``--warmup``. Printed per
run: tokens/s, TFLOP/s (6N + 12·L·d·T per token; recomputation not counted),
peak GiB, the placement the engine ran (with the planner's choice and the GPU
share the tier took after the first step), and each run's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEQ = 1024
ADAMW = dict(lr=1e-4, betas=[0.9, 0.95], weight_decay=0.1)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def recipe(args, run: dict) -> dict:
    """The common recipe with ``run`` merged over it."""
    offloaded = run.get("offload", {}).get("optimizer", "none") in ("cpu", "nvme")
    config = {
        "precision": "bf16",
        "gradient_clipping": args.clip,
        "gradient_accumulation_steps": args.accum,
        "timeline": True,
        "optimizer": {"name": "cpu_adam" if offloaded else "adamw", **ADAMW},
    }
    planned = run.get("partitioner") == "auto" or "auto" in run.get("offload", {}).values()
    if args.checkpoint and "activation_checkpointing" not in run and not planned:
        config["activation_checkpointing"] = {"modules": ["Block"]}
    return _merge(config, run)


def _worker(args) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import zkernel
    from gpt_model import GPT, PRESETS, VOCAB, flops_per_token, gpt2_init, learnable_sequences, zkernel_train_step

    cuda = torch.cuda.is_available()  # without CUDA (a smoke test with --model tiny): the CPU, no peak
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = recipe(args, json.loads(args.config))
    with torch.device("meta"):
        fpt = flops_per_token(GPT(**PRESETS[args.model], seq=SEQ), SEQ)
    # Every builtin partitioner materialises a meta-device model, unit by unit under the same seeds,
    # so every run starts from the same values.
    with torch.device("meta"):
        model = GPT(**PRESETS[args.model], seq=SEQ)
    engine = zkernel.initialize(model, config, init_fn=gpt2_init)
    g = torch.Generator(device=device).manual_seed(1)
    times = []
    for i in range(args.warmup + args.steps):
        batches = [learnable_sequences(args.micro_batch, SEQ, VOCAB, device, g) for _ in range(args.accum)]
        sync()
        t0 = time.perf_counter()
        loss = zkernel_train_step(engine, batches)
        loss.item()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    cfg = engine.config
    tier = engine.optimizer_tier
    checkpointed = list(cfg.activation_checkpointing.modules)
    result = {
        "step_s": step,
        "tokens_per_s": args.micro_batch * args.accum * SEQ / step,
        "tflops": fpt * args.micro_batch * args.accum * SEQ / step / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "loss": float(loss),
        "placement": f"{cfg.partitioner} optimizer@{cfg.offload.optimizer} params@{cfg.offload.params}"
        + (f" checkpointing {checkpointed}" if checkpointed else ""),
        "optimizer_options": {k: v for k, v in dict(cfg.offload.optimizer_options).items()},
        "gpu_share_numel": getattr(tier, "gpu_share_numel", None),
        "trainable_numel": sum(grp.shard_layout.numel for grp in engine.groups if grp.requires_grad),
        "split_master_numel": getattr(tier, "split_master_numel", None),
        "planned": engine.placement_plan.placement if engine.placement_plan is not None else None,
    }
    summaries = engine.timeline.summaries
    if summaries:
        result["timeline"] = summaries[-1].log_fields()
    print("RESULT " + json.dumps(result, default=str), flush=True)
    engine.close()


def _run(args, name: str, config: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--config", config, "--model", args.model, "--micro-batch", str(args.micro_batch),
           "--accum", str(args.accum), "--steps", str(args.steps), "--warmup", str(args.warmup), "--clip", str(args.clip)]
    if args.checkpoint:
        cmd.append("--checkpoint")
    # In a session of its own, so a timeout kills the run and frees its GPU and host memory.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"name": name, "error": f"did not finish in --timeout {args.timeout:g} s"}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return {"name": name, **json.loads(line[7:])}
    tail = " | ".join((stdout + stderr).strip().splitlines()[-4:])[-600:]
    return {"name": name, "error": f"exit {proc.returncode}: {tail}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="6.7b", help="a preset of bench/gpt_model.py")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--checkpoint", action="store_true", help="recompute every Block (runs that plan placement decide themselves)")
    parser.add_argument("--run", action="append", default=[], metavar="NAME=JSON", help="a configuration to run (repeat)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    runs = [text.partition("=")[::2] for text in args.run]
    if not runs:
        parser.error("give at least one --run NAME=JSON")
    results = []
    for name, config in runs:
        json.loads(config)  # a typo fails here, before any run
        results.append(_run(args, name, config))
        print(json.dumps(results[-1], default=str), flush=True)
    print(f"\nGPT-{args.model}, seq {SEQ}, {args.accum} micro-batch(es) of {args.micro_batch} a step, bf16, clipping {args.clip:g}"
          + (", every block recomputed (fixed runs)" if args.checkpoint else ""))
    print(f"{'run':12} {'tokens/s':>10} {'TFLOP/s':>8} {'peak GiB':>9} {'step s':>7} {'vs first':>9}  placement")
    first = next((r for r in results if "error" not in r), None)
    for r in results:
        if "error" in r:
            print(f"{r['name']:12} {r['error']}")
            continue
        share = ""
        if r.get("gpu_share_numel"):
            share = f", GPU share {r['gpu_share_numel'] / r['trainable_numel']:.3f} of the trainable elements"
        print(f"{r['name']:12} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.1f} {r['peak_gib']:>9.1f} {r['step_s']:>7.3f} "
              f"{r['tokens_per_s'] / first['tokens_per_s']:>9.3f}  {r['placement']}{share}")


if __name__ == "__main__":
    main()
