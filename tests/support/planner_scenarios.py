"""Per-rank runs of the automatic-placement tests (executed inside spawned processes)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from structlog.testing import capture_logs

import zkernel
from tests.support.models import TrickyNet
from tests.support.scenarios import _train_steps


def auto_placement(config: dict, failing: dict, steps: int, accum: int, micro: int, seed: int) -> dict:
    """``failing`` must raise on every rank; then ``config`` trains TrickyNet. What each rank saw."""
    dist.init_process_group("gloo")  # zkernel reuses it (its own default group is not re-created per test)
    logging.getLogger("zkernel").setLevel(logging.INFO)
    torch.manual_seed(seed)
    model = TrickyNet()
    try:
        zkernel.initialize(model, failing)
        error = None
    except zkernel.ConfigError as exc:
        error = (type(exc).__name__, str(exc))
    with capture_logs() as events:
        engine = zkernel.initialize(model, config)
    losses = _train_steps(engine, steps, accum, micro, seed)
    plan = engine.placement_plan
    cfg = engine.config
    result = {
        "error": error,
        "losses": losses,
        "plan": plan.event(),
        "resolved": (cfg.partitioner, cfg.offload.optimizer, cfg.offload.params, dict(cfg.offload.optimizer_options)),
        "memory": engine.memory_report(),
        "planned_events": [e for e in events if e["event"] == "zkernel.placement.planned"],
    }
    engine.close()
    return result
