"""Per-rank runs for the tests of parameters that get no gradient in a window (torch skips them)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import zkernel
import zkernel.spec
from tests.support.models import VOCAB, batches
from zkernel.spec.groups import OptimizerDeclaration, StateSpec

STEPS, ACCUM, LR, WEIGHT_DECAY = 6, 2, 2e-2, 0.1
FREEZE_AT = 4  # the step before which the head's bias is frozen (after `initialize`)

# The branch each micro-batch takes, per step: a branch no micro-batch of a window takes gets no
# gradient in it (step 0 never uses "right", so its count lags from the first step), one taken by
# a single micro-batch of the window gets one.
ROUTES = [("left", "left"), ("right", "left"), ("right", "right"), ("left", "left"), ("left", "right"), ("right", "right")]


class Switch(nn.Module):
    """Two branches and a gate: every call uses one branch, so the other's parameters get no gradient."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.ones(dim))

    def forward(self, h: torch.Tensor, route: str) -> torch.Tensor:
        return torch.tanh(getattr(self, route)(h)) * self.gate


class SwitchNet(nn.Module):
    """Blocks of switches between an embedding and a head: under ``units = "blocks"`` each block is one
    zero3 unit holding both branches, and zero1/zero2 buckets hold every parameter."""

    def __init__(self, dim: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Switch(dim) for _ in range(2)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, route: str = "left") -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h, route)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB).float(), targets.reshape(-1))


class MomentumSGD:
    """A third-party optimizer that knows nothing of skipped parameters (the example of docs/plugins/writing.md)."""

    def __init__(self, context) -> None:
        self.momentum = 0.9

    @zkernel.spec.hookimpl
    def zkernel_declare_optimizer(self, numel):
        return OptimizerDeclaration(state=(StateSpec("momentum", torch.float32, (numel,)),))

    @zkernel.spec.hookimpl
    def zkernel_step_optimizer(self, group, options):
        grad = group.grad.to(group.master.dtype) * options.grad_scale
        grad = group.optim_state["momentum"].mul_(self.momentum).add_(grad)
        group.master.add_(grad, alpha=-options.lr)
        if group.copy_out is not None:
            group.copy_out.copy_(group.master)
        return True


class MomentumPlugin:
    @zkernel.spec.hookimpl
    def zkernel_register_optimizers(self, registry):
        registry.add("momentum_sgd", MomentumSGD, description="SGD with momentum (test)")


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _data(world: int, steps: int):
    return batches(17, steps, ACCUM, world, 2)


def _train(engine, model: nn.Module, first: int, last: int, world: int, rank: int) -> list[float]:
    """Steps ``[first, last)`` of the route schedule; the global mean loss of each."""
    losses = []
    for i, step in enumerate(_data(world, last)[first:], start=first):
        if i == FREEZE_AT:
            model.head.bias.requires_grad_(False)
        total = 0.0
        for route, micro in zip(ROUTES[i], step):
            tokens, targets = micro[rank]
            loss = engine(tokens, targets, route=route)
            engine.backward(loss)
            engine.step()
            value = loss.detach().float()
            if world > 1:
                torch.distributed.all_reduce(value)
                value /= world
            total += value.item() / ACCUM
        losses.append(total)
    return losses


def config(partitioner: str = "zero2", optimizer_tier: str = "none", params_tier: str = "none", **extra) -> dict:
    cfg = {
        "partitioner": partitioner,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"name": "cpu_adam" if optimizer_tier != "none" else "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY},
        "offload": {"optimizer": optimizer_tier, "params": params_tier},
    }
    if partitioner == "zero3":
        cfg["partitioner_options"] = {"persistence_threshold": 0, "units": "blocks"}
    cfg.update(extra)
    return cfg


def train_switching(cfg: dict, nvme_dir: str | None = None) -> dict:
    """SwitchNet through zkernel: global losses per step and the final full state dict."""
    rank, world = _rank_world()
    if nvme_dir is not None:
        cfg = {**cfg, "offload": {**cfg["offload"], "nvme_path": nvme_dir}}
    torch.manual_seed(5)
    engine = zkernel.initialize(SwitchNet(), cfg, plugins=[MomentumPlugin()])
    losses = _train(engine, engine.module, 0, STEPS, world, rank)
    state = engine.state_dict()
    rollbacks = engine.pipeline.rollbacks
    engine.close()
    return {"losses": losses, "state": state, "rollbacks": rollbacks}


def resume_switching(saved: dict, resumed: dict, directory: str) -> dict:
    """Train ``STEPS // 2`` steps under ``saved``, checkpoint, and finish under ``resumed`` in a new
    engine (the window counts of the two branches differ by then)."""
    rank, world = _rank_world()
    half = STEPS // 2
    torch.manual_seed(5)
    engine = zkernel.initialize(SwitchNet(), saved)
    first = _train(engine, engine.module, 0, half, world, rank)
    engine.save_checkpoint(directory)
    engine.close()
    torch.manual_seed(99)  # other initial values: the checkpoint must bring every one back
    engine = zkernel.initialize(SwitchNet(), resumed)
    engine.load_checkpoint(directory)
    rest = _train(engine, engine.module, half, STEPS, world, rank)
    state = engine.state_dict()
    engine.close()
    return {"losses": first + rest, "state": state}


def reference(world: int, clip: float = 0.0, momentum_sgd: bool = False) -> dict:
    """Single-process torch AdamW (or SGD with momentum) on the global batches, with the same routes
    and the same freeze."""
    torch.manual_seed(5)
    model = SwitchNet()
    params = [p for p in model.parameters() if p.requires_grad]
    if momentum_sgd:
        opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for i, step in enumerate(_data(world, STEPS)):
        if i == FREEZE_AT:
            model.head.bias.requires_grad_(False)
        total = 0.0
        for route, micro in zip(ROUTES[i], step):
            tokens = torch.cat([t for t, _ in micro])
            targets = torch.cat([y for _, y in micro])
            loss = model(tokens, targets, route=route) / ACCUM
            loss.backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def rank_route(rank: int, step: int) -> str:
    """Rank 0 always takes the left branch, rank 1 the right one after the first step."""
    return "left" if rank == 0 or step == 0 else "right"


def train_rank_routes(cfg: dict) -> dict:
    """Each rank takes its own branch (`rank_route`), one micro-batch a step: losses of this rank and
    the final state dict."""
    rank, world = _rank_world()
    torch.manual_seed(5)
    engine = zkernel.initialize(SwitchNet(), {**cfg, "gradient_accumulation_steps": 1})
    losses = []
    for i, step in enumerate(_data(world, STEPS)):
        tokens, targets = step[0][rank]
        loss = engine(tokens, targets, route=rank_route(rank, i))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.state_dict()
    engine.close()
    return {"losses": losses, "state": state}


def reference_rank_routes(world: int) -> list[dict]:
    """DDP's result: the mean of the ranks' losses, each on its own branch; per rank's losses."""
    torch.manual_seed(5)
    model = SwitchNet()
    opt = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=WEIGHT_DECAY)
    losses: list[list[float]] = [[] for _ in range(world)]
    for i, step in enumerate(_data(world, STEPS)):
        total = 0.0
        for rank in range(world):
            tokens, targets = step[0][rank]
            loss = model(tokens, targets, route=rank_route(rank, i))
            losses[rank].append(loss.item())
            total = total + loss / world
        total.backward()
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return [{"losses": per_rank, "state": state} for per_rank in losses]


TWO_RANK_CONFIGS = {"zero2 clipped": config("zero2", gradient_clipping=0.5), "zero3 blocks on cpu": config("zero3", "cpu", "cpu")}


def two_rank_runs() -> dict:
    """Every two-rank run of the tests in one pair of processes: `train_switching` under each of
    `TWO_RANK_CONFIGS`, and `train_rank_routes` under zero2."""
    runs = {label: train_switching(cfg) for label, cfg in TWO_RANK_CONFIGS.items()}
    runs["rank routes"] = train_rank_routes(config("zero2"))
    return runs
