"""Per-rank runs for a backward the engine is not told of (``loss.backward()``), and their torch oracle.

Each way of back-propagating trains a fresh engine for `STEPS` steps of `ACCUM` micro-batches and
returns its full state dict; the oracle is single-process torch AdamW applying DDP's gradient (the
mean of the ranks' gradients) over the same per-rank batches.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import zkernel

DIM, MICRO, ACCUM, STEPS, LR, WD, CLIP = 6, 3, 2, 3, 1e-2, 0.01, 0.5


class Net(nn.Module):
    """Two layers; returns the output (the loss is the script's), or the loss when given targets."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x, y=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out if y is None else F.mse_loss(out, y)


def batch(step: int, micro: int, rank: int, which: int = 0):
    g = torch.Generator().manual_seed(10_000 * which + 100 * step + 10 * micro + rank)
    return torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)


def config(partitioner: str, optimizer_offload: str = "none", **extra) -> dict:
    return {
        "partitioner": partitioner,
        "precision": "fp32",
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"name": "adamw", "lr": LR, "weight_decay": WD},
        "offload": {"optimizer": optimizer_offload},
        **extra,
    }


def _rank() -> tuple[int, int]:
    """(world size, rank) as the launcher set them (read before the first engine joins the group)."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def _loss(way: str, engine, step: int, micro: int, rank: int, which: int = 0):
    """This micro-batch's backward the way ``way`` says (the loss is returned for two engines)."""
    x, y = batch(step, micro, rank, which)
    if way == "model loss":  # the model computes its loss, the script calls loss.backward()
        engine(x, y).backward()
    elif way == "engine.backward":
        engine.backward(F.mse_loss(engine(x), y))
    elif way == "loss.backward":  # a loss function outside the model
        F.mse_loss(engine(x), y).backward()
    elif way == "engine.backward sum":
        engine.backward(engine(x).sum())
    elif way == "output.backward":  # a non-scalar backward with the gradient of the sum
        out = engine(x)
        out.backward(torch.ones_like(out))
    elif way == "engine.scale":
        engine.scale(F.mse_loss(engine(x), y)).backward()
    elif way == "unscaled":
        engine.backward(F.mse_loss(engine(x), y), scale_wrt_gas=False)
    else:
        raise ValueError(way)


def train_ways(cfg: dict, ways: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """One fresh engine per way; the full state dict after `STEPS` steps of `ACCUM` micro-batches."""
    _, rank = _rank()
    results = {}
    for way in ways:
        torch.manual_seed(0)
        engine = zkernel.initialize(Net(), cfg)
        for step in range(STEPS):
            for micro in range(ACCUM):
                _loss(way, engine, step, micro, rank)
                engine.step()
        assert engine.global_steps == STEPS, (way, engine.global_steps)
        results[way] = engine.state_dict()
        engine.close()
    return results


def train_two_engines(cfg: dict) -> list[dict[str, torch.Tensor]]:
    """Two engines (two models) trained by one ``loss.backward()`` of their combined loss."""
    _, rank = _rank()
    engines = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        engines.append(zkernel.initialize(Net(), cfg))
    for step in range(STEPS):
        for micro in range(ACCUM):
            losses = [F.mse_loss(e(batch(step, micro, rank, i)[0]), batch(step, micro, rank, i)[1]) for i, e in enumerate(engines)]
            (losses[0] + losses[1] / 2).backward()
            for e in engines:
                e.step()
    states = [e.state_dict() for e in engines]
    for e in engines:
        e.close()
    return states


def fp16_backward_without_scale() -> dict:
    """Under fp16, ``loss.backward()`` without `Engine.scale` raises; then `Engine.scale` trains as
    `Engine.backward` does."""
    _, rank = _rank()
    cfg = {**config("zero2"), "precision": "fp16", "initial_loss_scale": 256.0}
    torch.manual_seed(0)
    engine = zkernel.initialize(Net(), cfg)
    x, y = batch(0, 0, rank)
    loss = F.mse_loss(engine(x), y)
    try:
        loss.backward()
        message = None
    except RuntimeError as error:
        message = str(error)
    engine.step()  # nothing was counted: a warning, no step
    counted = engine.micro_steps
    engine.close()
    states = {}
    for way in ("engine.backward", "engine.scale"):
        torch.manual_seed(0)
        engine = zkernel.initialize(Net(), cfg)
        for step in range(STEPS):
            for micro in range(ACCUM):
                _loss(way, engine, step, micro, rank)
                engine.step()
        states[way] = engine.state_dict()
        engine.close()
    return {"message": message, "counted": counted, "states": states}


def reference(way: str, world: int, seed: int = 0, which: int = 0) -> dict[str, torch.Tensor]:
    """Torch AdamW with DDP's gradient: the mean over ranks of each rank's gradient of its loss,
    divided by the accumulation steps unless ``way`` is "unscaled"."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    divide = 1 if way == "unscaled" else ACCUM
    for step in range(STEPS):
        for micro in range(ACCUM):
            for rank in range(world):
                x, y = batch(step, micro, rank, which)
                out = model(x)
                loss = out.sum() if way in ("output.backward", "engine.backward sum") else F.mse_loss(out, y)
                (loss / world / divide).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_two_engines(world: int) -> list[dict[str, torch.Tensor]]:
    """Torch for `train_two_engines`: two models, two AdamW, one combined loss."""
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(Net())
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD) for m in models]
    for step in range(STEPS):
        for micro in range(ACCUM):
            for rank in range(world):
                losses = [F.mse_loss(m(batch(step, micro, rank, i)[0]), batch(step, micro, rank, i)[1]) for i, m in enumerate(models)]
                ((losses[0] + losses[1] / 2) / world / ACCUM).backward()
        for m, opt in zip(models, opts):
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]


WAYS = ["engine.backward", "loss.backward", "model loss", "engine.scale", "engine.backward sum", "output.backward", "unscaled"]


def every_way(cfg: dict) -> dict:
    """`train_ways` over `WAYS` and `train_two_engines`, in one launch of the ranks."""
    return {"ways": train_ways(cfg, WAYS), "two": train_two_engines(cfg)}
