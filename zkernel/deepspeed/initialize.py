"""`initialize`, `init_distributed` and `add_config_arguments`, with DeepSpeed's signatures."""

from __future__ import annotations

import copy
import datetime
import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from zkernel.compat.deepspeed.config import from_deepspeed_config, read_deepspeed_json
from zkernel.compat.torch_optim import Origin, TorchAdam
from zkernel.deepspeed import zero
from zkernel.deepspeed.engine import DeepSpeedEngine, _ClientScheduler
from zkernel.errors import ConfigError
from zkernel.kernel.bootstrap import initialize as zkernel_initialize

_CLIENT = Origin(
    whose="the client",
    instead="give the optimizer as the config's 'optimizer' section (Adam/AdamW)",
)


def add_config_arguments(parser):
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` (and the older ``--deepscale`` names) to an
    ``argparse`` parser; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (zkernel)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config")
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     init_method: str | None = None, dist_init_required: bool | None = None, config=None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Join the process group torchrun describes (an existing one is kept); alone without one.

    ``dist_backend`` defaults to NCCL with CUDA, gloo without. MPI discovery is not offered:
    launch with torchrun (or the ``deepspeed`` launcher, which sets the same variables).
    """
    if dist.is_initialized() or dist_init_required is False:
        return
    world = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and init_method is None:
        return  # one process: zkernel runs without a process group
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout, "init_method": init_method}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(**kwargs)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """``(engine, optimizer, training_dataloader, lr_scheduler)``, as DeepSpeed's ``initialize``.

    The config comes from ``config``, ``config_params`` or ``args.deepspeed_config`` (a dict or a
    path to the JSON). ``optimizer``: None (the config's ``optimizer`` section), or a
    ``torch.optim.AdamW``/``Adam`` over the model's parameters whose class and parameter groups become
    that section and its per-group overrides (`zkernel.compat.torch_optim`).
    ``lr_scheduler``: None (the config's ``scheduler`` section), or a torch lr scheduler over that
    optimizer, stepped after each optimizer step of the engine. ``training_data``: a dataset,
    loaded in micro-batches (a ``DistributedSampler`` across ranks). ``mpu`` and ``mesh_param``
    (model parallelism) are not offered.
    """
    if model is None:
        raise ValueError("zkernel.deepspeed.initialize needs a model")
    if mpu is not None or mesh_param is not None:
        raise ValueError("zkernel.deepspeed.initialize: mpu and mesh_param (model or sequence parallelism) are not "
                         "supported; zkernel trains data parallel")
    raw = _read_config(args, config, config_params)
    client = None
    if optimizer is not None:
        if "optimizer" in raw:
            raise ConfigError("an optimizer was passed to initialize and the config has an 'optimizer' section too; "
                              "keep one of them (as DeepSpeed asserts)")
        client = TorchAdam(optimizer, model, _CLIENT)
        raw["optimizer"] = client.deepspeed_section()
    if lr_scheduler is not None:
        if "scheduler" in raw:
            raise ConfigError("an lr_scheduler was passed to initialize and the config has a 'scheduler' section "
                              "too; keep one of them")
        if not isinstance(optimizer, torch.optim.Optimizer) or getattr(lr_scheduler, "optimizer", None) is not optimizer:
            raise TypeError("lr_scheduler must be a torch lr scheduler over the torch optimizer passed with it "
                            f"(got {type(lr_scheduler).__name__}); or give the schedule as the config's 'scheduler' "
                            "section (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)")
    _check_model_parameters(model_parameters)
    zk_config = from_deepspeed_config(raw)
    if client is not None:
        zk_config = attrs.evolve(zk_config, optimizer=client.with_groups(zk_config.optimizer))
    engine = zkernel_initialize(model, zk_config)
    zero.track(engine)
    _set_ds_sizes(engine)
    micro = _micro_batch(raw, engine.config.gradient_accumulation_steps, engine.dist.world_size)
    schedule = _ClientScheduler(engine, lr_scheduler, client) if lr_scheduler is not None else None
    wrapped = DeepSpeedEngine(engine, micro, client_scheduler=schedule)
    loader = None
    if training_data is not None:
        loader = _dataloader(training_data, micro, collate_fn, raw, engine.dist)
    return wrapped, wrapped.optimizer, loader, wrapped.lr_scheduler


def _set_ds_sizes(engine) -> None:
    """``ds_numel`` and ``ds_shape`` on every parameter, the whole sizes DeepSpeed's ZeRO-3 parameters
    carry (a released parameter's own ``numel()`` is 0): what scripts count parameters or FLOPs with."""
    for name, param in engine.module.named_parameters():
        shape = engine.original_tensors.get(name, (param.shape, param.dtype))[0]
        param.ds_shape = torch.Size(shape)
        param.ds_numel = torch.Size(shape).numel()


def _read_config(args, config, config_params) -> dict[str, Any]:
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = [c for c in (config, config_params) if c is not None]
    if len(given) > 1:
        raise ValueError("pass the config once: config or config_params")
    if given and from_args is not None:
        raise ValueError("the config was passed both to initialize and as args.deepspeed_config; keep one "
                         "(as DeepSpeed asserts)")
    source = given[0] if given else from_args
    if source is None:
        raise ValueError("zkernel.deepspeed.initialize needs a DeepSpeed config: config=dict or path, "
                         "config_params=..., or args.deepspeed_config")
    source = read_deepspeed_json(source)
    if not isinstance(source, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a mapping or a path, got {type(source).__name__}")
    return copy.deepcopy(dict(source))


def _check_model_parameters(model_parameters) -> None:
    if model_parameters is None:
        return
    if isinstance(model_parameters, (list, tuple)) and model_parameters and isinstance(model_parameters[0], Mapping):
        extra = sorted({k for g in model_parameters for k in g if k != "params"})
        if extra:
            raise ValueError(f"model_parameters with per-group settings {extra} cannot be mapped: pass "
                             "optimizer=torch.optim.AdamW(those groups) instead, or give them as the config's "
                             "[optimizer] param_groups (or no_weight_decay) patterns; the engine trains every "
                             "parameter that requires grad")


def _micro_batch(raw: Mapping[str, Any], accumulation: int, world: int) -> int:
    micro = raw.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int):
        return micro
    batch = raw.get("train_batch_size")
    if isinstance(batch, int):
        return max(1, batch // (accumulation * world))
    return 1


def _dataloader(data, micro: int, collate_fn, raw: Mapping[str, Any], dist_info):
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if dist_info.world_size > 1:
        sampler = DistributedSampler(data, num_replicas=dist_info.world_size, rank=dist_info.rank)
    else:
        sampler = RandomSampler(data)
    return DataLoader(data, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                      drop_last=bool(raw.get("dataloader_drop_last", False)))
