"""Per-rank training runs used by the distributed tests (executed inside spawned processes)."""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist

import zkernel
from tests.support.models import TrickyNet, batches, weight_penalty


def _world_rank():
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _train_steps(engine, steps, accum, micro, seed, penalty=None, after_step=None) -> list[float]:
    """This rank's share of each global batch through ``engine``; global mean loss per step."""
    world, rank = _world_rank()
    losses = []
    for step in batches(seed + 1, steps, accum, world, micro):
        total = torch.zeros((), device=engine.device)
        for micro_batch in step:
            tokens, targets = micro_batch[rank]
            loss = engine(tokens, targets)
            if penalty is not None:
                loss = loss + penalty(engine.module)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / accum
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
        if after_step is not None:
            after_step()
    return losses


def train(config: dict, steps: int, accum: int, micro: int, seed: int, plugins=()) -> dict:
    """Train TrickyNet through zkernel on this rank's share; return global mean losses per step."""
    torch.manual_seed(seed)
    engine = zkernel.initialize(TrickyNet(), config, plugins=plugins)
    losses = _train_steps(engine, steps, accum, micro, seed)
    external = sorted(g.name for g in engine.groups if g.index in engine.scheduler.external)
    return {
        "losses": losses,
        "memory": engine.memory_report(),
        "skipped": engine.skipped_steps,
        "external": external,
        "peer_gathers": getattr(engine.plugin_manager.get_plugin(f"partitioner:{engine.config.partitioner}"), "_peer", None) is not None,
        "peer_reductions": getattr(engine.plugin_manager.get_plugin(f"partitioner:{engine.config.partitioner}"), "_peer_reduce", None) is not None,
    }


def train_many(configs: list[dict], steps: int, accum: int, micro: int, seed: int) -> list[dict]:
    return [train(c, steps, accum, micro, seed) for c in configs]


class Wide(torch.nn.Module):
    """Stack of square Linear layers with reset_parameters on each (for meta construction)."""

    def __init__(self, width: int, depth: int, device=None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, device=device) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


LIVE_EXTRAS = 16 * 1024  # bytes of small tensors alive beside what memory_report counts (buffers, step counters)


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python right now."""
    import gc
    import warnings

    gc.collect()  # engines of earlier runs in this process are cycles awaiting collection
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
    for obj in objects:
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta:
                continue
        except Exception:  # noqa: BLE001 - some gc objects fail isinstance checks
            continue
        storage = obj.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def memory_by_stage(stage: str, width: int, depth: int, prefetch_bytes: int | None = None) -> dict:
    """Memory report of one step of Wide under ``stage``, plus the element count."""
    torch.manual_seed(0)
    model = Wide(width, depth)
    numel = sum(p.numel() for p in model.parameters())
    cfg = {"partitioner": stage, "optimizer": {"lr": 1e-3}}
    if prefetch_bytes is not None:
        cfg["prefetch_bytes"] = prefetch_bytes
    if stage == "zero3":
        cfg["partitioner_options"] = {"persistence_threshold": 0}
    else:
        cfg["partitioner_options"] = {"bucket_size": width * width + width}
    engine = zkernel.initialize(model, cfg)
    loss = engine(torch.randn(4, width))
    engine.backward(loss)
    after_backward = engine.memory_report()
    del loss
    engine.step()
    memory = engine.memory_report()
    reported = sum(sum(place.values()) for place in memory.values())
    # A gloo worker thread drops its reference to a finished collective's tensors a moment
    # after the waiter returned: the lowest of a few readings is what the engine holds (a reading
    # within the extras the test allows needs no other).
    alive = [live_tensor_bytes()]
    while len(alive) < 4 and alive[-1] > reported + LIVE_EXTRAS:
        time.sleep(0.1)
        alive.append(live_tensor_bytes())
    return {"numel": numel, "backward": after_backward, "memory": memory, "alive": min(alive)}


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


PARTITIONED_PREFETCH_BYTES = 16 * 2**20


def partitioned_construction(width: int, depth: int, steps: int) -> dict:
    """Build Wide on the meta device, let zero3 materialise it shard by shard, train; report peak RSS growth."""
    # Warm-up: imports, plugin loading, the process group and one-time kernel set-up
    # (the first in-place init allocates ~40 MB of runtime state) are not what is measured.
    with torch.device("meta"):
        warm = Wide(8, 1)
    zkernel.initialize(warm, {"partitioner": "zero3"})
    before = _rss_bytes()
    with torch.device("meta"):
        model = Wide(width, depth)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    engine = zkernel.initialize(
        model,
        {
            "partitioner": "zero3",
            "optimizer": {"lr": 1e-3},
            "partitioner_options": {"persistence_threshold": 0},
            "prefetch_bytes": PARTITIONED_PREFETCH_BYTES,
        },
    )
    after_init = _rss_bytes()
    held = sum(sum(v.values()) for v in engine.memory_report().values())
    g = torch.Generator().manual_seed(5 + _world_rank()[1])
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, width, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "full_bytes": full_bytes,
        "init_growth": after_init - before,
        "held_bytes": held,
        "train_growth": _rss_bytes() - before,
        "losses": losses,
        "memory": engine.memory_report(),
    }


def fp16_overflow(inject_rank: int, inject_step: int, steps: int, extra: dict | None = None, where: str = "loss") -> dict:
    """fp16 run where one rank's loss (or, ``where="embed"``, only the embedding's gradient, which
    lands last) becomes inf at one step: every rank must skip it."""
    torch.manual_seed(0)
    config = {"partitioner": "zero2", "precision": "fp16", "optimizer": {"lr": 1e-3}, "initial_loss_scale": 1024.0}
    engine = zkernel.initialize(TrickyNet(), {**config, **(extra or {})})
    world, rank = _world_rank()
    scales, checksums = [], []
    poison = {"on": False}
    engine.module.embed.weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    for i, step in enumerate(batches(11, steps, 1, world, 2)):
        tokens, targets = step[0][rank]
        loss = engine(tokens, targets)
        injected = i == inject_step and rank == inject_rank
        poison["on"] = injected and where == "embed"
        if injected and where == "loss":
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        scales.append(engine.loss_scaler.scale)
        checksums.append(float(sum(g.master.double().sum() for g in engine.trainable_groups)))
    return {"scales": scales, "checksums": checksums, "skipped": engine.skipped_steps, "rollbacks": engine.pipeline.rollbacks,
            "early_steps": engine.pipeline.early_steps, "aborted": engine.pipeline.aborted_speculations}


def user_access(config: dict, steps: int, accum: int, micro: int, seed: int) -> dict:
    """User code reads parameters between forward and backward, and between steps."""
    torch.manual_seed(seed)
    engine = zkernel.initialize(TrickyNet(), config)
    model = engine.module
    released_sizes = []
    losses = _train_steps(
        engine, steps, accum, micro, seed, penalty=weight_penalty,
        after_step=lambda: released_sizes.append(model.block[0].weight.numel()),
    )
    with engine.gathered_parameters():
        values = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        kept = model.block[2].weight.detach()
    after = {"kept": kept.float().cpu().clone(), "released": model.block[2].weight.numel()}
    return {"losses": losses, "values": values, "released_sizes": released_sizes, **after}


def user_program(debug: bool) -> None:
    """A user's training program, as written by someone who never heard of structlog.

    With ``debug`` it asks for everything with ``logging.basicConfig(level=DEBUG)``;
    without, it configures no logging at all and zkernel must print nothing.
    """
    import logging

    if debug:
        logging.basicConfig(level=logging.DEBUG)
    torch.manual_seed(0)
    # fp16 with a loss scale so large that the first step overflows: the engine logs the skip
    # inside the step's structlog context (rank, step).
    cfg = {"partitioner": "zero2", "precision": "fp16", "initial_loss_scale": 2.0**40, "optimizer": {"lr": 1e-3}}
    engine = zkernel.initialize(TrickyNet(), cfg)
    _train_steps(engine, steps=2, accum=1, micro=2, seed=3)


def small_gpt():
    """The demo GPT, small: the model of the estimator's accuracy test (tests/sizing/test_estimator.py)."""
    from zkernel.cli.demo.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=65, seq_len=32, d_model=64, n_layers=2, n_heads=4))


def memory_after_step(model_name: str, configs: list[dict]) -> list[dict]:
    """For each config: memory_report after every backward of one accumulation window, and after the step."""
    world, rank = _world_rank()
    out = []
    for cfg in configs:
        torch.manual_seed(0)
        engine = zkernel.initialize(small_gpt() if model_name == "gpt" else TrickyNet(), cfg)
        g = torch.Generator().manual_seed(rank)
        backward = []
        for _ in range(engine.config.gradient_accumulation_steps):
            if model_name == "gpt":
                idx = torch.randint(0, 65, (2, 32), generator=g)
                loss = engine(idx, idx)
            else:
                tokens = torch.randint(0, 29, (2, 6), generator=g)
                loss = engine(tokens, tokens)
            engine.backward(loss)
            backward.append(engine.memory_report())
            engine.step()
        out.append({"backward": backward, "step": engine.memory_report()})
        engine.close()
    return out


def train_with_pipeline_stats(config: dict, steps: int, accum: int, micro: int, seed: int) -> dict:
    """`train`, plus how many host steps started during backward and how many were rolled back, and
    how many host groups still held a window's gradient once a step's jobs were done (its window not
    ended: the next window's first landing would add to it where it adds up on the GPU)."""
    torch.manual_seed(seed)
    engine = zkernel.initialize(TrickyNet(), config)
    pipeline = engine.pipeline
    left_open = []

    def windows_left_open():
        pipeline.wait_all()
        left_open.append(sum(g.grad is not None for g in pipeline.trainable if pipeline.tier.steps_on_host(g)))

    losses = _train_steps(engine, steps, accum, micro, seed, after_step=windows_left_open)
    return {
        "losses": losses,
        "windows_left_open": left_open,
        "early_steps": pipeline.early_steps,
        "rollbacks": pipeline.rollbacks,
        "aborted": pipeline.aborted_speculations,
        "groups": len(engine.trainable_groups),
    }


def peer_pool_where_it_cannot_map() -> dict:
    """Open zero3's peer-gather pool where symmetric memory is unavailable (the CPU): under
    "auto" every rank agrees to gather with NCCL instead; under "always" each rank raises."""
    from zkernel.telemetry.timeline import Timeline
    from zkernel_plugins.partitioners._peer_gather import open_pool

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    off = Timeline(cpu, enabled=False)
    fallback = open_pool(16, torch.bfloat16, cpu, required=False, timeline=off)
    try:
        open_pool(16, torch.bfloat16, cpu, required=True, timeline=off)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"fallback": fallback, "error": error}
