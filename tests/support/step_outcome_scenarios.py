"""Runs for tests/kernel/test_step_outcome.py on spawned gloo ranks: a non-finite loss with clipping off, and a
swap-file write that fails (RLIMIT_FSIZE in one rank's process) in the middle of a step."""

from __future__ import annotations

import os
import resource
import signal
import time

import structlog
import torch

import zkernel
from tests.support.models import TrickyNet, batches
from tests.support.nvme_scenarios import nvme_config

LR, WD = 1e-2, 0.1


def _world_rank() -> tuple[int, int]:
    """From the launcher's environment: the process group forms only at the first `zkernel.initialize`."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def _closed(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().float() for n, p in model.named_parameters()}


def _nonfinite_run(cfg: dict, data, poison_ranks, poison_step: int | None, where: str) -> dict:
    world, rank = _world_rank()
    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, cfg)
    poison = {"on": False}
    # The embedding's gradient lands last: every other group may have stepped during backward by then.
    engine.module.embed.weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    with structlog.testing.capture_logs() as logs:
        for i, step in enumerate(data):
            tokens, targets = step[0][rank]
            loss = engine(tokens, targets)
            injected = i == poison_step and rank in poison_ranks
            poison["on"] = injected and where == "embed"
            if injected and where == "loss":
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            poison["on"] = False
    out = {
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "early_steps": engine.pipeline.early_steps,
        "rollbacks": engine.pipeline.rollbacks,
        "warnings": [e for e in logs if e.get("event") == "zkernel.step.nonfinite" and e.get("log_level") == "warning"],
    }
    engine.close()
    out["params"] = _closed(model)
    return out


def nonfinite_loss(precision: str, offload: str, poison_ranks: tuple[int, ...], where: str, steps: int = 4,
                   poison_step: int = 2) -> dict:
    """Clipping off: one step's loss (or only the embedding's gradient) is NaN on ``poison_ranks``; then
    the same run without that batch (what torch that skipped it gives)."""
    world, _ = _world_rank()
    cfg = {"partitioner": "zero2", "precision": precision, "gradient_clipping": 0.0,
           "partitioner_options": {"bucket_size": 300},
           "optimizer": {"name": "cpu_adam" if offload != "none" else "adamw", "lr": LR, "weight_decay": WD},
           "offload": {"optimizer": offload}}
    data = batches(5, steps, 1, world, 2)
    poisoned = _nonfinite_run(cfg, data, poison_ranks, poison_step, where)
    clean = _nonfinite_run(cfg, data[:poison_step] + data[poison_step + 1 :], (), None, where)
    return {"poisoned": poisoned, "clean": clean}


def write_failure_mid_step(nvme_path: str, clip: float, fail_rank: int, steps: int = 6, fail_step: int = 2,
                           accum: int = 1) -> dict:
    """Every rank trains on the nvme optimizer tier; on ``fail_rank`` the disk refuses writes
    (RLIMIT_FSIZE) from the middle of step ``fail_step``'s last backward until the error reaches the
    script, which lifts the limit and runs the window's micro-batches again, as the error says."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    world, rank = _world_rank()
    cfg = nvme_config(nvme_path, stage="zero2", clip=clip, accum=accum)
    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, cfg)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    armed = {"on": False}

    def refuse_writes(grad):  # mid-backward: groups that landed earlier have stepped (clipping 0)
        if armed["on"] and rank == fail_rank:
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
            armed["on"] = False
        return grad

    engine.module.block[0].weight.register_hook(refuse_writes)
    data = batches(7, steps, accum, world, 2)
    errors, refused, i, start = [], [], 0, time.monotonic()
    try:
        while i < steps:
            try:
                for m, micro in enumerate(data[i]):
                    tokens, targets = micro[rank]
                    armed["on"] = i == fail_step and m == accum - 1 and not errors
                    loss = engine(tokens, targets)
                    engine.backward(loss)
                    engine.step()
            except OSError as exc:
                if _failed_window(engine, exc, i, errors, refused, (soft, hard)):
                    break
                continue  # run the window again
            i += 1
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out = {"errors": errors, "refused": refused, "global_steps": engine.global_steps,
           "early_steps": engine.pipeline.early_steps, "seconds": time.monotonic() - start}
    engine.close()
    out["params"] = _closed(model)
    return out


WARMUP = {"name": "warmup", "warmup_type": "linear", "warmup_min_lr": LR / 10, "warmup_num_steps": 3}


def nonfinite_flag(stage: str, precision: str, steps: int = 5, poison_step: int = 2, poison_rank: int = 1,
                   implementation: str = "auto") -> dict:
    """Every group steps on the compute device with clipping off, the norm not read ([Note: a non-finite
    flag read one step late]; on a CPU the test asks for that path, on a GPU it is the default): one
    element of the embedding's gradient is NaN on ``poison_rank`` at ``poison_step`` only, so with
    sharded gradients only the rank that owns it sees it before the flag's all-reduce."""
    world, rank = _world_rank()
    cfg = {"partitioner": stage, "precision": precision, "gradient_clipping": 0.0,
           "optimizer": {"name": "adamw", "lr": LR, "weight_decay": WD, "implementation": implementation},
           "lr_schedule": WARMUP}
    if stage != "zero3":
        cfg["partitioner_options"] = {"bucket_size": 300}
    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, cfg)
    if engine.device.type == "cpu":
        engine.scaling.norm_is_free = False  # as on a GPU: the norm would cost a host wait ([Note: non-finite gradients])
    poison = {"on": False}

    def one_nan(grad):
        if not poison["on"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    engine.module.embed.weight.register_hook(one_nan)
    data = batches(5, steps, 1, world, 2)
    pending_after_poison = None
    with structlog.testing.capture_logs() as logs:
        for i, step in enumerate(data):
            tokens, targets = step[0][rank]
            loss = engine(tokens, targets)
            poison["on"] = i == poison_step and rank == poison_rank
            engine.backward(loss)
            poison["on"] = False
            engine.step()
            if i == poison_step:  # not read yet: the host learns it before the next step
                pending_after_poison = engine.pipeline.found_inf_pending
    out = {
        "device": str(engine.device),
        "pending_after_poison": pending_after_poison,
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "lr": engine.lr,
        "last_grad_norm": engine.last_grad_norm,
        "warnings": [e for e in logs if e.get("event") == "zkernel.step.nonfinite"],
    }
    engine.close()
    out["params"] = {n: t.cpu() for n, t in _closed(model).items()}
    return out


def params_write_failure(nvme_path: str, optimizer: str, clip: float, fail_rank: int, steps: int = 5,
                         fail_step: int = 2) -> dict:
    """zero3 with the parameters swapped to NVMe: on ``fail_rank`` the disk refuses writes (RLIMIT_FSIZE)
    from step ``fail_step``'s ``step()``, so its parameter shards' writes fail after that step's outcome
    was agreed; the script lifts the limit when the error reaches it and runs the window again."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    world, rank = _world_rank()
    cfg = nvme_config(nvme_path, optimizer=optimizer, params="nvme", stage="zero3", clip=clip,
                      name="cpu_adam" if optimizer == "cpu" else "adamw")
    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, cfg)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    data = batches(7, steps, 1, world, 2)
    errors, refused, i = [], [], 0
    try:
        while i < steps:
            try:
                tokens, targets = data[i][0][rank]
                loss = engine(tokens, targets)
                engine.backward(loss)
                if i == fail_step and rank == fail_rank and not errors:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))  # the disk is full from now on
                engine.step()
            except OSError as exc:
                if _failed_window(engine, exc, i, errors, refused, (soft, hard)):
                    break
                continue  # run the window again
            i += 1
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out = {"errors": errors, "refused": refused, "global_steps": engine.global_steps}
    engine.close()
    out["params"] = _closed(model)
    return out


def _failed_window(engine, exc: OSError, batch: int, errors: list, refused: list, limits: tuple[int, int]) -> bool:
    """Note a window whose step failed with ``exc``, free the disk (``limits``: RLIMIT_FSIZE's), and
    check that ``step()`` again without the window's backward is refused; True: stop (three failures)."""
    errors.append({"batch": batch, "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                   "errno": exc.errno, "filename": exc.filename, "notes": list(getattr(exc, "__notes__", []))})
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)  # space freed
    try:  # step() again, without the window's backward, is refused on every rank alike
        engine.step()
    except RuntimeError as again:
        refused.append(str(again))
    return len(errors) > 2
