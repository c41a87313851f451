"""Per-rank runs for the engine lifecycle tests (executed inside spawned processes)."""

from __future__ import annotations

import os

import torch

import zkernel
from tests.support.models import TrickyNet, batches, reference_losses
from zkernel.spec import hookimpl


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


# -- a failed initialize gives the model back ------------------------------------------------------


class FailingDeclaration:
    """Optimizer ``adamw_failing``: adamw whose declaration raises from its ``fail_at``-th call on
    (the first is the capacity check before partitioning; each trainable group placed asks once)."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at

    @hookimpl
    def zkernel_register_optimizers(self, registry):
        from zkernel_plugins.optimizers.adamw import TorchAdamW

        fail_at = self.fail_at

        class Failing(TorchAdamW):
            calls = 0

            @hookimpl
            def zkernel_declare_optimizer(self, numel, param_count):
                Failing.calls += 1
                if Failing.calls >= fail_at:
                    raise RuntimeError("injected: declaration failed after partitioning")
                return super().zkernel_declare_optimizer(numel, param_count)

        registry.add("adamw_failing", Failing, description="adamw failing at its declaration (test)")


class FailingSchedule:
    """LR schedule ``exploding``: raises when the engine asks for the first step's rate (in the engine's
    constructor, after the scheduler hooked every module)."""

    @hookimpl
    def zkernel_register_lr_schedules(self, registry):
        from zkernel.spec.lr_schedule import LRSchedule

        class Exploding(LRSchedule):
            def __init__(self, context) -> None:
                del context

            def hyper(self, applied_steps, base):
                raise RuntimeError("injected: the schedule failed in the engine's constructor")

        registry.add("exploding", Exploding, description="raises (test)")


def model_state(model: torch.nn.Module) -> dict:
    """Everything of ``model`` a failed initialize must give back: values (bitwise), classes, devices, hooks."""
    return {
        "params": {n: (type(p).__name__, str(p.device), p.dtype, p.detach().clone()) for n, p in model.named_parameters()},
        "buffers": {n: (str(b.device), b.dtype, b.clone()) for n, b in model.named_buffers()},
        "modules": [(n, type(m).__name__, "forward" in vars(m)) for n, m in model.named_modules()],
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules()),
        "param_hooks": sum(len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {}) for p in model.parameters()),
    }


def same_state(a: dict, b: dict) -> list[str]:
    """What differs between two `model_state` results (empty when nothing does)."""
    diffs = [k for k in ("modules", "hooks", "param_hooks") if a[k] != b[k]]
    for kind in ("params", "buffers"):
        if a[kind].keys() != b[kind].keys():
            diffs.append(f"{kind} names")
            continue
        for name, (*meta_a, ta) in a[kind].items():
            *meta_b, tb = b[kind][name]
            bitwise = ta.is_meta or torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8))
            if meta_a != meta_b or ta.shape != tb.shape or not bitwise:
                diffs.append(f"{kind} {name}: {meta_a} -> {meta_b}")
    return diffs


def failed_initialize(big: str, small: str | None = None) -> dict:
    """Initialize fails (a disk too small at ``small``, a plugin raising after partitioning, a schedule raising
    in the engine's constructor), each time under zero3 with both roles on NVMe; then the same model trains
    under a valid config on ``big``. Returns what each failure left and the losses, for the test to check."""
    from tests.support.nvme_scenarios import nvme_config, steps

    torch.manual_seed(0)
    model = TrickyNet()
    before = model_state(model)
    valid = nvme_config(big, params="nvme")
    attempts = [
        ("declaration", {**valid, "optimizer": {**valid["optimizer"], "name": "adamw_failing"}}, [FailingDeclaration(3)]),
        ("schedule", {**valid, "lr_schedule": {"name": "exploding"}}, [FailingSchedule()]),
    ]
    if small is not None:
        attempts.insert(0, ("disk", nvme_config(small, params="nvme"), []))
    out: dict = {}
    for name, cfg, plugins in attempts:
        try:
            zkernel.initialize(model, cfg, plugins=plugins)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "diffs": same_state(before, model_state(model))}
        else:
            out[name] = {"error": None, "diffs": []}
    engine = zkernel.initialize(model, valid)
    out["losses"] = steps(engine, 3)
    engine.close()
    torch.manual_seed(0)
    out["reference"] = reference_losses(TrickyNet(), batches(3, 3, 1, 1, 2), 1e-2, 0.1, 0.5)
    out["runs_left"] = sorted(os.listdir(big)) + (sorted(os.listdir(small)) if small is not None else [])
    return out



def forward_fails_on_rank_0(stage: str, batches_run: int = 4) -> dict:
    """zero2 on two ranks: rank 0's model raises inside its forward at the second batch and the loop goes
    on with the next batch, so rank 0 runs one step fewer; both ranks then close. Returns what each saw."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = TrickyNet()
    failing = {"now": False}

    def fail(module, args):
        if failing["now"]:
            raise ValueError("injected: a bad batch in the model's forward")

    model.block.register_forward_pre_hook(fail)
    options = {"persistence_threshold": 0} if stage == "zero3" else {"bucket_size": 300}
    engine = zkernel.initialize(model, {"partitioner": stage, "optimizer": {"lr": 1e-2}, "partitioner_options": options})
    out: dict = {"caught": [], "close": None}
    for i, step in enumerate(batches(3, batches_run, 1, 2, 2)):
        tokens, targets = step[0][rank]
        failing["now"] = rank == 0 and i == 1
        try:
            engine.backward(engine(tokens, targets))
            engine.step()
        except Exception as exc:  # noqa: BLE001 - as a training loop that skips a bad batch
            out["caught"].append(f"{i}: {type(exc).__name__}: {exc}")
            if not isinstance(exc, ValueError):
                break
    try:
        engine.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["close"] = f"{type(exc).__name__}: {exc} " + " ".join(getattr(exc, "__notes__", []))
    out["closed"] = engine.closed
    out["model_trains"] = _trains(model)
    return out


def _trains(model) -> bool:
    """Whether ``model`` runs forward and backward on its own (meta parameters, if any, left out)."""
    if any(p.is_meta for p in model.parameters()):
        return False
    tokens = torch.randint(0, 29, (2, 6))
    model(tokens, tokens).backward()
    return True


if __name__ == "__main__":
    import json
    import sys

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps({"failed_initialize": failed_initialize}[sys.argv[1]](*sys.argv[2:]), default=str))
