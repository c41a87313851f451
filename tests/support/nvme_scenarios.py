"""Runs for the NVMe tier tests that need a process of their own (spawned ranks, killed or limited processes)."""

from __future__ import annotations

import os
import resource
import signal
import sys
from pathlib import Path

import torch

import zkernel
from tests.support.models import TrickyNet, batches

RUN_GLOB = "zkernel-run-*"


def nvme_config(nvme_path, *, optimizer="nvme", params="none", stage="zero3", name="adamw", clip=0.5,
                precision="fp32", accum=1, **tier_options) -> dict:
    """A small fp32 config with the given tiers; ``tier_options`` go to both roles' nvme options."""
    cfg = {
        "partitioner": stage,
        "precision": precision,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "optimizer": {"name": name, "lr": 1e-2, "weight_decay": 0.1},
        "offload": {"optimizer": optimizer, "params": params, "nvme_path": str(nvme_path)},
    }
    if stage == "zero3":
        cfg["partitioner_options"] = {"persistence_threshold": 0}
    else:
        cfg["partitioner_options"] = {"bucket_size": 300}
    for role, tier in (("optimizer", optimizer), ("params", params)):
        if tier == "nvme":
            cfg["offload"][f"{role}_options"] = {"aio_threads": 2, **tier_options}
    if optimizer in ("nvme", "cpu"):
        # The host and disk paths are what these scenarios test: no GPU share (on CUDA the default,
        # "auto", moves a small model's optimizer to the GPU after the first step).
        cfg["offload"]["optimizer_options"] = {"gpu_share": 0.0, **cfg["offload"].get("optimizer_options", {})}
    return cfg


def steps(engine, count: int, seed: int = 3, start: int = 0) -> list[float]:
    """``count`` training steps of TrickyNet on world-1 data (batches ``start`` .. ``start + count``)."""
    data = batches(seed, start + count, 1, 1, 2)[start:]
    losses = []
    for step in data:
        tokens, targets = step[0][0]
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def closed_params(cfg: dict, count: int) -> dict[str, torch.Tensor]:
    """The parameters ``engine.close()`` gives back after ``count`` steps under ``cfg``."""
    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, cfg)
    steps(engine, count)
    engine.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _wait_writes(engine) -> None:
    engine.pipeline.wait_all()
    for tier in (engine.optimizer_tier, engine.params_tier):
        if hasattr(tier, "wait_writes"):
            tier.wait_writes()


def write_failure(nvme_path: str, role: str, **tier_options) -> dict:
    """The disk refuses writes (RLIMIT_FSIZE) from step 3 on: the error names the file, and closing the
    engine gives back the model of exactly three steps (nothing lost or read back half-written).

    Also: a file size limit below a swap file's size at `initialize` fails its pre-allocation.
    ``tier_options`` go to the nvme role's options. Returns what happened, for the test to check."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    cfg = nvme_config(nvme_path, optimizer="nvme" if role == "optimizer" else "cpu",
                      params="nvme" if role == "params" else "none", **tier_options)
    # No gather ahead (the reads come from the rescue copies where a parameter write failed).
    cfg["prefetch_bytes"] = 0
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    out: dict = {}
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))
    try:
        zkernel.initialize(TrickyNet(), cfg)
    except zkernel.ConfigError as exc:
        out["preallocate_error"] = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["left_after_failed_init"] = sorted(p.name for p in Path(nvme_path).glob(RUN_GLOB))

    expected = {3: closed_params(cfg, 3)}
    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, cfg)
    steps(engine, 2)
    _wait_writes(engine)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:  # the write-backs of step 3 fail; the error comes from the next step, which no rank takes
        steps(engine, 1, start=2)
        _wait_writes(engine)
        steps(engine, 2, start=3)
    except OSError as exc:
        out["error"] = str(exc)
        out["errno"] = exc.errno
        out["notes"] = list(getattr(exc, "__notes__", []))
        out["filename"] = exc.filename
        out["steps"] = engine.global_steps
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    engine.close()
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    done = expected[out.get("steps", 0)] if out.get("steps") in expected else {}
    out["same_as_clean_steps"] = bool(done) and all(torch.equal(got[n], done[n]) for n in done)
    out["left_after_close"] = sorted(p.name for p in Path(nvme_path).glob(RUN_GLOB))
    return out


def write_failures(nvme_path: str) -> dict:
    """`write_failure` for the optimizer role, then the params role, each in a directory of its own."""
    out = {}
    for role in ("optimizer", "params"):
        path = Path(nvme_path) / role
        path.mkdir()
        out[role] = write_failure(str(path), role)
    return out


def _live_run(nvme_path: str) -> None:
    """Train one step, say where the run directory is, and wait to be killed."""
    engine = zkernel.initialize(TrickyNet(), nvme_config(nvme_path, params="nvme"))
    steps(engine, 1)
    print(engine.optimizer_tier.run_dir.path, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or kills us)


def _clean_exit(nvme_path: str) -> None:
    """Train and exit without `Engine.close`: zkernel removes the run directory at exit."""
    engine = zkernel.initialize(TrickyNet(), nvme_config(nvme_path, params="nvme"))
    steps(engine, 2)
    print(engine.optimizer_tier.run_dir.path, flush=True)


def _fenced_paths(readonly: str, small: str) -> None:
    """Inside a private mount namespace: a read-only directory and a 1 MiB disk."""
    for path, what in ((readonly, "read-only"), (small, "small")):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        try:
            zkernel.initialize(model, nvme_config(path, stage="zero2"))
        except zkernel.ConfigError as exc:
            print(f"{what}: {exc}", flush=True)
        else:
            print(f"{what}: no error", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"live_run": _live_run, "clean_exit": _clean_exit, "fenced_paths": _fenced_paths}[sys.argv[1]](*sys.argv[2:])
