"""`initialize`: config -> plugins -> selected components -> partitioned model -> `Engine`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zkernel.config import Config, load_config
from zkernel.distributed import init_distributed
from zkernel.engine import Engine
from zkernel.groups import ParamGroup
from zkernel.log import get_logger
from zkernel.plugin_manager import (
    collect_components,
    get_plugin_manager,
    new_plugin_manager,
    resolve_components,
)
from zkernel.runtime import RuntimeContext

log = get_logger()

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _move_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Buffers go to the compute device; floating ones take the compute dtype (as ``module.half()`` would)."""
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is None:
                continue
            if buf.is_meta:
                raise ValueError(
                    f"buffer {name!r} of {type(mod).__name__} is on the meta device; build buffers on a "
                    "real device (only parameters may be left on meta for zero3 to materialise)"
                )
            mod._buffers[name] = buf.to(device=device, dtype=dtype if buf.is_floating_point() else buf.dtype)


def _check_groups(module: nn.Module, groups: list[ParamGroup], partitioner: str) -> None:
    owner: dict[int, str] = {}
    for group in groups:
        for p in group.params:
            if id(p) in owner:
                raise RuntimeError(
                    f"partitioner {partitioner!r} put a parameter in groups {owner[id(p)]!r} and {group.name!r}"
                )
            owner[id(p)] = group.name
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        raise RuntimeError(
            f"partitioner {partitioner!r} left trainable parameters out of every group: {missing[:5]}"
        )


def initialize(
    model: nn.Module,
    config: Config | Mapping[str, Any] | str | None = None,
    *,
    plugins: Sequence[Any] = (),
) -> Engine:
    """Wrap ``model`` for training under ``config`` (dict, .json/.toml path or `Config`).

    ``plugins`` are extra plugin objects or modules with ``@zkernel.hookimpl``
    functions; their components are selectable by name like the builtins.
    Every rank of a torchrun job must call this with the same model and config.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"zkernel.initialize expects a torch.nn.Module, got {type(model).__name__}")
    cfg = load_config(config)
    installed = get_plugin_manager(plugins, config=cfg)
    selection = resolve_components(collect_components(installed), cfg)
    dist_info = init_distributed()
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    compute_dtype = COMPUTE_DTYPES[cfg.precision]

    def context(options: Any = None) -> RuntimeContext:
        return RuntimeContext(config=cfg, dist=dist_info, compute_dtype=compute_dtype, options=options)

    runtime = new_plugin_manager(trace=cfg.trace_hooks)
    components = {
        f"partitioner:{selection.partitioner.name}": selection.partitioner.factory(
            context(selection.partitioner_options)
        ),
        f"optimizer:{selection.optimizer.name}": selection.optimizer.factory(
            context(selection.optimizer_options)
        ),
        f"tier:{selection.optimizer_tier.name}:optimizer": selection.optimizer_tier.factory(
            context(selection.tier_options), "optimizer"
        ),
        f"tier:{selection.params_tier.name}:params": selection.params_tier.factory(
            context(selection.tier_options), "params"
        ),
    }
    for name, component in components.items():
        runtime.register(component, name=name)
    runtime.check_pending()

    _move_buffers(model, dist_info.device, compute_dtype)
    groups = runtime.hook.zkernel_partition_params(module=model, context=context(selection.partitioner_options))
    if groups is None:
        raise RuntimeError(f"partitioner {cfg.partitioner!r} returned no parameter groups")
    _check_groups(model, groups, cfg.partitioner)
    log.info(
        "zkernel.initialized",
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        device=str(dist_info.device),
        partitioner=cfg.partitioner,
        optimizer=cfg.optimizer.name,
        precision=cfg.precision,
        groups=len(groups),
    )
    return Engine(model, cfg, dist_info, runtime, groups, compute_dtype)


def consolidate(directory) -> dict[str, torch.Tensor]:
    """Rebuild a full fp32 state dict from a checkpoint directory (no process group needed)."""
    raise NotImplementedError(
        "zkernel.consolidate is not implemented yet (checkpointing lands with its own issue)"
    )
