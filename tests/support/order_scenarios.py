"""Per-rank runs for the tests of the reduction order: ranks that use different parameters.

Two models, each trained as DDP would (every rank on its own micro-batch, the
gradient the mean of the ranks'), against single-process torch on the same
data: `Forked`, whose rank 0 takes both branches of every block in some
steps while rank 1 takes one, and a tiny Hugging Face Switch Transformer,
whose experts each rank's tokens choose differently (where transformers is installed).
"""

from __future__ import annotations

import functools
import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import zkernel  # noqa: E402
from tests.support.models import VOCAB, batches  # noqa: E402

STEPS, LR, WEIGHT_DECAY = 6, 2e-2, 0.1


class Fork(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, route: str) -> torch.Tensor:
        if route == "both":
            return torch.tanh(self.left(h) + self.right(h))
        return torch.tanh(getattr(self, route)(h))


class Forked(nn.Module):
    """Blocks of forks: with small buckets each branch is a bucket of its own."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Fork(dim) for _ in range(3)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, route: str = "both") -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h, route)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB).float(), targets.reshape(-1))


def fork_route(rank: int, step: int) -> str:
    """Both ranks take both branches at first; then rank 1 leaves the right branch out on odd steps
    and rank 0 on every third step."""
    if step == 0:
        return "both"
    if rank == 1:
        return "left" if step % 2 else "both"
    return "right" if step % 3 == 2 else "both"


def switch_transformer() -> nn.Module:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, expert_capacity=64, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=2, num_experts=6, dropout_rate=0.0,
        router_jitter_noise=0.0, router_z_loss_coef=0.0, router_aux_loss_coef=0.0, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )
    return SwitchTransformersForConditionalGeneration(cfg)


def _switch_loss(model, tokens: torch.Tensor, targets: torch.Tensor, route: str) -> torch.Tensor:
    return model(input_ids=tokens, labels=targets, output_router_logits=False).loss


def _fork_loss(model, tokens, targets, route):
    return model(tokens, targets, route=route)


MODELS = {"forked": (Forked, _fork_loss), "switch": (switch_transformer, _switch_loss)}


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _data(world: int):
    return batches(23, STEPS, 1, world, 2)


def train(model_name: str, cfg: dict) -> dict:
    """This rank's losses, the parameters it used in each step, whether it searched the graph for
    unreachable parameters, and the final state dict."""
    rank, world = _rank_world()
    build, loss_of = MODELS[model_name]
    torch.manual_seed(7)
    name = "cpu_adam" if cfg.get("offload", {}).get("optimizer", "none") != "none" else "adamw"
    engine = zkernel.initialize(build(), {**cfg, "optimizer": {"name": name, "lr": LR, "weight_decay": WEIGHT_DECAY}})
    losses, used = [], []
    for i, step in enumerate(_data(world)):
        tokens, targets = step[0][rank]
        loss = loss_of(engine, tokens, targets, fork_route(rank, i))
        engine.backward(loss)
        used.append(sorted((g, tuple(sorted(p))) for g, p in engine.scheduler.readiness.window_used.items()))
        engine.step()
        losses.append(loss.item())
    searched = engine.scheduler.readiness.order.search_unreachable
    state = engine.state_dict()
    engine.close()
    return {"losses": losses, "used": used, "searched": searched, "state": state}


@functools.cache
def reference(model_name: str, world: int, clip: float = 0.0) -> list[dict]:
    """DDP's result on one process: each step, the mean of the ranks' losses back-propagated once."""
    build, loss_of = MODELS[model_name]
    torch.manual_seed(7)
    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
    losses: list[list[float]] = [[] for _ in range(world)]
    for i, step in enumerate(_data(world)):
        total = 0.0
        for rank in range(world):
            tokens, targets = step[0][rank]
            loss = loss_of(model, tokens, targets, fork_route(rank, i))
            losses[rank].append(loss.item())
            total = total + loss / world
        total.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return [{"losses": per_rank, "state": state} for per_rank in losses]


SMALL_BUCKETS = {"bucket_size": 200}  # Forked's branches (156 elements each) in buckets of their own
CONFIGS = {
    ("forked", "none"): {"partitioner": "none", "partitioner_options": SMALL_BUCKETS},
    ("forked", "zero1"): {"partitioner": "zero1", "partitioner_options": SMALL_BUCKETS, "gradient_clipping": 0.5},
    ("forked", "zero2"): {"partitioner": "zero2", "partitioner_options": SMALL_BUCKETS},
    ("forked", "zero3 blocks"): {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0, "units": "blocks"}},
    # One unit per module, but each Fork one unit with its branches: rank 1 does not run every branch.
    ("forked", "zero3 leaf forks"): {
        "partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0, "leaf_modules": ["Fork"]},
    },
    # The root named: the whole model one unit (the ranks' different branches inside it).
    ("forked", "zero3 leaf root"): {
        "partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0, "leaf_modules": ["Forked"]},
    },
}
if importlib.util.find_spec("transformers") is not None:
    CONFIGS[("switch", "zero2")] = {"partitioner": "zero2", "partitioner_options": {"bucket_size": 2000}}
    # One unit per module: each sparse layer one unit with its experts ([Note: expert layers]).
    CONFIGS[("switch", "zero3")] = {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}}
    CONFIGS[("switch", "zero3 blocks")] = {
        "partitioner": "zero3", "partitioner_options": {"units": "blocks", "persistence_threshold": 0},
        "offload": {"optimizer": "cpu", "params": "cpu"},
    }


def all_runs() -> dict:
    """Every configuration of `CONFIGS` in one pair of processes."""
    return {key: train(key[0], cfg) for key, cfg in CONFIGS.items()}
