"""`initialize`: config -> plugins -> selected components -> partitioned, placed model -> `Engine`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.kernel import lifecycle
from zkernel.platform import native
from zkernel.spec.config import Config, ConfigError, auto_keys
from zkernel.kernel.config_source import load_config
from zkernel.platform.distributed import init_distributed, local_world_size
from zkernel.kernel.engine import Engine
from zkernel.kernel.engine_parts import EngineParts
from zkernel.spec.groups import OptimizerDeclaration, ParamGroup
from zkernel.telemetry.log import get_logger
from zkernel.spec.lr_schedule import LRSchedule
from zkernel.spec.registry import MATERIALIZES_META, PARAMS_ON_TIER, PER_PARAM_HYPER, Family
from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager, new_plugin_manager, resolve_components
from zkernel.spec.runtime import RuntimeContext
from zkernel.platform.streams import Streams
from zkernel.telemetry.timeline import Timeline
from zkernel.spec.tiers import Capacity, OptimizerTier, ParamsTier, PlacementInfo, Resource, check_capacity
from zkernel.kernel.transforms import apply_transforms, register_transforms
from zkernel.kernel.param_hyper import mark_overrides, param_overrides
from zkernel.kernel.restore_point import RestorePoint

log = get_logger()

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _move_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype, materializers: Sequence[str] = ()) -> None:
    """Buffers go to the compute device; floating ones take the compute dtype (as ``module.half()`` would).

    ``materializers``: the installed partitioners that materialise a meta-device model (named in the error)."""
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is None:
                continue
            if buf.is_meta:
                path = next(p for p, m in module.named_modules() if m is mod)
                which = f"the {' or '.join(materializers)} partitioner" if materializers else "a partitioner (none installed)"
                raise ValueError(
                    f"buffer {f'{path}.{name}' if path else name!r} of {type(mod).__name__} is on the meta "
                    f"device: only {which} materialises a meta-device model (pass init_fn= "
                    "when the module has no reset_parameters()); otherwise build the model on a real device"
                )
            mod._buffers[name] = buf.to(device=device, dtype=dtype if buf.is_floating_point() else buf.dtype)


def _check_meta_params(module: nn.Module, partitioner: str, materializers: Sequence[str]) -> None:
    """A model with parameters on the meta device needs a partitioner that builds them: say which do."""
    if partitioner in materializers:
        return
    meta = next((n for n, p in module.named_parameters() if p.is_meta), None)
    if meta is not None:
        which = ", ".join(materializers) or "none installed"
        raise ConfigError(
            f"parameter {meta!r} is on the meta device and partitioner {partitioner!r} does not materialise a "
            f"meta-device model; valid: a partitioner that does ({which}), or the model built on a real device"
        )


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


def _declares(hook, numel: int = 1, param_count: int = 1) -> OptimizerDeclaration:
    """The selected optimizer's declaration for a group of ``numel`` elements in ``param_count`` parameters."""
    declared = hook.zkernel_declare_optimizer(numel=numel, param_count=param_count)
    return declared if declared is not None else OptimizerDeclaration(state=(), can_rollback=False)


def _component(obj: Any, interface: type, key: str, name: str) -> Any:
    if not isinstance(obj, interface):
        raise TypeError(
            f"{key} {name!r} built a {type(obj).__name__}, which does not implement "
            f"{interface.__module__}.{interface.__name__}"
        )
    return obj


def _roomier_tiers(model: nn.Module, cfg: Config, registry, installed, device: torch.device) -> list[str]:
    """Offload settings that keep a role's state further from the device than the selected tier does,
    from the installed tiers' own answers (`zkernel_size_offload_tier`): what a capacity error suggests."""
    from zkernel.kernel.sizing import Estimator

    if installed is None:
        return []
    sizing = Estimator(model, device.type, installed, registry)
    roles = ["optimizer"]
    if cfg.partitioner in registry.with_capability(Family.PARTITIONER, PARAMS_ON_TIER):
        roles.append("params")
    out = []
    for role in roles:
        selected = sizing.tier(getattr(cfg.offload, role), role)
        level = selected.level if selected is not None else 0
        for name in sizing.answering_tiers(role):
            answer = sizing.tier(name, role)
            if answer is not None and answer.level > level:
                out.append(f"offload.{role} = {name!r}")
    return out


class _Placer:
    """Places each group the partitioner yields in the tiers; `check_capacity` before the partitioner runs.

    Nothing is moved before the capacity check: the demands follow from the model's shapes and the
    number of ways its state is sharded. Before partitioning that is taken as the world size (the least
    any partitioner needs per rank; exact for every partitioner on one rank); the first group shows how
    the partitioner really shards, and where that is fewer ways the check runs again before it is placed.
    """

    def __init__(
        self, hook, optimizer_tier: OptimizerTier, params_tier: ParamsTier, model: nn.Module, context, alternatives=None
    ) -> None:
        self.hook = hook
        self.alternatives = alternatives  # offload settings with more room, named when nothing fits
        self.optimizer_tier = optimizer_tier
        self.params_tier = params_tier
        optimizer_tier.pair(params_tier)
        self.context = context
        self.trainable_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.total_numel = sum(p.numel() for p in model.parameters())
        self.trainable_params = sum(p.requires_grad for p in model.parameters())
        self.can_rollback = True
        self.skips_params = True
        self.takes_found_inf = True
        self._checked_shards: int | None = None

    def place(self, groups: Iterable[ParamGroup]) -> list[ParamGroup]:
        placed = []
        for group in groups:
            if not placed:
                self._recheck_capacity(group)
            if group.param_shard is not None:
                group.param_shard = self.params_tier.adopt(group, group.param_shard)
            if group.requires_grad:
                if group.master is None:
                    raise RuntimeError(f"partitioner gave trainable group {group.name!r} no initial master")
                group.shard_layout = self.hook.zkernel_describe_shard(group=group)
                declaration = self._declaration(group.master.numel(), len(group.params))
                self.can_rollback &= declaration.can_rollback
                self.skips_params &= declaration.skips_params
                self.takes_found_inf &= declaration.takes_found_inf
                self.optimizer_tier.adopt(group, group.master, declaration.state)
            placed.append(group)
        return placed

    def _declaration(self, numel: int, param_count: int) -> OptimizerDeclaration:
        return _declares(self.hook, numel, param_count)

    def _recheck_capacity(self, first: ParamGroup) -> None:
        """Check again where the partitioner shards fewer ways than `check_capacity` assumed."""
        sharded = first.grad_is_shard or (first.param_shard is not None and first.param_shard.numel() < first.numel)
        shards = self.context.world_size if sharded else 1
        if shards != self._checked_shards:
            self.check_capacity(shards)

    def check_capacity(self, shards: int) -> None:
        """Raise `ConfigError` when the tiers' demands for the model's state over ``shards`` ranks do not fit."""
        self._checked_shards = shards
        ctx = self.context
        declaration = self._declaration(max(1, -(-self.trainable_numel // shards)), max(1, self.trainable_params))
        demands: dict[Resource, int] = {}
        parts = (
            self.optimizer_tier.demand(-(-self.trainable_numel // shards), declaration.state, ctx.compute_dtype),
            self.params_tier.demand(-(-self.total_numel // shards), ctx.compute_dtype),
        )
        for part in parts:
            for resource, nbytes in part.items():
                demands[resource] = demands.get(resource, 0) + nbytes
        nvme = ctx.config.offload.nvme_path
        check_capacity(demands, Capacity.measure(ctx.device, nvme), local_world_size(ctx.dist), self.alternatives)


def initialize(
    model: nn.Module,
    config: Config | Mapping[str, Any] | str | None = None,
    *,
    plugins: Sequence[Any] = (),
    init_fn: Callable[[nn.Module], Any] | None = None,
) -> Engine:
    """Wrap ``model`` for training under ``config`` (dict, .json/.toml path or `Config`).

    ``plugins`` are extra plugin objects or modules with ``@zkernel.spec.hookimpl``
    functions; their components are selectable by name like the builtins.
    ``init_fn(module)`` initialises a module of a model built on the meta device
    when the partitioner materialises it, after the module's own ``reset_parameters()``
    (as eager construction followed by that initialiser; for a Hugging Face model pass
    ``model._init_weights``). Every rank of a torchrun
    job must call this with the same model and config. The model belongs to
    the engine until `Engine.close`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"zkernel.initialize expects a torch.nn.Module, got {type(model).__name__}")
    cfg = load_config(config)
    installed = get_plugin_manager(plugins, config=cfg)
    registry = collect_components(installed)
    # With "auto" values the planner resolves them once the ranks can agree (`zkernel.kernel.planning`);
    # every other name and option is checked now, before the process group exists.
    selection = resolve_components(registry, cfg, skip=auto_keys(cfg))
    lifecycle.claim(model, f"partitioner {cfg.partitioner!r}")
    restore_point = RestorePoint.take(model)  # [Note: a failed initialize gives the model back]
    try:
        return _build(model, cfg, selection, init_fn, registry, installed)
    except BaseException:
        restore_point.restore()
        lifecycle.release(model)
        raise


def _build(model: nn.Module, cfg: Config, selection, init_fn, registry, installed=None) -> Engine:
    dist_info = init_distributed(timeout_s=cfg.collective_timeout)
    if dist_info.created_group:
        lifecycle.own_process_group()
    native.share_cores(local_world_size(dist_info))
    plan = None
    if auto_keys(cfg):
        from zkernel.kernel.planning import resolve_auto

        cfg, plan = resolve_auto(model, cfg, registry, dist_info, installed)
        selection = resolve_components(registry, cfg)
    _check_meta_params(model, cfg.partitioner, registry.with_capability(Family.PARTITIONER, MATERIALIZES_META))
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    compute_dtype = COMPUTE_DTYPES[cfg.precision]
    worker = ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="zkernel-host", initializer=_bind_device, initargs=(dist_info.device,)
    )
    timeline = Timeline(dist_info.device, enabled=cfg.timeline, trace_path=cfg.timeline_path, rank=dist_info.rank)
    streams = Streams.for_device(dist_info.device)
    base = RuntimeContext(
        config=cfg,
        dist=dist_info,
        compute_dtype=compute_dtype,
        streams=streams,
        host_worker=worker,
        timeline=timeline,
        init_fn=init_fn,
    )
    tiers: list = []  # built so far: closed again if initialize fails (swap files, I/O threads)
    try:
        return _assemble(model, cfg, selection, base, tiers, plan, registry, installed)
    except BaseException:
        for tier in reversed(tiers):
            try:
                tier.close()
            except Exception as exc:  # noqa: BLE001 - the original error is the one to raise
                log.warning("zkernel.initialize.cleanup_failed", tier=type(tier).__name__, error=str(exc))
        worker.shutdown(wait=False)
        raise


def _assemble(
    model: nn.Module, cfg: Config, selection, base: RuntimeContext, tiers: list, plan, registry, installed=None
) -> Engine:
    """Build the selected components on ``base``, partition and place the model, make the engine."""
    dist_info, compute_dtype, worker = base.dist, base.compute_dtype, base.host_worker
    streams, timeline = base.streams, base.timeline
    optimizer = selection["optimizer.name"].build(base)
    tiers.append(selection["offload.optimizer"].build(base))
    optimizer_tier = _component(tiers[-1], OptimizerTier, "offload.optimizer", cfg.offload.optimizer)
    tiers.append(selection["offload.params"].build(base))
    params_tier = _component(tiers[-1], ParamsTier, "offload.params", cfg.offload.params)
    schedule = selection["lr_schedule.name"].build(base)
    lr_schedule = _component(schedule, LRSchedule, "lr_schedule.name", cfg.lr_schedule.name)
    placement = PlacementInfo(
        masters_on_compute_device=optimizer_tier.masters_on_compute_device,
        params_on_compute_device=params_tier.on_compute_device,
    )
    partition_context = attrs.evolve(base, placement=placement)
    partitioner = selection["partitioner"].build(partition_context)

    runtime = new_plugin_manager(trace=cfg.trace_hooks)
    runtime.register(partitioner, name=f"partitioner:{cfg.partitioner}")
    runtime.register(optimizer, name=f"optimizer:{cfg.optimizer.name}")
    runtime.register(optimizer_tier, name=f"tier:{cfg.offload.optimizer}:optimizer")
    if params_tier is not optimizer_tier:
        runtime.register(params_tier, name=f"tier:{cfg.offload.params}:params")
    register_transforms(runtime, selection, base)
    runtime.check_pending()

    overrides = param_overrides(model, cfg.optimizer)  # by the user's names, before transforms
    if overrides and not _declares(runtime.hook).per_param_hyper:
        able = registry.with_capability(Family.OPTIMIZER, PER_PARAM_HYPER)
        raise ConfigError(
            f"optimizer.param_groups and no_weight_decay need an optimizer that steps some parameters with "
            f"their own learning rate, weight decay, betas and eps; optimizer {cfg.optimizer.name!r} does not declare it "
            f"(OptimizerDeclaration.per_param_hyper); valid: {', '.join([*able, 'or neither key'])}"
        )
    apply_transforms(runtime, model, selection, base)  # tiling, activation checkpointing
    original_dtypes = tuple((n, p.dtype) for n, p in model.named_parameters())
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    original_tensors = tuple(
        (n, tuple(t.shape), t.dtype) for n, t in (*model.named_parameters(), *model.named_buffers())
    )
    placer = _Placer(
        runtime.hook, optimizer_tier, params_tier, model, partition_context,
        alternatives=lambda: _roomier_tiers(model, cfg, registry, installed, partition_context.device),
    )
    placer.check_capacity(partition_context.world_size)  # before anything moves: see `_Placer`
    produced = runtime.hook.zkernel_partition_params(
        module=model, context=attrs.evolve(partition_context, options=selection["partitioner"].options)
    )
    if produced is None:
        raise RuntimeError(f"partitioner {cfg.partitioner!r} returned no parameter groups")
    groups = placer.place(produced)
    mark_overrides(model, groups, overrides)
    # After partitioning: zero3 materialises buffers a meta-device model left on meta.
    _move_buffers(model, dist_info.device, compute_dtype, registry.with_capability(Family.PARTITIONER, MATERIALIZES_META))
    _check_groups(model, groups, cfg.partitioner)
    log.info(
        "zkernel.initialized",
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        device=str(dist_info.device),
        partitioner=cfg.partitioner,
        optimizer=cfg.optimizer.name,
        offload_optimizer=cfg.offload.optimizer,
        offload_params=cfg.offload.params,
        precision=cfg.precision,
        groups=len(groups),
    )
    parts = EngineParts(
        runtime_pm=runtime,
        groups=groups,
        compute_dtype=compute_dtype,
        optimizer_tier=optimizer_tier,
        params_tier=params_tier,
        worker=worker,
        streams=streams,
        timeline=timeline,
        can_rollback=placer.can_rollback and bool(groups),
        skips_params=placer.skips_params,
        takes_found_inf=placer.takes_found_inf,
        speculate=optimizer_tier.speculate,
        original_dtypes=original_dtypes,
        whole_bytes=whole_bytes,
        original_tensors=original_tensors,
        placement_plan=plan,
        lr_schedule=lr_schedule,
        left_unset=frozenset(base.left_unset),
    )
    return Engine(model, cfg, dist_info, parts)


def _bind_device(device: torch.device) -> None:
    """The host worker's CUDA calls go to this rank's device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def consolidate(directory, tag: str | None = None, *, progress: bool | None = None) -> dict[str, torch.Tensor]:
    """Rebuild the full fp32 state dict of a checkpoint directory (no process group needed).

    ``progress``: show a progress bar (default: when stderr is a terminal, see `zkernel.telemetry.progress`).

    One tensor at a time, reading only the bytes each needs; the result loads
    with ``load_state_dict(strict=True)`` into the plain model. See
    `zkernel.checkpoint.consolidate`.
    """
    from zkernel.checkpoint import consolidate as run

    return run(directory, tag, progress=progress)
