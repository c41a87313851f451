"""Training throughput of zkernel zero1/2/3 (with offload) beside plain torch, DDP and FSDP2, from one run.

    python bench/zero_throughput.py --model 1.3b --micro-batch 16 --nproc 1
    python bench/zero_throughput.py --model 1.3b --micro-batch 16 --nproc 2 --modes ddp,fsdp2,zero1,zero2,zero3
    python bench/zero_throughput.py --model 1.3b --modes plain,fsdp2_offload,zero3+cpu --clip 1.0 --timeline

A zkernel mode is a partitioner, optionally ``+tier`` for ``offload.optimizer``
(``zero3+cpu``, ``zero2+nvme``) and ``/tier`` for ``offload.params`` (zero3:
``zero3+nvme/nvme`` puts both on NVMe, ``zero3+cpu/nvme`` the optimizer on the
CPU and the parameters on NVMe, ``zero3+none/cpu`` only the parameters on the
CPU); modes whose optimizer is offloaded use the ``cpu_adam`` optimizer unless
``--zk-optimizer`` says otherwise. ``--tier-options`` and
``--params-tier-options`` are the two roles' options (JSON); NVMe modes keep
their files under ``--nvme-path`` and report the disk bytes moved per step. A suffix ``@blocks`` selects
zero3's unit policy, ``#32`` a micro-batch for that mode alone
(``fsdp2_offload#32``), and each ``~key=value`` a partitioner option for that
mode alone (``~opt.key=value`` an optimizer option, ``~cfg.key=value`` a top-level config key,
``~env.NAME=value`` an environment variable of the mode's processes:
``zero3@blocks~peer_gathers=never~opt.implementation=fused``). ``fsdp2_offload`` is FSDP2
with ``CPUOffloadPolicy(pin_memory=True)``. ``ceiling`` is no engine: the
model's forward and backward alone with bf16 weights resident on each GPU (no
collective, cast or optimizer step), the most any data-parallel engine can
reach at this micro-batch. ``--kernels N`` profiles N more steps on rank 0 and
prints the GPU time by kernel category and the compute stream's idle time
(``bench/kernel_profile.py``). ``--clip`` applies global-norm
clipping in every mode (torch's ``clip_grad_norm_`` for the anchors).
``--accum N`` runs N micro-batches per optimizer step in every mode (the
anchors divide each loss by N and step once; zkernel sets
``gradient_accumulation_steps``); tokens/s counts them all.
``--data learnable`` trains on sequences a model can learn (each counts up from a
random start by a random stride), so the loss and the gradient norm fall as in
real training; the default, ``random``, is the anchors' uniform random tokens,
whose gradient norm stays above a clipping threshold of 1.0 at every step (the
worst case for an optimizer step that needs the norm first). ``--init gpt2``
initialises every mode's weights as GPT-2 does (normal, std 0.02) instead of
the modules' defaults, whose unit-variance tied embeddings start the loss near
100 and the gradient norm in the hundreds. Each mode reports how many timed
steps clipped.

The driver runs each mode in its own process group (torchrun for --nproc > 1)
one after another on the same GPUs, then prints tokens/s, TFLOP/s per GPU,
peak GPU memory and each mode's ratio to FSDP2. Model and recipe are the
anchors' (shared/ANCHORS.md): GPT with tied embeddings, seq 1024, random
tokens, AdamW(lr 1e-4, betas 0.9/0.95, wd 0.1), bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEQ = 1024
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from gpt_model import GPT, PRESETS, VOCAB, flops_per_token, gpt2_init, learnable_sequences, zkernel_train_step

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    torch.manual_seed(0)
    preset = PRESETS[args.model]
    mode, micro_batch, units, overrides = _parse_mode(args.mode, args.micro_batch)

    if mode == "ceiling":
        # The ceiling of any data-parallel engine at this micro-batch: the model's own forward and
        # backward with bf16 weights resident, no collective, no cast, no optimizer step.
        with device:
            model = GPT(**preset, seq=SEQ).to(torch.bfloat16)
        if args.init == "gpt2":
            model.apply(gpt2_init)
        model.checkpoint = args.checkpoint
        _compile_blocks(model, args.compile)

        def train_step(batches):
            for idx in batches:
                loss = model(idx, torch.roll(idx, -1, 1))
                (loss / len(batches)).backward()
            model.zero_grad(set_to_none=True)
            return loss, None

        flop_model = model
    elif mode in ("plain", "ddp", "fsdp2", "fsdp2_offload"):
        if world > 1 or mode.startswith("fsdp2"):
            # Offloaded FSDP2 keeps gradients on the CPU: clip_grad_norm_ reduces their norm there (gloo).
            backend = "cpu:gloo,cuda:nccl" if mode == "fsdp2_offload" else "nccl"
            dist.init_process_group(backend, device_id=device)
        with device:
            model = GPT(**preset, seq=SEQ)
        if args.init == "gpt2":
            model.apply(gpt2_init)
        model.checkpoint = args.checkpoint
        _compile_blocks(model, args.compile)
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
        if mode.startswith("fsdp2"):
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            offload = CPUOffloadPolicy(pin_memory=True) if mode == "fsdp2_offload" else OffloadPolicy()
            for block in model.blocks:
                fully_shard(block, mp_policy=mp, offload_policy=offload)
            fully_shard(model, mp_policy=mp, offload_policy=offload)
        # FSDP2's offloaded parameters live on the CPU: its AdamW steps there (fused CPU kernel).
        opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
        autocast = not mode.startswith("fsdp2")

        def train_step(batches):
            for idx in batches:
                with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                    loss = model(idx, torch.roll(idx, -1, 1))
                (loss / len(batches)).backward()
            norm = None
            if args.clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss, norm

        flop_model = model.module if mode == "ddp" else model
    else:
        import zkernel

        partitioner, _, tiers = mode.partition("+")
        tier, _, params_tier = tiers.partition("/")
        if partitioner == "zero3":
            with torch.device("meta"):
                model = GPT(**preset, seq=SEQ)
        else:
            with device:
                model = GPT(**preset, seq=SEQ)
            if args.init == "gpt2":
                model.apply(gpt2_init)
        optimizer = args.zk_optimizer or ("cpu_adam" if tier in ("cpu", "nvme") else "adamw")
        config = {
            "partitioner": partitioner,
            "precision": "bf16",
            "gradient_clipping": args.clip,
            "gradient_accumulation_steps": args.accum,
            "timeline": args.timeline or bool(args.trace),
            "optimizer": {"name": optimizer, "lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "weight_decay": ADAMW["weight_decay"]},
        }
        if args.trace:
            config["timeline_path"] = args.trace
        if args.checkpoint:
            config["activation_checkpointing"] = {"modules": ["Block"]}
        if tier or params_tier:
            config["offload"] = {
                "optimizer": tier or "none",
                "optimizer_options": json.loads(args.tier_options or "{}") if tier not in ("", "none") else {},
                "params": params_tier or "none",
                "params_options": json.loads(args.params_tier_options or "{}") if params_tier not in ("", "none") else {},
            }
            if "nvme" in (tier, params_tier):
                os.makedirs(args.nvme_path, exist_ok=True)
                config["offload"]["nvme_path"] = args.nvme_path
        if args.options:
            config["partitioner_options"] = json.loads(args.options)
        if units:
            config["partitioner_options"] = {**config.get("partitioner_options", {}), "units": units}
        for key, value in overrides.items():
            section, _, name = key.rpartition(".")
            if section == "env":  # set in the mode's environment by _run_mode
                continue
            if section == "cfg":  # a top-level key of the engine's config
                config[name] = value
                continue
            section = {"": "partitioner_options", "opt": "optimizer"}[section]
            config[section] = {**config.get(section, {}), name: value}
        if args.prefetch_mb is not None:
            config["prefetch_bytes"] = int(args.prefetch_mb * 2**20)
        meta_init = gpt2_init if args.init == "gpt2" and partitioner == "zero3" else None
        _compile_blocks(model, args.compile)
        engine = zkernel.initialize(model, config, init_fn=meta_init)

        def train_step(batches):
            return zkernel_train_step(engine, batches), engine.last_grad_norm

        flop_model = model
    fpt = flops_per_token(flop_model, SEQ) if not mode.startswith("zero3") else None
    if fpt is None:  # zero3 parameters are shards now: count from a meta copy
        with torch.device("meta"):
            fpt = flops_per_token(GPT(**preset, seq=SEQ), SEQ)

    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator(device=device).manual_seed(1 + local)
    times, norms, every_step = [], [], []
    disk = _disk_counters(engine) if mode.startswith("zero") else None

    def next_batches():
        if args.data == "random":
            return [torch.randint(0, VOCAB, (micro_batch, SEQ), device=device, generator=g) for _ in range(args.accum)]
        return [learnable_sequences(micro_batch, SEQ, VOCAB, device, g) for _ in range(args.accum)]

    for i in range(args.warmup + args.steps):
        if i == args.warmup and disk is not None:
            disk = _disk_counters(engine)
        batches = next_batches()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, norm = train_step(batches)
        loss.item()
        torch.cuda.synchronize()
        every_step.append(time.perf_counter() - t0)
        if norm is not None:
            norms.append(float(norm))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    kernels = None
    if args.kernels and local == 0:
        sys.path.insert(0, str(HERE))
        from kernel_profile import profile_steps

        trace = None
        if args.kernels_trace:
            trace = os.path.join(args.kernels_trace, re.sub(r"[^A-Za-z0-9._-]", "_", args.mode) + ".json.gz")
        kernels = profile_steps(lambda: train_step(next_batches())[0].item(), args.kernels, torch.cuda.synchronize, trace)
    elif args.kernels:  # the other ranks run the same steps, unprofiled, so collectives match
        for _ in range(args.kernels):
            train_step(next_batches())[0].item()
    if args.host_profile:  # the host's Python work per step, rank 0 under cProfile (the others run alike)
        import cProfile

        profiler = cProfile.Profile() if local == 0 else None
        for _ in range(args.steps):
            if profiler is not None:
                profiler.enable()
            train_step(next_batches())[0].item()
            if profiler is not None:
                profiler.disable()
        if profiler is not None:
            profiler.dump_stats(os.path.join(args.host_profile, re.sub(r"[^A-Za-z0-9._-]", "_", args.mode) + ".pstats"))
    step = statistics.median(times)
    tokens = micro_batch * args.accum * SEQ * world / step
    result = {
        "mode": args.mode,
        "world": world,
        "micro_batch": micro_batch,
        "step_s": step,
        "every_step_s": [round(t, 3) for t in every_step],
        "tokens_per_s": tokens,
        "accum": args.accum,
        "tflops_per_gpu": fpt * micro_batch * args.accum * SEQ / step / 1e12,
        "peak_gib": (torch.cuda.max_memory_allocated() + _symmetric_bytes()) / 2**30,
        # Times the caching allocator freed its cache and retried a cudaMalloc: each one synchronizes
        # the device, so a run near the memory limit is slower than its kernels.
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
        "loss": float(loss),
    }
    if kernels is not None:
        result["kernels"] = kernels
    if norms:
        timed = norms[args.warmup :]
        result["clipped_steps"] = sum(n > args.clip for n in timed)
        result["grad_norm_median"] = statistics.median(timed)
        result["grad_norms"] = [round(n, 3) for n in norms]
    if mode.startswith("zero"):
        report = engine.memory_report()
        result["host_gib"] = sum(report[c].get("cpu", 0) for c in report) / 2**30
        result["nvme_gib"] = sum(report[c].get("nvme", 0) for c in report) / 2**30
        moved = [b - a for a, b in zip(disk, _disk_counters(engine))]
        if any(moved):
            result["disk_read_gb_per_step"] = moved[0] / args.steps / 1e9
            result["disk_written_gb_per_step"] = moved[1] / args.steps / 1e9
            result["disk_gbps_over_step"] = (moved[0] + moved[1]) / args.steps / step / 1e9
        summaries = engine.timeline.summaries
        if summaries:
            result["timeline"] = summaries[-1].log_fields()
        result["early_steps"] = engine.pipeline.early_steps
        result["rollbacks"] = engine.pipeline.rollbacks
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if mode.startswith("zero"):
        engine.close()  # writes the timeline's Chrome trace when ``timeline_path`` is set
    if dist.is_initialized():
        dist.destroy_process_group()


def _compile_blocks(model, compile_: bool) -> None:
    """With ``--compile``: each Block compiled in place (``Block.compile()``), before any engine wraps it,
    as FSDP2's users compile theirs; zero3's hooks then run between the compiled graphs."""
    if compile_:
        for block in model.blocks:
            block.compile()


def _symmetric_bytes() -> int:
    """zero3's peer-gather pool: symmetric memory, outside the caching allocator's peak."""
    try:
        from zkernel_plugins.partitioners import _peer_gather
    except ImportError:
        return 0
    return _peer_gather.pool_bytes


def _parse_mode(text: str, default_micro_batch: int) -> tuple[str, int, str, dict]:
    """``zero3+cpu/cpu@blocks#32~peer_gathers=never~opt.implementation=fused`` ->
    ("zero3+cpu/cpu", 32, "blocks", {...}): ``@`` a zero3 unit policy, ``#`` a micro-batch, each
    ``~key=value`` a partitioner option (``opt.key``: an optimizer option; ``cfg.key``: a top-level
    config key; ``env.NAME``: an environment variable of the mode's processes) for this mode alone."""
    text, *pairs = text.split("~")
    text, _, micro_batch = text.partition("#")
    mode, _, units = text.partition("@")
    overrides = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return mode, int(micro_batch) if micro_batch else default_micro_batch, units, overrides


def _disk_counters(engine) -> list[int]:
    """Bytes the engine's NVMe tiers have read and written so far (both roles)."""
    tiers = {id(t): t for t in (engine.optimizer_tier, engine.params_tier)}.values()
    return [sum(getattr(t, name, 0) for t in tiers) for name in ("bytes_read", "bytes_written")]


def _run_mode(args, mode: str) -> dict:
    cmd = [sys.executable]
    if args.nproc > 1 or mode.startswith("fsdp2"):
        cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--master_port=29533"]
    cmd += [__file__, "--worker", "--mode", mode, "--model", args.model, "--micro-batch", str(args.micro_batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--accum", str(args.accum), "--options", args.options,
            "--clip", str(args.clip), "--data", args.data, "--init", args.init, "--tier-options", args.tier_options,
            "--params-tier-options", args.params_tier_options, "--nvme-path", args.nvme_path]
    if args.zk_optimizer:
        cmd += ["--zk-optimizer", args.zk_optimizer]
    if args.timeline:
        cmd += ["--timeline"]
    if args.trace:
        cmd += ["--trace", args.trace]
    if args.checkpoint:
        cmd += ["--checkpoint"]
    if args.compile:
        cmd += ["--compile"]
    if args.prefetch_mb is not None:
        cmd += ["--prefetch-mb", str(args.prefetch_mb)]
    if args.kernels:
        cmd += ["--kernels", str(args.kernels)]
    if args.kernels_trace:
        cmd += ["--kernels-trace", args.kernels_trace]
    if args.host_profile:
        cmd += ["--host-profile", args.host_profile]
    # torchrun would pin every rank to one OpenMP thread: give each its share of the cores
    # instead, so the anchors' CPU AdamW (FSDP2 offload) is not starved.
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // args.nproc)))
    for key, value in _parse_mode(mode, args.micro_batch)[3].items():
        if key.startswith("env."):  # ``~env.NCCL_MAX_CTAS=8``: an environment variable of this mode alone
            env[key[4:]] = str(value)
    # In a session of its own, so a timeout kills torchrun's workers too: an orphaned worker
    # would keep its GPU and host memory from every later mode.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        print(f"[{mode}] did not finish in --timeout {args.timeout:g} s", flush=True)
        return {"mode": mode, "error": "timeout"}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    lines = (stdout + stderr).strip().splitlines()
    tail = [t for t in lines if "Error" in t][:3] + lines[-4:]
    oom = any("OutOfMemory" in t or "out of memory" in t for t in tail)
    print(f"[{mode}] {'OOM' if oom else 'failed'} (exit {proc.returncode}): " + " | ".join(tail)[-600:], flush=True)
    return {"mode": mode, "error": "OOM" if oom else f"exit {proc.returncode}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.3b")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step, in every mode")
    parser.add_argument("--modes", default=None, help="comma list of ceiling, plain, ddp, fsdp2, fsdp2_offload, zero1, zero2, zero3 "
                        "(zkernel: +optimizer_tier[/params_tier], @units, #micro_batch, ~option=value; see above)")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--options", default="", help="zkernel partitioner_options as JSON, e.g. '{\"units\": \"blocks\"}'")
    parser.add_argument("--prefetch-mb", type=float, default=None, help="zkernel prefetch_bytes in MiB")
    parser.add_argument("--clip", type=float, default=0.0, help="global-norm gradient clipping in every mode (0 = off)")
    parser.add_argument("--data", default="random", choices=("random", "learnable"),
                        help="uniform random tokens (the anchors') or sequences the model learns (see above)")
    parser.add_argument("--init", default="default", choices=("default", "gpt2"),
                        help="the modules' default initialisation (the anchors') or GPT-2's (see above)")
    parser.add_argument("--zk-optimizer", default=None, help="zkernel optimizer (default: cpu_adam when offloaded, else adamw)")
    parser.add_argument("--tier-options", default="", help="offload.optimizer_options as JSON")
    parser.add_argument("--params-tier-options", default="", help="offload.params_options as JSON")
    parser.add_argument("--nvme-path", default="/tmp/zkernel-nvme", help="offload.nvme_path for +nvme modes")
    parser.add_argument("--checkpoint", action="store_true",
                        help="recompute every Block in backward, in every mode (torch's checkpoint; zkernel's activation_checkpointing)")
    parser.add_argument("--compile", action="store_true",
                        help="compile every Block in place with torch.compile (default backend), in every mode")
    parser.add_argument("--trace", default=None, help="zkernel modes: write the timeline's Chrome trace here ({rank} is replaced)")
    parser.add_argument("--timeline", action="store_true", help="zkernel modes: record the step timeline and print its last step")
    parser.add_argument("--kernels", type=int, default=0,
                        help="after the timed steps, profile this many more on rank 0 and print where the GPU time went "
                        "(kernel categories, stream busy and idle; bench/kernel_profile.py)")
    parser.add_argument("--kernels-trace", default=None, help="with --kernels: a directory for rank 0's Chrome trace of each mode (gzipped)")
    parser.add_argument("--host-profile", default=None, help="a directory for rank 0's cProfile statistics of --steps more steps per mode")
    parser.add_argument("--json-out", default=None, help="append each mode's result as one JSON line to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    modes = args.modes.split(",") if args.modes else (
        ["plain", "fsdp2", "zero1", "zero2", "zero3"] if args.nproc == 1 else ["ddp", "fsdp2", "zero1", "zero2", "zero3"]
    )
    results = []
    for mode in modes:  # each result is kept as it comes, so a later failure loses none
        results.append(_run_mode(args, mode))
        if args.json_out:
            with open(args.json_out, "a") as out:
                out.write(json.dumps({"model": args.model, "nproc": args.nproc, **results[-1]}) + "\n")
    sys.path.insert(0, str(HERE))
    from kernel_profile import format_summary

    def first(*names):
        return next((r for r in results if _parse_mode(r["mode"], 0)[0] in names and "error" not in r), None)

    anchor = first("fsdp2")
    extra = f", zkernel options {args.options}" if args.options else ""
    extra += f", prefetch {args.prefetch_mb} MiB" if args.prefetch_mb is not None else ""
    extra += f", clipping {args.clip:g}" if args.clip > 0 else ""
    extra += f", {args.accum} micro-batches per step" if args.accum > 1 else ""
    extra += ", every block recomputed" if args.checkpoint else ""
    extra += ", every block compiled" if args.compile else ""
    print(f"\nGPT-{args.model}, seq {SEQ}, micro-batch {args.micro_batch} per rank, {args.nproc} GPU(s), bf16, "
          f"{args.data} data, {args.init} init{extra}")
    print(f"{'mode':22} {'mb':>3} {'tokens/s':>10} {'tok/s/GPU':>10} {'TFLOP/s/GPU':>12} {'peak GiB':>9} {'step s':>7} {'tok/s vs FSDP2':>15} {'mem vs FSDP2':>13} {'vs plain':>9} {'vs FSDP2+off':>13}")
    plain = first("plain", "ddp")
    offload = first("fsdp2_offload")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:22} {r['error']:>10}")
            continue
        ratio = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.3f}" if anchor else "-"
        mem = f"{r['peak_gib'] / anchor['peak_gib']:.3f}" if anchor else "-"
        vs_plain = f"{r['tokens_per_s'] / plain['tokens_per_s']:.3f}" if plain else "-"
        vs_off = f"{r['tokens_per_s'] / offload['tokens_per_s']:.3f}" if offload else "-"
        print(f"{r['mode']:22} {r['micro_batch']:>3} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / r['world']:>10.0f} {r['tflops_per_gpu']:>12.1f} {r['peak_gib']:>9.1f} {r['step_s']:>7.3f} {ratio:>15} {mem:>13} {vs_plain:>9} {vs_off:>13}")
    for r in results:
        if "clipped_steps" in r:
            print(f"  {r['mode']}: {r['clipped_steps']} of {args.steps} timed steps clipped "
                  f"(median gradient norm {r['grad_norm_median']:.3f}), last loss {r['loss']:.3f}")
        if "disk_gbps_over_step" in r:
            print(f"  {r['mode']} disk: {r['nvme_gib']:.1f} GiB on NVMe, per step {r['disk_read_gb_per_step']:.2f} GB read + "
                  f"{r['disk_written_gb_per_step']:.2f} GB written = {r['disk_gbps_over_step']:.2f} GB/s over the whole step")
        if "kernels" in r:
            print(format_summary(r["mode"], r["kernels"]))
        if "timeline" in r:
            print(f"  {r['mode']} host {r['host_gib']:.1f} GiB, early steps {r['early_steps']}, rollbacks {r['rollbacks']}: {r['timeline']}")


if __name__ == "__main__":
    main()
