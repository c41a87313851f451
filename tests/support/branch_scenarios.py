"""Per-rank runs for the issue-8 tests: changing module order, eval passes, exceptions, diverging ranks."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.models import VOCAB, batches


class BranchNet(nn.Module):
    """Takes branch ``left`` or ``right`` (or, when ``wide``, a branch of another size) per call."""

    def __init__(self, dim: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)
        self.wide = nn.Sequential(nn.Linear(dim, 3 * dim), nn.Tanh(), nn.Linear(3 * dim, dim))
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens, targets, branch="left", fail=False):
        h = self.frozen(self.embed(tokens))
        h = torch.tanh(getattr(self, branch)(h))
        if fail:
            raise ValueError("a failing forward")
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def branch_of(step: int) -> str:
    return "left" if step % 2 == 0 else "right"


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def train_branching(
    config: dict, steps: int, eval_first: bool, fail_at: int | None = None, direct: bool = False
) -> dict:
    """Training that switches branch every step, optionally after an evaluation forward (no_grad,
    another batch size) and with a forward that raises at step ``fail_at`` (then retried); with
    ``direct`` those two, and every training forward, call ``engine.module`` instead of the engine,
    and a hook of the user's reads the embedding's weight (released by then) inside each branch."""
    rank, world = _rank_world()
    torch.manual_seed(3)
    engine = zkernel.initialize(BranchNet(), config)
    model = engine.module if direct else engine
    if direct:
        net = engine.module

        def read_embedding(_module, _args, _output) -> None:
            net.embed.weight.sum()

        for branch in (net.left, net.right):
            branch.register_forward_hook(read_embedding)
    data = batches(9, steps, 1, world, 3)
    if eval_first:
        with torch.no_grad():
            tokens, targets = batches(99, 1, 1, world, 5)[0][0][rank]
            model(tokens, targets, branch="wide")
    losses, leftovers = [], []
    for i, step in enumerate(data):
        tokens, targets = step[0][rank]
        if i == fail_at:
            try:
                model(tokens, targets, branch=branch_of(i), fail=True)
            except ValueError:
                pass
            leftovers.append(sum(g.gathered for g in engine.scheduler.bound if g.layout and not g.layout.persistent))
        loss = model(tokens, targets, branch=branch_of(i))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float()
        if world > 1:
            torch.distributed.all_reduce(total)
            total /= world
        losses.append(total.item())
        leftovers.append(sum(g.gathered for g in engine.scheduler.bound if g.layout and not g.layout.persistent))
    return {"losses": losses, "leftovers": leftovers, "retraces": engine.scheduler.tracer.retraces}


def reference_branching(steps: int, world: int, lr: float) -> list[float]:
    torch.manual_seed(3)
    model = BranchNet()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for i, step in enumerate(batches(9, steps, 1, world, 3)):
        tokens = torch.cat([t for t, _ in step[0]])
        targets = torch.cat([y for _, y in step[0]])
        loss = model(tokens, targets, branch=branch_of(i))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class Latents(nn.Module):
    """Returns a view of its own parameter, as Perceiver's latents (``expand``)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(rows, dim))

    def forward(self, batch: int) -> torch.Tensor:
        return self.latents.expand(batch, -1, -1)


class Positions(nn.Module):
    """Returns its table itself (``detach``: no view of the parameter, the same memory) or a slice of it."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, dim) / 4)

    def forward(self, rows: int) -> torch.Tensor:
        return self.table.detach() if rows == len(self.table) else self.table[:rows]


class AliasNet(nn.Module):
    """Units whose outputs alias their parameters, read by the next units (large enough that freed memory
    is given back to the system)."""

    def __init__(self, rows: int = 64, dim: int = 512) -> None:
        super().__init__()
        self.latents = Latents(rows, dim)
        self.positions = Positions(rows, dim)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, batch: int, rows: int) -> torch.Tensor:
        h = self.latents(batch)[:, :rows] + self.positions(rows)
        return self.proj(self.norm(h)).square().mean()


def aliased_outputs(config: dict, steps: int) -> dict:
    """AliasNet under ``config``: losses of evaluation passes (without autograd, both of Positions' outputs)
    and of training steps, with a plain copy's beside them (every rank has the same input)."""
    torch.manual_seed(11)
    plain = AliasNet()
    model = AliasNet()
    model.load_state_dict(plain.state_dict())
    engine = zkernel.initialize(model, config)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=config["optimizer"]["lr"], weight_decay=0.0)
    out = {"eval": [], "eval_plain": [], "train": [], "train_plain": [], "device": engine.device.type}
    for step in range(steps):
        with torch.no_grad():
            for rows in (64, 40):
                out["eval"].append(float(engine(3, rows)))
                out["eval_plain"].append(float(plain(3, rows)))
        rows = 64 if step % 2 else 48
        loss = engine(2, rows)
        engine.backward(loss)
        engine.step()
        out["train"].append(float(loss))
        reference = plain(2, rows)
        reference.backward()
        optimizer.step()
        optimizer.zero_grad()
        out["train_plain"].append(float(reference))
    engine.close()
    return out


def diverge(config: dict, branch_on_rank1: str) -> str:
    """Rank 1 takes ``branch_on_rank1`` at the second step while rank 0 stays left: the error text."""
    rank, world = _rank_world()
    torch.manual_seed(3)
    engine = zkernel.initialize(BranchNet(), config)
    data = batches(9, 4, 1, world, 3)
    try:
        for i, step in enumerate(data):
            tokens, targets = step[0][rank]
            branch = branch_on_rank1 if (rank == 1 and i == 1) else "left"
            loss = engine(tokens, targets, branch=branch)
            engine.backward(loss)
            engine.step()
    except zkernel.RankDivergenceError as exc:
        return str(exc)
    return "no error"


def deferred_statements(count: int, diverge_at: int | None, transports: list[str]) -> dict[str, str]:
    """The NCCL form of the path check (statements in shared memory or on the device ring, and
    the watchdog), run over gloo: ``count`` statements, rank 1 naming another group from
    ``diverge_at`` on; what the watchdog said, by transport. The transports' checks are open at
    once (each its own ring and watchdog): every statement goes to each, and one wait serves all."""
    import threading
    import time
    from types import SimpleNamespace

    from zkernel.platform.distributed import init_distributed
    from zkernel.kernel.divergence import PathCheck

    init_distributed()

    rank, _ = _rank_world()
    groups = [SimpleNamespace(index=i, name=f"layers.{i}") for i in range(3)]
    said: dict[str, list[str]] = {}
    done: dict[str, threading.Event] = {}
    checks: dict[str, PathCheck] = {}

    def recorder(transport: str):
        def record(message: str) -> None:
            said[transport].append(message)
            done[transport].set()

        return record

    for transport in transports:
        said[transport], done[transport] = [], threading.Event()
        checks[transport] = PathCheck(groups, torch.device("cpu"), enabled=True, poll_s=0.05, deferred=True,
                                      on_divergence=recorder(transport), transport=transport)
        if transport == "shared" and rank == 0:  # mapped by every rank, and unlinked at once
            assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"zkernel-paths-{os.getpid()}-")]
    for n in range(count):
        index = 2 if (rank == 1 and diverge_at is not None and n >= diverge_at) else n % 2
        for check in checks.values():
            check.before(groups[index], "forward" if n % 3 else "reduce", micro_step=n // 10)
        if diverge_at is not None and n == diverge_at:
            break  # a real job would now hang in the mismatched collective
    deadline = time.monotonic() + 3.0
    for transport in transports:
        done[transport].wait(max(0.0, deadline - time.monotonic()))
    for check in checks.values():
        check.close()
    return {transport: said[transport][0] if said[transport] else "no error" for transport in transports}


def deferred_statements_then_close(diverge_at: int, transport: str = "auto") -> str:
    """Ranks diverge at the last statement and the check is closed at once (before any poll)."""
    from types import SimpleNamespace

    from zkernel.platform.distributed import init_distributed
    from zkernel.kernel.divergence import PathCheck

    init_distributed()
    rank, _ = _rank_world()
    groups = [SimpleNamespace(index=i, name=f"layers.{i}") for i in range(3)]
    said: list[str] = []
    check = PathCheck(groups, torch.device("cpu"), enabled=True, poll_s=60.0, deferred=True, on_divergence=said.append,
                      transport=transport)
    for n in range(diverge_at + 1):
        check.before(groups[2 if (rank == 1 and n == diverge_at) else 0], "forward", micro_step=7)
    check.close()
    return said[0] if said else "no error"


def deferred_statements_lock_held(diverge_at: int, transport: str = "auto") -> str:
    """Ranks diverge at statement ``diverge_at``, then the main thread holds the interpreter lock
    (as a thread blocked inside a collective can) for 30 s: only the native watcher can report."""
    import sys
    import time
    from types import SimpleNamespace

    from zkernel.platform.distributed import init_distributed
    from zkernel.kernel.divergence import PathCheck

    init_distributed()
    rank, _ = _rank_world()
    groups = [SimpleNamespace(index=i, name=f"layers.{i}") for i in range(3)]
    check = PathCheck(groups, torch.device("cpu"), enabled=True, poll_s=0.05, grace_s=1.0, deferred=True, transport=transport)
    for n in range(diverge_at + 1):
        check.before(groups[2 if (rank == 1 and n == diverge_at) else 0], "forward", micro_step=5)
    sys.setswitchinterval(60.0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pass
    return "no error"
