"""Per-rank runs for the engine lifecycle tests (executed inside spawned processes)."""

from __future__ import annotations

import os

import torch

import zkernel
from tests.models import TrickyNet, batches


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def close_and_reuse(first: dict, second: dict, steps: int = 3) -> dict:
    """Train under ``first``, close, check the module is whole, then train it further under ``second``."""
    torch.manual_seed(0)
    model = TrickyNet()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = batches(5, 2 * steps, 1, world, 2)
    engine = zkernel.initialize(model, first)
    losses = []
    for step in data[:steps]:
        tokens, targets = step[0][_rank()]
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with engine.gathered_parameters():
        gathered = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    masters = {}
    engine.close()
    after = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    grad_hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    # The module trains on its own now ...
    tokens, targets = data[steps][0][_rank()]
    home = next(model.parameters()).device  # the compute device where the model fits there, else the host
    plain = model(tokens.to(home), targets.to(home))
    plain.backward()
    plain_grads = all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    # ... and a new engine takes it.
    engine2 = zkernel.initialize(model, second)
    for step in data[steps:]:
        tokens, targets = step[0][_rank()]
        loss = engine2(tokens, targets)
        engine2.backward(loss)
        engine2.step()
        losses.append(loss.item())
    engine2.close()
    return {
        "losses": losses,
        "gathered": gathered,
        "after": after,
        "dtypes": {n: str(d) for n, d in dtypes.items()},
        "after_dtypes": {n: str(t.dtype) for n, t in after.items()},
        "hooks": hooks,
        "grad_hooks": grad_hooks,
        "plain_grads": plain_grads,
        "masters": masters,
    }


def reference_two_phases(steps: int, lr: float) -> list[float]:
    """The same 2 x ``steps`` of plain AdamW on one process (world 1 data), on the device zkernel picks."""
    torch.manual_seed(0)
    model = TrickyNet()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for i, step in enumerate(batches(5, 2 * steps, 1, 1, 2)):
        if i == steps:
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        tokens, targets = step[0][0]
        loss = model(tokens.to(device), targets.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
