"""Runs for the split-master tests: the same training with masters kept whole and kept split, per rank."""

from __future__ import annotations

import os
import time

import torch

import zkernel
from tests.support.models import TrickyNet, batches

ACCUM, MICRO, STEPS = 2, 2, 4


def config(tier: str, stage: str, split, nvme_path: str, clip: float = 0.05, **tier_options) -> dict:
    """bf16 TrickyNet with accumulation and a clip that applies: ``tier`` "cpu" or "nvme" (its host
    share and the rest given by ``tier_options``), masters split as ``split`` asks."""
    options = {"gpu_share": 0.0, "split_master": split, **tier_options}  # (a test may give a GPU share)
    if tier == "nvme":
        options["aio_threads"] = 2
    cfg = {
        "partitioner": stage,
        "precision": "bf16",
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": clip,  # 0.05: below every window's norm (1.5-3.4), each step clips
        "optimizer": {"name": "cpu_adam", "lr": 1e-2, "weight_decay": 0.1},
        "offload": {"optimizer": tier, "optimizer_options": options},
        "partitioner_options": {"persistence_threshold": 0} if stage == "zero3" else {"bucket_size": 300},
    }
    if tier == "nvme":
        cfg["offload"]["nvme_path"] = nvme_path
    return cfg


def _train(engine, start: int, count: int, settle_early: bool = False) -> list[float]:
    """``settle_early``: before each step, wait for the steps taken during backward, so that which groups
    step early (and are rolled back) does not depend on how far the host worker lags the GPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    losses = []
    for step in batches(11, start + count, ACCUM, world, MICRO)[start:]:
        total = 0.0
        for micro in step:
            tokens, targets = micro[rank]
            loss = engine(tokens, targets)
            engine.backward(loss)
            if settle_early:
                for job, _ in list(engine.pipeline._early.values()):
                    job.result()
            engine.step()
            total += loss.item() / ACCUM
        losses.append(total)
    return losses


def _slow_clip_check(pipeline) -> None:
    """The host worker learns that a window clips only after every group's early step was queued, as on a
    GPU, where backward runs ahead of the host worker (here it would keep up and queue one)."""
    check = pipeline._will_clip_or_skip

    def slow(group, unscale):
        time.sleep(0.2)
        return check(group, unscale)

    pipeline._will_clip_or_skip = slow


def run(cfg: dict, *, save: str | None = None, load: str | None = None, slow_check: bool = False,
        settle_early: bool = False) -> dict:
    """STEPS steps (the last two after a reload when ``load``); losses, closed parameters, master bytes
    (``settle_early``: see `_train`)."""
    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, cfg)
    if slow_check:
        _slow_clip_check(engine.pipeline)
    if load is not None:
        engine.load_checkpoint(load)
        losses = _train(engine, STEPS // 2, STEPS - STEPS // 2, settle_early)
    else:
        losses = _train(engine, 0, STEPS // 2, settle_early)
        if save is not None:
            engine.save_checkpoint(save)
        losses += _train(engine, STEPS // 2, STEPS - STEPS // 2, settle_early)
    report = engine.memory_report()
    trainable = sum(g.shard_layout.numel for g in engine.pipeline.trainable)  # shard elements, padding included
    pipeline = engine.pipeline
    out = {
        "losses": losses,
        "master_bytes": sum(report["master_weights"].values()),
        "trainable": trainable,
        "rollbacks": pipeline.rollbacks,
        "early_steps": pipeline.early_steps,
        "split_numel": engine.optimizer_tier.split_master_numel,
        "split_buffers": engine.optimizer_tier.split_master_buffers,
        "master_on_disk": report["master_weights"].get("nvme", 0),  # bytes of masters in swap files
    }
    engine.close()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def whole_and_split(root: str) -> dict:
    """Each case trained with masters whole and split (and a checkpoint crossing from one to the other)."""
    rank = int(os.environ["RANK"])
    cases = {
        "zero1-cpu": ("cpu", "zero1", {}),
        "zero2-cpu": ("cpu", "zero2", {}),
        "zero3-cpu": ("cpu", "zero3", {}),
        "zero3-cpu-unclipped": ("cpu", "zero3", {"clip": 0.0}),
        "zero3-nvme-host": ("nvme", "zero3", {"host_share": 1.0}),
        "zero3-nvme-half": ("nvme", "zero3", {"host_share": 0.5}),  # "auto": the swap files keep whole masters
        "zero3-nvme-half-disk": ("nvme", "zero3", {"host_share": 0.5, "split": True}),  # true: split there too
        # Clipping 2.0: groups' own norms stay below it, so they step during backward, and three of the
        # four windows' norms pass it, so those steps are rolled back and taken again.
        "zero3-cpu-speculative": ("cpu", "zero3", {"speculate": "always", "clip": 2.0}),
        # Clipping 0.05: the first group's own norm shows the window clips; the rest wait for the step.
        "zero3-cpu-speculation-stopped": ("cpu", "zero3", {"speculate": "always"}),
    }
    out = {}
    for name, (tier, stage, options) in cases.items():
        wish = options.pop("split", True if tier == "cpu" else "auto")
        nvme = f"{root}/{name}-nvme-{rank}"
        os.makedirs(nvme, exist_ok=True)
        slow = name.endswith("stopped")
        whole = run(config(tier, stage, False, nvme, **options), slow_check=slow)
        split = run(config(tier, stage, wish, nvme, **options),
                    save=f"{root}/{name}-ckpt", slow_check=slow)
        out[name] = {"whole": whole, "split": split}
    # A checkpoint written with split masters resumes an engine keeping them whole, and the other way.
    out["split->whole"] = run(config("cpu", "zero3", False, ""), load=f"{root}/zero3-cpu-ckpt")
    out["nvme split->cpu whole"] = run(config("cpu", "zero3", False, ""), load=f"{root}/zero3-nvme-half-ckpt")
    torch.distributed.barrier()
    return out if rank == 0 else {"rank": rank}


def on_gpu(root: str) -> dict:
    """One rank on a GPU: the GPU share's masters split on the GPU, the host groups' rebuilt from
    shards downloaded from it, against the same runs with whole masters."""
    out = {}
    for name, (tier, options) in {
        "cpu-share": ("cpu", {"gpu_share": 0.5}),
        "cpu-host": ("cpu", {"gpu_share": 0.0}),
        "cpu-host-speculative": ("cpu", {"gpu_share": 0.0, "speculate": "always", "clip": 2.0}),
        "nvme-auto-share": ("nvme", {"gpu_share": "auto", "host_share": 0.5}),
    }.items():
        nvme = f"{root}/{name}-nvme"
        os.makedirs(nvme, exist_ok=True)
        # Speculative: every early step settled before its window's step, as on the CPU (see `_train`).
        settle = "speculate" in options
        out[name] = {
            "whole": run(config(tier, "zero3", False, nvme, **options), settle_early=settle),
            "split": run(config(tier, "zero3", True, nvme, **options), save=f"{root}/{name}-ckpt", settle_early=settle),
        }
    out["resumed"] = run(config("cpu", "zero3", False, ""), load=f"{root}/cpu-share-ckpt")
    # The speculative case's oracle: the same run with no step taken during backward.
    out["cpu-host-unspeculated"] = run(config("cpu", "zero3", False, f"{root}/never", gpu_share=0.0, speculate="never", clip=2.0))
    return out
