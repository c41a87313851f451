"""Capacity runs: train one large GPT under one placement for a number of steps and report every tier's peak.

    python bench/largest_model.py --model 13b --micro-batch 8 --accum 10 --steps 10 --checkpoint \\
        --zkernel '{"partitioner": "zero3", "offload": {"optimizer": "nvme", "params": "cpu",
                    "optimizer_options": {"gpu_share": 0.27, "host_share": 0.33}}}' --nvme-path /mnt/nvme
    python bench/largest_model.py --model 2.7b --checkpoint --plain          # plain torch (AdamW fused, autocast)
    python bench/largest_model.py --model 52b --nproc 4 --zkernel '{...}'   # torchrun, one process per GPU

Placement: ``--plain`` is torch alone (fp32 parameters, bf16 autocast, fused
AdamW on the GPU); otherwise ``--zkernel`` is a zkernel config (JSON) that the
bench completes with the recipe (bf16, AdamW lr 1e-4 betas 0.9/0.95 wd 0.1,
``--clip``, ``--accum`` as ``gradient_accumulation_steps``, ``--checkpoint``
as activation checkpointing of every ``Block``, ``--nvme-path``; ``--tiled-loss``
for the head and loss through ``zkernel.tiled_cross_entropy``, in both); "auto"
placements are the planner's. The model starts from GPT-2's initialisation and
trains on sequences it can learn (`gpt_model.learnable_sequences`), so a falling loss shows the
updates land. Each step's loss, seconds, tokens/s and
TFLOP/s per GPU are printed as a ``STEP`` JSON line as soon as it ends (a run
cut short keeps what it measured), then a ``RESULT`` line: initialisation
seconds, the median step after ``--warmup``, peak GPU memory, peak host RSS
per rank, where the model states live (`Engine.memory_report`) and the disk
bytes moved per step. ``--deadline`` stops before a step that would end
after it (seconds since start).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEQ = 1024
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _model_spec(name: str) -> dict:
    """A preset name, or ``LAYERSxDIMxHEADS`` (``64x8192x64``)."""
    sys.path.insert(0, str(HERE))
    from gpt_model import PRESETS

    if name in PRESETS:
        return PRESETS[name]
    layers, dim, heads = (int(x) for x in name.split("x"))
    return dict(dim=dim, layers=layers, heads=heads)


def _config(args) -> dict:
    config = json.loads(args.zkernel)
    config.setdefault("precision", "bf16")
    config["gradient_accumulation_steps"] = args.accum
    config["gradient_clipping"] = args.clip
    config["optimizer"] = {
        "name": config.get("optimizer", {}).get("name", "cpu_adam" if config.get("offload") else "adamw"),
        "lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "weight_decay": ADAMW["weight_decay"],
    }
    if args.checkpoint:
        config["activation_checkpointing"] = {"modules": ["Block"], "offload": args.checkpoint_offload}
    offload = config.setdefault("offload", {})
    if "nvme" in (offload.get("optimizer"), offload.get("params")) or "auto" in (offload.get("optimizer"), offload.get("params")):
        os.makedirs(args.nvme_path, exist_ok=True)
        offload.setdefault("nvme_path", args.nvme_path)
    config["timeline"] = args.timeline or bool(args.trace)
    if args.trace:
        config["timeline_path"] = args.trace
    return config


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    if args.log_level:
        import logging

        logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                            format=f"%(relativeCreated)9.0f ms [rank {os.environ.get('RANK', '0')}] %(message)s")
    if args.dump_stacks:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_stacks, repeat=True)

    sys.path.insert(0, str(HERE))
    from gpt_model import GPT, VOCAB, flops_per_token, gpt2_init, learnable_sequences, zkernel_train_step

    start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    spec = _model_spec(args.model)
    with torch.device("meta"):
        fpt = flops_per_token(GPT(**spec, seq=SEQ), SEQ)
        n_params = sum(p.numel() for p in GPT(**spec, seq=SEQ).parameters())

    engine = None
    if args.plain:
        with device:
            model = GPT(**spec, seq=SEQ)
        model.apply(gpt2_init)
        model.checkpoint = args.checkpoint
        model.tiled_loss = args.tiled_loss
        opt = torch.optim.AdamW(model.parameters(), fused=cuda, **ADAMW)

        def train_step(micro_batches):
            for idx in micro_batches:
                with torch.autocast(device.type, torch.bfloat16):
                    loss = model(idx, torch.roll(idx, -1, 1)) / len(micro_batches)
                loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss * len(micro_batches)
    else:
        import zkernel

        config = _config(args)
        with torch.device("meta"):
            model = GPT(**spec, seq=SEQ)
        model.tiled_loss = args.tiled_loss
        engine = zkernel.initialize(model, config, init_fn=gpt2_init)

        def train_step(micro_batches):
            return zkernel_train_step(engine, micro_batches)

    sync()
    init_s = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator(device=device).manual_seed(1 + rank)
    tokens_per_step = args.micro_batch * args.accum * SEQ * world
    times, losses = [], []
    disk = _disk_counters(engine)
    for i in range(args.warmup + args.steps):
        elapsed = time.perf_counter() - start
        if args.deadline and times and elapsed + max(times) > args.deadline:
            break
        if i == args.warmup:
            disk = _disk_counters(engine)
        batch = [learnable_sequences(args.micro_batch, SEQ, VOCAB, device, g) for _ in range(args.accum)]
        before = _disk_counters(engine)
        sync()
        t0 = time.perf_counter()
        loss = train_step(batch).detach().float()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        sync()
        seconds = time.perf_counter() - t0
        times.append(seconds)
        if rank == 0:
            line = {"step": i, "loss": losses[-1], "seconds": round(seconds, 3),
                    "tokens_per_s": round(tokens_per_step / seconds, 1),
                    "tflops_per_gpu": round(fpt * tokens_per_step / world / seconds / 1e12, 1)}
            moved = [b - a for a, b in zip(before, _disk_counters(engine))]
            if any(moved):  # the disk bytes counted while this step's call ran (a step's tail runs into the next)
                line["disk_read_gb"], line["disk_written_gb"] = round(moved[0] / 1e9, 2), round(moved[1] / 1e9, 2)
            if engine is not None and engine.timeline.summaries:
                line["timeline"] = engine.timeline.summaries[-1].log_fields()
            print("STEP " + json.dumps(line), flush=True)
    measured = times[args.warmup:] or times[-1:]
    step = statistics.median(measured)
    result = {
        "model": args.model, "params": n_params, "world": world, "micro_batch": args.micro_batch, "accum": args.accum,
        "tokens_per_step": tokens_per_step, "init_s": round(init_s, 1), "steps_run": len(times),
        "measured_steps": len(measured), "step_s": round(step, 3), "tokens_per_s": round(tokens_per_step / step, 1),
        "tflops_per_gpu": round(fpt * tokens_per_step / world / step / 1e12, 1), "losses": [round(x, 4) for x in losses],
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    if engine is not None:
        report = engine.memory_report()
        for where in ("cuda", "cpu", "nvme"):  # the report's devices are "cuda:0", "cpu", "nvme"
            held = sum(n for c in report for device, n in report[c].items() if device.split(":")[0] == where)
            result[f"states_{where}_gib"] = round(held / 2**30, 2)
        moved = [b - a for a, b in zip(disk, _disk_counters(engine))]
        if any(moved):
            result["disk_read_gb_per_step"] = round(moved[0] / len(measured) / 1e9, 2)
            result["disk_written_gb_per_step"] = round(moved[1] / len(measured) / 1e9, 2)
        tier = engine.optimizer_tier
        for name in ("gpu_share_numel", "host_share_numel", "split_master_numel", "nbytes_on_disk"):
            if hasattr(tier, name):  # where the optimizer's elements are, and how many keep split masters
                result[name] = getattr(tier, name)
        if engine.placement_plan is not None:
            result["plan"] = str(engine.placement_plan)
        if engine.timeline.summaries:
            result["timeline"] = engine.timeline.summaries[-1].log_fields()
        result["config"] = _config(args)
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, {k: result[k] for k in result if k.startswith(("peak_", "states_"))})
        result["per_rank"] = gathered
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if engine is not None:
        engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _disk_counters(engine) -> list[int]:
    if engine is None:
        return [0, 0]
    tiers = {id(t): t for t in (engine.optimizer_tier, engine.params_tier)}.values()
    return [sum(getattr(t, name, 0) for t in tiers) for name in ("bytes_read", "bytes_written")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.3b", help="a preset of bench/gpt_model.py or LAYERSxDIMxHEADS")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=10, help="steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=1)
    placement = parser.add_mutually_exclusive_group(required=True)
    placement.add_argument("--plain", action="store_true", help="torch alone")
    placement.add_argument("--zkernel", help="a zkernel config as JSON (partitioner, offload, ...)")
    parser.add_argument("--checkpoint", action="store_true", help="recompute every Block in backward")
    parser.add_argument("--checkpoint-offload", default="none", choices=("none", "cpu"))
    parser.add_argument("--tiled-loss", action="store_true",
                        help="the head and loss through zkernel.tiled_cross_entropy (no whole logits)")
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--nvme-path", default="/tmp/zkernel-nvme")
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--trace", help="write the timeline as a Chrome trace to this path (implies --timeline)")
    parser.add_argument("--deadline", type=float, default=0.0, help="seconds: no step starts that would end after it")
    parser.add_argument("--log-level", default="", help="log zkernel's events to stderr at this level (info, debug)")
    parser.add_argument("--dump-stacks", type=float, default=0.0, help="seconds: dump every thread's stack this often")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or args.nproc == 1:
        _worker(args)
        return
    forwarded, skip = [], False  # every argument but --nproc (torchrun would take it for its own)
    for arg in sys.argv[1:]:
        if skip or arg.startswith("--nproc"):
            skip = not skip and arg == "--nproc"
            continue
        forwarded.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--master_port=29547",
           __file__, "--worker", *forwarded]
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
