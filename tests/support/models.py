"""Models and data shared by the tests: the hard cases a user hits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zkernel

VOCAB = 29


class TrickyNet(nn.Module):
    """Tied embedding/head, a block called twice, a frozen parameter, a buffer, a 0-dim gain, odd sizes."""

    def __init__(self, dim: int = 13, hidden: int = 37) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.block = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.norm = nn.LayerNorm(dim)
        self.frozen_proj = nn.Linear(dim, dim)
        self.frozen_proj.weight.requires_grad_(False)
        self.gain = nn.Parameter(torch.tensor(0.75))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, dim))

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.block(h)
        h = h + self.block(h)  # the same module twice
        return self.frozen_proj(self.norm(h)) * self.gain + self.shift

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.features(tokens), self.embed.weight)  # tied head, outside the embedding's forward
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


class TiledLossNet(TrickyNet):
    """TrickyNet whose tied head and loss go through `zkernel.tiled_cross_entropy` in 3 tiles."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return zkernel.tiled_cross_entropy(self.features(tokens), self.embed.weight, targets, tiles=3)


def batches(seed: int, steps: int, accum: int, world: int, micro: int, seq: int = 6):
    """Global batches: [step][micro][rank] -> (tokens, targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(accum):
            tokens = torch.randint(0, VOCAB, (world * micro, seq), generator=g)
            targets = (tokens * 7 + 3) % VOCAB
            step.append([(tokens[r * micro : (r + 1) * micro], targets[r * micro : (r + 1) * micro]) for r in range(world)])
        out.append(step)
    return out


def weight_penalty(model: nn.Module) -> torch.Tensor:
    """A regulariser computed by user code outside any module's forward."""
    return 0.01 * model.block[0].weight.pow(2).sum()


def reference_losses(
    model: nn.Module, data, lr, weight_decay, clip, betas=(0.9, 0.999), eps=1e-8, penalty=None, schedule=None,
    groups=(),
):
    """Single-process torch AdamW on the global batches: the oracle. ``schedule``: (lr, betas) per step;
    ``groups``: torch parameter groups before the default one, each ``(names, lr_scale, weight_decay)``
    or ``(names, lr_scale, weight_decay, own)`` with ``own`` the group's other torch keys (``betas``,
    ``eps``) (a parameter in the first that names it; its rate ``lr_scale`` times the step's)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    placed: set[str] = set()
    param_groups = []
    for names, scale, decay, *own in groups:
        mine = [(n, p) for n, p in trainable if n in names and n not in placed]
        placed.update(n for n, _ in mine)
        param_groups.append(
            {"params": [p for _, p in mine], "lr": lr * scale, "weight_decay": decay, "scale": scale, **(own[0] if own else {})}
        )
    param_groups.append({"params": [p for n, p in trainable if n not in placed], "scale": 1.0})
    opt = torch.optim.AdamW(param_groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    losses = []
    for i, step in enumerate(data):
        if schedule is not None:
            for group in opt.param_groups:
                group["lr"], group["betas"] = schedule[i][0] * group["scale"], schedule[i][1]
        total = 0.0
        for micro in step:
            tokens = torch.cat([t for t, _ in micro])
            targets = torch.cat([y for _, y in micro])
            loss = model(tokens, targets)
            if penalty is not None:
                loss = loss + penalty(model)
            loss = loss / len(step)
            loss.backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def sized_units(model, policy: str = "modules", leaf_modules: tuple[str, ...] = (), leaf_experts: bool = True) -> list[int]:
    """How many parameters each of zero3's units holds as the estimator is told them: the groups of
    zero3's answer to ``zkernel_size_partition``, none pooled, every parameter counted trainable (so
    each unit is one group), in zero3's order."""
    from zkernel.kernel.plugin_manager import get_plugin_manager
    from zkernel.kernel.sizing import Estimator
    from zkernel.spec.config import Config

    options = {"persistence_threshold": 0, "units": policy, "leaf_modules": list(leaf_modules), "leaf_experts": leaf_experts}
    config = Config(partitioner="zero3", partitioner_options=options)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        layout = Estimator(model, "cpu", get_plugin_manager(config=config)).partition(config, 1)
    finally:
        for p in frozen:
            p.requires_grad_(False)
    return [group.params for group in layout.groups]
