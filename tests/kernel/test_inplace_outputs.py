"""Unit outputs modified in place by their caller (Swinv2's ``ReLU(inplace=True)`` after a Linear on
an input of four dimensions, whose output is a view): zero3 fetches the unit for its backward all
the same ([Note: outputs modified in place] in `zkernel.kernel.scheduler`)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import VOCAB, batches, reference_losses
from tests.support.scenarios import _train_steps

STEPS, ACCUM, MICRO, SEED, LR, CLIP = 3, 2, 2, 3, 1e-2, 1.0


class InPlaceOutputs(nn.Module):
    """A position-bias MLP over a constant table (its first Linear's output a view, rectified in
    place); a Linear on 3-d input whose output gets an in-place add; a positional table sliced."""

    def __init__(self, dim: int = 12, hidden: int = 40) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.bias_mlp = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim, bias=False))
        self.register_buffer("table", torch.linspace(-1, 1, 2 * 3 * 6 * 2).reshape(2, 3, 6, 2))
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (micro, seq, dim)
        bias = self.bias_mlp(self.table).mean(dim=(0, 1))  # (seq, dim) from a 4-d input
        h = self.proj(h)
        h.add_(bias)  # in place on a unit's output
        return F.cross_entropy(self.head(torch.tanh(h)).reshape(-1, VOCAB), targets.reshape(-1))


CONFIGS = {
    "zero3": {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}},
    "zero3 params and optimizer on the cpu": {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0},
                                              "offload": {"params": "cpu", "optimizer": "cpu"}},
}  # fmt: skip


def _config(name: str) -> dict:
    return {**copy.deepcopy(CONFIGS[name]), "precision": "fp32", "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": CLIP, "optimizer": {"name": "adamw", "lr": LR, "weight_decay": 0.0}}  # fmt: skip


def _train(name: str) -> dict:
    torch.manual_seed(SEED)
    engine = zkernel.initialize(InPlaceOutputs(), _config(name))
    losses = _train_steps(engine, STEPS, ACCUM, MICRO, SEED)
    external = sorted(g.name for g in engine.groups if g.index in engine.scheduler.external)
    engine.close()
    return {"losses": losses, "external": external}


def _reference(world: int) -> list[float]:
    torch.manual_seed(SEED)
    return reference_losses(InPlaceOutputs(), batches(SEED + 1, STEPS, ACCUM, world, MICRO), LR, 0.0, CLIP)


def _train_all() -> dict:
    return {name: _train(name) for name in CONFIGS}


def _assert_matches(losses, expected, label):
    for i, (a, b) in enumerate(zip(losses, expected, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{label} step {i}: {a!r} vs torch {b!r}"


def test_outputs_modified_in_place_train_like_torch_on_two_ranks():
    expected = _reference(2)
    for rank, results in enumerate(run_ranks(2, _train_all)):
        for name, r in results.items():
            _assert_matches(r["losses"], expected, f"rank {rank} {name}")
            # Fetched by their outputs' hooks for the backward, not by a read of a released parameter
            # (which keeps its unit whole for good).
            assert r["external"] == [], f"rank {rank} {name}"
