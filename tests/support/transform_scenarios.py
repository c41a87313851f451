"""Models and per-rank runs for the tiling and activation checkpointing tests (also run in spawned processes)."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.models import TiledLossNet, TrickyNet
from tests.support.scenarios import _train_steps
from zkernel.spec.hookspecs import hookimpl

DIM, HIDDEN = 12, 40


class Block(nn.Module):
    """Pre-norm MLP block with dropout; takes a tensor keyword, a non-tensor keyword and a tuple."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(0.25)
        self.inputs: list = []  # weak references to every x this block ran on (forward and recompute)
        self.probe = None  # called at the start of every run (forward and recompute)

    def forward(self, x, pair, *, mask=None, scale=1.0):
        self.inputs.append(weakref.ref(x))
        if self.probe is not None:
            self.probe(self)
        shift, gain = pair
        h = self.drop(F.gelu(self.up(self.norm(x) + shift)))
        if mask is not None:
            h = h * mask
        return x + scale * gain * self.down(h)


class Stack(nn.Module):
    """Embedding, ``depth`` Blocks, tied head: a language model in miniature."""

    def __init__(self, depth: int = 4, vocab: int = 23) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.shift = nn.Parameter(torch.zeros(DIM))

    def forward(self, tokens, targets, mask):
        x = self.embed(tokens)
        gain = torch.tensor(0.5, device=x.device)
        for block in self.blocks:
            x = block(x, (self.shift, gain), mask=mask, scale=0.75)
        logits = F.linear(x, self.embed.weight)
        return F.cross_entropy(logits.reshape(-1, self.vocab).float(), targets.reshape(-1))


def stack_batches(seed: int, steps: int, accum: int, micro: int = 3, seq: int = 5, vocab: int = 23):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(accum):
            tokens = torch.randint(0, vocab, (micro, seq), generator=g)
            mask = (torch.rand(micro, seq, HIDDEN, generator=g) > 0.1).float()
            step.append((tokens, (tokens * 5 + 2) % vocab, mask))
        out.append(step)
    return out


def train_stack(config: dict | None, steps: int, accum: int, seed: int) -> list[float]:
    """Train `Stack` (dropout on) through zkernel, or plain torch AdamW when ``config`` is None.

    Plain torch runs on the device zkernel picks (a GPU where there is one): dropout draws its
    masks from that device's generator."""
    torch.manual_seed(seed)
    model = Stack()
    data = stack_batches(seed + 1, steps, accum)
    torch.manual_seed(seed + 2)  # dropout masks: the same stream for every run
    if config is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        for step in data:
            total = 0.0
            for tokens, targets, mask in step:
                tokens, targets, mask = (t.to(device) for t in (tokens, targets, mask))
                loss = model(tokens, targets, mask) / accum
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
        return losses
    engine = zkernel.initialize(model, {**config, "optimizer": {"lr": 1e-2, "weight_decay": 0.1}, "gradient_accumulation_steps": accum})
    losses = []
    for step in data:
        total = 0.0
        for tokens, targets, mask in step:
            loss = engine(tokens, targets, mask)
            engine.backward(loss)
            engine.step()
            total += loss.item() / accum
        losses.append(total)
    engine.close()
    return losses


class GatheredBytes:
    """Inline plugin: the most parameter bytes zero3 held gathered at once, from `Engine.memory_report`.

    With ``budget`` set, a fetch or prefetch that takes the gathered bytes
    above it fails, as an allocation would on a device of that size.
    """

    def __init__(self, engine, budget: int | None = None) -> None:
        self.engine = engine
        self.budget = budget
        self.shards = self._params()  # between steps only the shards are held
        self.peak = 0

    def _params(self) -> int:
        return sum(self.engine.memory_report()["params"].values())

    def _measure(self) -> None:
        gathered = self._params() - self.shards
        self.peak = max(self.peak, gathered)
        if self.budget is not None and gathered > self.budget:
            raise MemoryError(f"gathered {gathered} bytes, over the budget of {self.budget}")

    @hookimpl(wrapper=True)
    def zkernel_fetch_params(self, group, phase):
        result = yield
        self._measure()
        return result

    @hookimpl(wrapper=True)
    def zkernel_prefetch_params(self, group, phase):
        result = yield
        self._measure()
        return result


MODELS = {"tricky": TrickyNet, "tiled loss": TiledLossNet}


def train_tricky_transformed(runs: list[tuple[str, dict]], steps: int, accum: int, micro: int, seed: int) -> list[dict]:
    """Train each run's model (a name in MODELS) under its config on this rank's share; losses,
    user-visible state, restored module."""
    if not dist.is_initialized():
        # Ours, so that closing each engine leaves it up: re-creating the default group over and
        # over on the same port can hang in init_process_group.
        dist.init_process_group("gloo")
    out = []
    for model_name, config in runs:
        torch.manual_seed(seed)
        model = MODELS[model_name]()
        engine = zkernel.initialize(model, config)
        losses = _train_steps(engine, steps, accum, micro, seed)
        with engine.gathered_parameters() as gathered:
            state = {k: v.detach().cpu().clone() for k, v in gathered.state_dict().items()}
        held = [n for n, _ in model.named_parameters()]
        trace = len(engine.scheduler.trace)
        world = dist.get_world_size() if dist.is_initialized() else 1
        engine.close()
        restored = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        out.append({
            "losses": losses, "state": state, "held": held, "restored": restored, "trace": trace,
            "classes": sorted({type(m).__name__ for m in model.modules()}),
            "world": world,
        })
    return out
