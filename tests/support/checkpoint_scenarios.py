"""Per-rank runs of the checkpoint tests (executed in spawned processes, or in-process at world 1)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.models import VOCAB, TrickyNet, batches
from zkernel.spec import hookimpl
from zkernel_plugins.offload_tiers.device import DeviceOptimizerTier


class DropNet(TrickyNet):
    """TrickyNet with dropout: a resumed run matches only if every rank's RNG state came back."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(tokens))
        h = h + self.block(h)
        h = h + self.block(h)
        h = self.frozen_proj(self.norm(h)) * self.gain + self.shift
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


MODELS = {"tricky": TrickyNet, "drop": DropNet}


def world_rank() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def run_steps(engine, data, accum: int) -> list[float]:
    """This rank's share of each global batch in ``data``; the global mean loss per step."""
    world, rank = world_rank()
    losses = []
    for step in data:
        total = torch.zeros(())
        for micro_batch in step:
            tokens, targets = micro_batch[rank]
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu() / accum
        if world > 1:  # on the engine's device: NCCL has no CPU tensors
            total = total.to(engine.device)
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def train_and_save(model: str, config: dict, directory: str, steps: int, save_at: int, accum: int, micro: int,
                   seed: int) -> dict:  # fmt: skip
    """Train ``steps`` steps, saving after ``save_at``; return every step's loss (the uninterrupted run)."""
    torch.manual_seed(seed)
    engine = zkernel.initialize(MODELS[model](), config)
    world, _ = world_rank()
    data = batches(seed + 1, steps, accum, world, micro)
    losses = run_steps(engine, data[:save_at], accum)
    engine.save_checkpoint(directory)
    losses += run_steps(engine, data[save_at:], accum)
    engine.close()
    return {"losses": losses}


def resume(model: str, config: dict, directory: str, steps: int, save_at: int, accum: int, micro: int,
           seed: int) -> dict:  # fmt: skip
    """A fresh model (other initial values), loaded from ``directory``, trained from ``save_at`` on."""
    torch.manual_seed(seed + 1000)
    engine = zkernel.initialize(MODELS[model](), config)
    world, _ = world_rank()
    tag = engine.load_checkpoint(directory).tag
    counters = (engine.global_steps, engine.micro_steps)
    losses = run_steps(engine, batches(seed + 1, steps, accum, world, micro)[save_at:], accum)
    engine.close()
    return {"losses": losses, "tag": tag, "counters": counters}


def released_reads(config: dict, steps: int, accum: int, micro: int, seed: int) -> dict:
    """zero3 between steps: what reads of released parameters do, and the engine's state dict."""
    from zkernel.params.released import ReleasedParameterError

    torch.manual_seed(seed)
    engine = zkernel.initialize(TrickyNet(), config)
    world, _ = world_rank()
    run_steps(engine, batches(seed + 1, steps, accum, world, micro), accum)
    errors = {}
    for what, read in (
        ("module.state_dict", lambda: engine.module.state_dict()),
        ("norm", lambda: engine.module.block[0].weight.norm()),
        ("data", lambda: engine.module.block[0].weight.data),
        ("torch.save", lambda: torch.save(engine.module.state_dict(), os.devnull)),
    ):
        try:
            read()
            errors[what] = None
        except ReleasedParameterError as exc:
            errors[what] = str(exc)
    full = engine.state_dict()
    engine.close()
    return {
        "errors": errors,
        "state_dict": {k: v.clone() for k, v in full.items()},
        "dtypes": {k: str(v.dtype) for k, v in full.items()},
        "closed_norm": float(engine.module.block[0].weight.norm()),
    }


def failed_load(config: dict, directory: str) -> str:
    """Load a damaged checkpoint: every rank must raise (none may wait for the others)."""
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), config)
    try:
        engine.load_checkpoint(directory)
    except zkernel.CheckpointError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"


def save_to_per_rank_directories(config: dict, root: str) -> str:
    """Each rank passes its own directory to `save_checkpoint` (a per-node path on a non-shared disk)."""
    _, rank = world_rank()
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), config)
    try:
        engine.save_checkpoint(os.path.join(root, f"mine{rank}"))
    except zkernel.CheckpointError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"


def load_weights(
    config: dict, weights: dict, steps: int, accum: int, micro: int, seed: int, from_rank0: bool = False,
    on_meta: bool = False,
) -> dict:  # fmt: skip
    """A fresh model (other values) given ``weights`` by `Engine.load_state_dict` in two halves (strict=False),
    then trained ``steps`` steps: its state dict right after, the losses, and what a bad dict does. With
    ``from_rank0`` only rank 0 passes the dicts (``broadcast_from_rank0``); the others pass {}. ``on_meta``
    builds the model on the meta device with an initialiser that writes nothing, so the layers have their own
    reset_parameters() values and the root's parameter and persistent buffer (the root has none) wait for the
    load ([Note: values left unset]): what a forward between the halves raised, else None."""
    torch.manual_seed(seed + 2000)
    if on_meta:
        with torch.device("meta"):
            model = TrickyNet()
        engine = zkernel.initialize(model, config, init_fn=lambda m: None)
    else:
        engine = zkernel.initialize(TrickyNet(), config)
    keys = list(weights)
    _, rank = world_rank()

    def load(state_dict: dict, strict: bool = True):
        if not from_rank0:
            return engine.load_state_dict(state_dict, strict=strict)
        return engine.load_state_dict(state_dict if rank == 0 else {}, strict=strict, broadcast_from_rank0=True)

    first = load({k: weights[k] for k in keys[::2]}, strict=False)
    between = None
    if on_meta:
        try:
            engine(*batches(seed, 1, 1, 1, micro)[0][0][0])
        except ValueError as exc:
            between = str(exc)
    second = load({k: weights[k] for k in keys[1::2]}, strict=False)
    loaded = {k: v.clone() for k, v in engine.state_dict().items()}
    only = engine.state_dict(rank0_only=True)  # the whole dict on rank 0, {} elsewhere
    trainable = engine.state_dict(rank0_only=True, exclude_frozen_parameters=True)  # ... without frozen_proj
    errors = []
    for bad in (
        {**weights, "block.0.weight": weights["block.0.weight"][:, :-1]},  # a wrong shape
        {**weights, "blocks.9.weight": weights["block.0.weight"]},  # an unexpected key, strict
        {k: v for k, v in weights.items() if k != "gain"},  # a missing key, strict
    ):
        try:
            load({k: v * 0 for k, v in bad.items()})
            errors.append(None)
        except RuntimeError as exc:
            errors.append(str(exc))
    unchanged = all(torch.equal(v, loaded[k]) for k, v in engine.state_dict().items())
    world, _ = world_rank()
    losses = run_steps(engine, batches(seed + 1, steps, accum, world, micro), accum)
    engine.close()
    return {"first": tuple(map(sorted, first)), "second": tuple(map(sorted, second)), "loaded": loaded,
            "errors": errors, "unchanged": unchanged, "losses": losses, "rank0_only": only,
            "trainable_only": trainable, "between": between}  # fmt: skip


def load_options(config: dict, directory: str, steps: int, save_at: int, accum: int, micro: int, seed: int) -> dict:
    """Train ``save_at`` steps and save with a client state (each rank its own; rank 0's is kept), then load
    the checkpoint into fresh engines with ``load_module_only`` and ``load_optimizer_states=False`` and train
    each from there; also what a module-only load leaves of an engine's own optimizer state and counters."""
    torch.manual_seed(seed)
    engine = zkernel.initialize(TrickyNet(), config)
    world, rank = world_rank()  # the process group starts at initialize
    data = batches(seed + 1, steps, accum, world, micro)
    run_steps(engine, data[:save_at], accum)
    saved_weights = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.save_checkpoint(directory, client_state={"epoch": 7, "rank": rank, "seen": torch.arange(3) * (rank + 1),
                                                    "nested": {"best": 0.5, "names": ["a", "b"]}})  # fmt: skip
    engine.close()
    out: dict = {"saved_weights": saved_weights}
    for name, options in (("module_only", {"load_module_only": True}), ("no_optimizer", {"load_optimizer_states": False})):
        torch.manual_seed(seed + 3000)
        fresh = zkernel.initialize(TrickyNet(), config)
        loaded = fresh.load_checkpoint(directory, **options)
        out[name] = {
            "tag": loaded.tag,
            "path": str(loaded.path),
            "client_state": loaded.client_state,
            "counters": (fresh.global_steps, fresh.micro_steps),
            "weights": {k: v.clone() for k, v in fresh.state_dict().items()},
            "losses": run_steps(fresh, data[save_at:], accum),
        }
        fresh.close()
    # An engine that has stepped keeps its moments and counters through a module-only load.
    torch.manual_seed(seed + 4000)
    stepped = zkernel.initialize(TrickyNet(), config)
    run_steps(stepped, data[:1], accum)
    before = [{k: v.clone() for k, v in stepped.optimizer_tier.read_state(g).state.items()} for g in stepped.trainable_groups]
    stepped.load_checkpoint(directory, load_module_only=True)
    after = [stepped.optimizer_tier.read_state(g).state for g in stepped.trainable_groups]
    out["kept_state"] = all(torch.equal(b[k], a[k]) for b, a in zip(before, after) for k in b) and len(before) > 0
    out["kept_counters"] = (stepped.global_steps, stepped.micro_steps)
    out["kept_weights_loaded"] = all(torch.equal(v, saved_weights[k]) for k, v in stepped.state_dict().items())
    stepped.close()
    return out


def frozen_left_out(config: dict, directory: str, steps: int, save_at: int, accum: int, micro: int, seed: int) -> dict:
    """Save with ``exclude_frozen_parameters`` after ``save_at`` steps, then load into engines over the same
    frozen base (resumes), another base (keeps its own frozen values), and one that trains the frozen weight."""
    from safetensors import safe_open

    torch.manual_seed(seed)
    engine = zkernel.initialize(TrickyNet(), config)
    world, rank = world_rank()
    data = batches(seed + 1, steps, accum, world, micro)
    run_steps(engine, data[:save_at], accum)
    saved = {k: v.clone() for k, v in engine.state_dict().items()}
    path = engine.save_checkpoint(directory, exclude_frozen_parameters=True)
    uninterrupted = run_steps(engine, data[save_at:], accum)
    engine.close()
    with safe_open(str(path / f"rank{rank:05d}.safetensors"), "pt") as f:
        stored = sorted(f.keys())
    out = {"saved": saved, "uninterrupted": uninterrupted, "stored": stored}
    torch.manual_seed(seed)
    base = TrickyNet()  # the same frozen base; its trainable values are the checkpoint's to give
    with torch.no_grad():
        for p in base.parameters():
            if p.requires_grad:
                p.add_(0.5)
    resumed = zkernel.initialize(base, config)
    resumed.load_checkpoint(directory)
    out["resumed"] = run_steps(resumed, data[save_at:], accum)
    resumed.close()
    torch.manual_seed(seed + 7)
    other = TrickyNet()
    out["other_frozen"] = other.frozen_proj.weight.detach().clone()
    engine = zkernel.initialize(other, config)
    engine.load_checkpoint(directory)
    out["other_loaded"] = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    torch.manual_seed(seed)
    trains = TrickyNet()
    trains.frozen_proj.weight.requires_grad_(True)
    engine = zkernel.initialize(trains, config)
    before = engine.state_dict()
    try:
        engine.load_checkpoint(directory)
        out["error"] = None
    except zkernel.CheckpointError as exc:
        out["error"] = str(exc)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
    engine.close()
    return out


def save_mid_window(config: dict, directory: str, steps: int, save_at: int, accum: int, micro: int, seed: int) -> dict:
    """Save after the first micro-batch of step ``save_at``'s window and train on; then a fresh engine loads
    it and trains from that window's start. Also loads from directories holding no checkpoint."""
    from structlog.testing import capture_logs

    torch.manual_seed(seed)
    engine = zkernel.initialize(TrickyNet(), config)
    world, rank = world_rank()
    data = batches(seed + 1, steps, accum, world, micro)
    losses = run_steps(engine, data[:save_at], accum)
    window = []
    for i, (tokens, targets) in enumerate(mb[rank] for mb in data[save_at]):
        window.append(engine(tokens, targets))
        engine.backward(window[-1])
        engine.step()
        if i == 0:  # the window goes on in the running engine after the save
            with capture_logs() as logs:
                engine.save_checkpoint(directory)
            warnings = [e for e in logs if e["log_level"] == "warning"]
    total = sum(loss.detach().float() for loss in window) / accum
    if world > 1:
        dist.all_reduce(total)
        total /= world
    losses += [total.item()]
    losses += run_steps(engine, data[save_at + 1 :], accum)
    saved_counters = (engine.global_steps, engine.micro_steps)
    engine.close()

    torch.manual_seed(seed + 1000)
    engine = zkernel.initialize(TrickyNet(), config)
    before = engine.state_dict()
    with capture_logs() as logs:
        empty = Path(directory).parent / "empty"
        if rank == 0:
            empty.mkdir(exist_ok=True)
        if world > 1:
            dist.barrier()
        nothing = [engine.load_checkpoint(empty), engine.load_checkpoint(Path(directory).parent / "never-made")]
    nothing_warnings = [(e["event"], e["log_level"]) for e in logs]
    unchanged = all(torch.equal(v, engine.state_dict()[k]) for k, v in before.items())
    counters_after_nothing = (engine.global_steps, engine.micro_steps)
    loaded = engine.load_checkpoint(directory)
    counters = (engine.global_steps, engine.micro_steps)
    resumed = run_steps(engine, data[save_at:], accum)
    engine.close()
    return {
        "losses": losses,
        "warnings": [(e["event"], e["micro_batches_done"], e["global_steps"]) for e in warnings],
        "saved_counters": saved_counters,
        "nothing": nothing,
        "nothing_warnings": nothing_warnings,
        "unchanged": unchanged,
        "counters_after_nothing": counters_after_nothing,
        "tag": loaded.tag,
        "counters": counters,
        "resumed": resumed,
    }


def job(tasks: list[tuple[str, tuple]]) -> list:
    """Run several scenarios of this module in one spawned job (one process start for all)."""
    return [globals()[name](*args) for name, args in tasks]


# -- a rank killed in the middle of a save ----------------------------------------------------


class PausingTier(DeviceOptimizerTier):
    """The device tier, except that while ``PAUSE_FILE`` exists a save stalls in its second group.

    The stall happens inside the real writer (between groups of a rank file
    being streamed), so the test can kill the process there.
    """

    def read_state(self, group):
        pause = os.environ.get("ZKERNEL_TEST_PAUSE_FILE")
        if pause and Path(pause).exists() and group.index == 1:
            Path(pause + ".reached").touch()
            time.sleep(600)
        return super().read_state(group)


class PausingPlugin:
    @hookimpl
    def zkernel_register_offload_tiers(self, registry):
        registry.add("pausing", PausingTier, description="device tier that stalls saves (test)")


def save_then_stall(directory: str) -> None:
    """Child process: save tag 'good', then start saving tag 'doomed' and stall inside it."""
    torch.manual_seed(0)
    config = {"partitioner": "zero2", "optimizer": {"lr": 1e-2}, "partitioner_options": {"bucket_size": 300},
              "offload": {"optimizer": "pausing"}}  # fmt: skip
    engine = zkernel.initialize(TrickyNet(), config, plugins=[PausingPlugin()])
    data = batches(5, 3, 1, 1, 4)
    run_steps(engine, data[:2], 1)
    engine.save_checkpoint(directory, tag="good")
    run_steps(engine, data[2:], 1)
    Path(os.environ["ZKERNEL_TEST_PAUSE_FILE"]).touch()
    engine.save_checkpoint(directory, tag="doomed")


def save_under_file_size_limit(directory: str, limit: str) -> str:
    """Child process: save 'good', then save 'big' with files capped at ``limit`` bytes; return the error."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), {"partitioner": "zero1", "optimizer": {"lr": 1e-2}})
    run_steps(engine, batches(5, 1, 1, 1, 4), 1)
    engine.save_checkpoint(directory, tag="good")
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        engine.save_checkpoint(directory, tag="big")
    except zkernel.CheckpointError as exc:
        print(str(exc))
        return str(exc)
    print("no error")
    return "no error"


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
