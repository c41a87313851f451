"""The hook specifications: the contract between zkernel's scheduler and its plugins.

Two plugin managers use these specs (see `zkernel.kernel.plugin_manager`):

* the *installed* manager holds every plugin found (entry points of group
  ``zkernel``, plugins passed in code, dotted paths from config). Only the
  registration hooks and the sizing hooks (a component answering for its
  bytes before anything is built) are called on it.
* the *runtime* manager of one engine holds only the component objects the
  config selected (one partitioner, one optimizer, one tier per role, one
  component per model-transform family: tiling, activation checkpointing). The
  lifecycle hooks are called on it, so an installed but unselected component
  never sees a ``fetch``.

The unit of every lifecycle call is a `zkernel.spec.groups.ParamGroup`, never a
single tensor: a pluggy call costs about a microsecond, and per-tensor work
stays inside the plugin, batched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from zkernel.spec.groups import OptimizerDeclaration, ParamGroup, Phase, ReducedGradient, ShardLayout, StepOptions
    from zkernel.spec.registry import ComponentRegistry
    from zkernel.spec.runtime import RuntimeContext
    from zkernel.spec.sizing import PartitionSizing, TierSizing
    from zkernel.spec.tiers import WholeParams

PROJECT = "zkernel"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------
# Bootstrapping: registration of named components
# ---------------------------------------------------------------------------


@hookspec
def zkernel_register_partitioners(registry: ComponentRegistry) -> None:
    """Offer partitioners that config can select by name (``partitioner = "..."``).

    Called by `zkernel.kernel.plugin_manager.collect_components` once per installed
    plugin manager, on every rank, before the config's names are resolved. Each implementation is called on
    its own with a registry bound to its plugin's name, so every component
    records which plugin offered it.

    :param registry: call ``registry.add(name, factory, description=...)``; the
        factory is called as ``factory(context)`` with a
        `zkernel.spec.runtime.RuntimeContext` and returns an object with
        ``@hookimpl`` methods, which is then registered on the runtime manager.
        ``capabilities=`` and ``check=`` state the rules that involve the
        component ([Note: capabilities] in `zkernel.spec.registry`); a partitioner
        whose parameter shards the ``offload.params`` tier may move declares
        ``PARAMS_ON_TIER``.

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_register_offload_tiers(registry: ComponentRegistry) -> None:
    """Offer storage tiers for optimizer state and parameters (``[offload]``).

    Called like `zkernel_register_partitioners`. A tier factory is called as
    ``factory(context, role)`` where ``role`` is ``"optimizer"`` or
    ``"params"`` (``context.options``: that role's ``offload.<role>_options``)
    and returns a `zkernel.spec.tiers.OptimizerTier` or `zkernel.spec.tiers.ParamsTier`
    respectively; the kernel calls its methods, and the object also joins the
    runtime manager.

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_register_optimizers(registry: ComponentRegistry) -> None:
    """Offer optimizers that config can select by ``[optimizer] name``.

    Called like `zkernel_register_partitioners`; the factory is called as
    ``factory(context)`` (``context.config.optimizer`` holds lr, betas, eps,
    weight decay and the component's own options).

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_register_tilings(registry: ComponentRegistry) -> None:
    """Offer tiling components that config can select by ``[tiling] name``.

    Called like `zkernel_register_partitioners`; the factory is called as
    ``factory(context)`` (``context.config.tiling`` holds ``modules``,
    ``min_numel`` and ``tiles``; ``context.options`` the component's own
    options) and returns an object implementing `zkernel_apply_tiling` and
    `zkernel_restore_module`, which joins the runtime manager.

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_register_activation_checkpointers(registry: ComponentRegistry) -> None:
    """Offer activation checkpointing components, selected by ``[activation_checkpointing] name``.

    Called like `zkernel_register_partitioners`; the factory is called as
    ``factory(context)`` (``context.config.activation_checkpointing`` holds
    ``modules`` and ``offload``; ``context.options`` the component's own
    options) and returns an object implementing
    `zkernel_apply_activation_checkpointing` and `zkernel_restore_module`,
    which joins the runtime manager.

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_register_lr_schedules(registry: ComponentRegistry) -> None:
    """Offer learning-rate schedules, selected by ``[lr_schedule] name``.

    Called like `zkernel_register_partitioners`; the factory is called as
    ``factory(context)`` (``context.config.optimizer`` holds the base
    hyperparameters; ``context.options`` the schedule's own options) and
    returns a `zkernel.spec.lr_schedule.LRSchedule`, whose ``hyper`` the engine
    calls before every optimizer step. A schedule never joins the runtime
    manager.

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_register_planners(registry: ComponentRegistry) -> None:
    """Offer planners, selected by ``[planner] name``, that resolve ``"auto"`` placement values.

    Called like `zkernel_register_partitioners`; the factory is called as
    ``factory(context)`` (``context.config.planner`` holds the activation
    hints and capacity overrides; ``context.options`` the component's own
    options) and returns a `zkernel.spec.planner.Planner`, whose ``plan`` the
    kernel calls on rank 0 only, before any other component is built, when
    ``partitioner``, ``offload.optimizer`` or ``offload.params`` is
    ``"auto"`` (and by ``zkernel estimate --plan``). A planner never joins the
    runtime manager.

    All implementations are called; results are ignored.
    """


# ---------------------------------------------------------------------------
# Model transforms (see [Note: model transforms] in zkernel.kernel.transforms)
# ---------------------------------------------------------------------------


@hookspec
def zkernel_apply_tiling(module: torch.nn.Module, context: RuntimeContext) -> None:
    """Split the layers ``[tiling]`` selects into tiles, in place, before partitioning.

    Called by `zkernel.initialize` once, on every rank, on the runtime manager
    (so only the selected tiling component), before
    `zkernel_apply_activation_checkpointing` and `zkernel_partition_params`.
    Parameters may still be on the meta device.

    Each tile must be a submodule with parameters of its own (so a
    partitioner that gathers per module, zero3, fetches and releases each
    tile on its own), and the replacement must compute what the layer did.
    Names and shapes the user sees stay the untiled ones: the replacing module
    declares its pieces through ``zkernel_composed_parameters`` (see
    `zkernel.params.param_map`), which also keeps ``state_dict`` untiled.

    :param module: the user's model, changed in place.
    :param context: rank, world size, device, config; ``context.options`` is
        the component's validated options.

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_apply_activation_checkpointing(module: torch.nn.Module, context: RuntimeContext) -> None:
    """Make the modules ``[activation_checkpointing]`` selects recompute their activations in backward.

    Called by `zkernel.initialize` once, on every rank, on the runtime manager
    (so only the selected component), after `zkernel_apply_tiling` and before
    `zkernel_partition_params`. The component changes how the selected modules
    run (not their parameters or names); forward pre/post hooks registered on
    them later (the scheduler's) still bracket each call.

    A recomputation runs inside backward, which the scheduler recognises
    (see [Note: recompute] in `zkernel.kernel.scheduler`): a component needs no
    further call into the kernel for it.

    :param module: the user's model, changed in place.
    :param context: rank, world size, device, config, side streams;
        ``context.options`` is the component's validated options.

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_restore_module(module: torch.nn.Module) -> None:
    """Undo what an apply hook did to ``module``: the model the user passed in comes back.

    Called by `Engine.close` on every rank after every parameter got its
    whole value back in its original dtype, on the runtime manager; model
    transform components implement it. Pluggy calls implementations in
    reverse registration order, so the transform applied last is undone first.

    All implementations are called; results are ignored.
    """


# ---------------------------------------------------------------------------
# Partitioning
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def zkernel_partition_params(module: torch.nn.Module, context: RuntimeContext) -> Iterable[ParamGroup] | None:
    """Decide who owns which slice of params, grads and optimizer state.

    Called by `zkernel.initialize` once, on every rank, after the module's
    buffers were moved to the compute device (parameters may still be on the
    meta device, for ZeRO-3 to materialise one unit at a time).

    :param module: the user's model.
    :param context: rank, world size, device, config, process group,
        ``context.placement`` (whether masters and parameter shards stay on the
        compute device, see `zkernel.spec.tiers.PlacementInfo`), and, for a
        partitioner that materialises a meta-device model,
        ``context.init_fn`` and ``context.left_unset``, the set it adds the
        names of values its initialiser left unset to (a load must write
        them before a forward: [Note: values left unset] in `zkernel.params.unset`).
    :return: the parameter groups in registration order, possibly lazily (a
        generator): `initialize` places each yielded group in the tiers before
        asking for the next, so a partitioner holds at most one group's
        initial fp32 master on the compute device at a time. A trainable group
        comes with ``master`` set to its initial fp32 values (this rank's
        slice; it may be a view of ``param_shard``) and ``param_shard`` set to
        the compute-dtype slice the partitioner publishes from after a step
        (None when it gathers by casting a master that stays on the compute
        device). Every trainable parameter is in exactly one trainable group.

    Stops at the first non-None result.
    """


# ---------------------------------------------------------------------------
# Fetch and release
# ---------------------------------------------------------------------------


@hookspec
def zkernel_fetch_params(group: ParamGroup, phase: Phase) -> None:
    """Make ``group``'s parameters whole on the compute device, and wait for it.

    Called by the scheduler on every rank:

    * ``Phase.FORWARD`` from the forward pre-hook of ``group.module`` (and from
      the scheduler's guard when a released parameter is used outside its own
      module);
    * ``Phase.BACKWARD`` when the first gradient reaches ``group.module``'s
      outputs;
    * ``Phase.USER`` from `Engine.gathered_parameters`, for groups whose
      parameters are not whole: make them whole in storage of their own, so
      views the user keeps stay valid after the release.

    Before the call the kernel has waited for any pending update of
    ``group.param_shard`` (a step still running on the host).

    All implementations are called.
    """


@hookspec
def zkernel_prefetch_params(group: ParamGroup, phase: Phase) -> None:
    """Start bringing ``group``'s parameters in for ``phase`` without waiting.

    Called by the scheduler's prefetcher for the groups that follow the running
    one in the traced module order, within ``prefetch_bytes``, skipping groups
    whose update is still running on the host. A later `zkernel_fetch_params`
    for the same group and phase must find the started transfer and wait only
    for it.

    All implementations are called.
    """


@hookspec
def zkernel_release_params(group: ParamGroup, phase: Phase) -> None:
    """Drop ``group``'s gathered parameters when ``phase`` no longer needs them.

    Called by the scheduler on every rank: ``Phase.FORWARD`` from the forward
    post-hook of ``group.module``, ``Phase.BACKWARD`` once every trainable
    parameter of the group received its gradient in this backward (or at the
    end of backward for groups without gradients), ``Phase.USER`` at the end of
    `Engine.gathered_parameters`. A partitioner whose parameters stay whole
    does nothing.

    All implementations are called.
    """


@hookspec(firstresult=True)
def zkernel_reduce_gradients(group: ParamGroup, boundary: bool) -> ReducedGradient | None:
    """Reduce ``group``'s gradients to their owners, possibly asynchronously.

    Called by the scheduler on every rank for every trainable group, in the
    same order on all ranks, once all its parameters got their gradients in a
    backward (or at the end of backward): take each parameter's ``.grad``
    (None counts as zeros) and drop it.

    :param boundary: True when this backward ends an accumulation window.
    :return: this rank's reduced shard with its collective's handle (see
        `zkernel.spec.groups.ReducedGradient`), which the kernel hands to the
        optimizer tier; or None when the partitioner keeps accumulating locally
        and reduces at the boundary (then it must return the window's whole
        gradient at the boundary, with ``accumulate=False``).

    Stops at the first non-None result.
    """


@hookspec
def zkernel_publish_params(group: ParamGroup) -> None:
    """Make an updated ``group.param_shard`` visible to the parameters (ZeRO-1/2: all-gather).

    Called by the engine on every rank after a step updated the group, in the
    same order on all ranks, for groups without a ``module`` (whose parameters
    stay whole); the current stream already waits for the shard's upload.
    Module-bound groups gather from their shard at their next fetch instead.

    All implementations are called.
    """


@hookspec
def zkernel_restore_params(group: ParamGroup, master: torch.Tensor | None, home: torch.device) -> None:
    """Give ``group``'s parameters their whole values in storage of their own, for good.

    Called by `Engine.close` on every rank for every group, in the same order on
    all ranks (the call may be collective). ``master`` is this rank's current
    fp32 master (on any device) for trainable groups, None for frozen ones; the
    parameters take the master's values (frozen ones their compute-dtype
    values); the engine then casts each parameter back to the dtype it had when
    `initialize` was called. ``home`` is where parameters that are not whole
    yet go: the compute device, the CPU, or ``meta`` when the whole model fits
    nowhere (values released; see [Note: where a closed model goes]).
    Parameters a partitioner keeps whole on the compute device stay there.

    All implementations are called.
    """


# ---------------------------------------------------------------------------
# Step
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def zkernel_declare_optimizer(numel: int, param_count: int) -> OptimizerDeclaration | None:
    """Declare the state the selected optimizer keeps for a group of ``numel`` elements (this
    rank's shard) holding parts of ``param_count`` parameters (per-parameter state, such as a step
    count, has shape ``(param_count,)`` and ``per_param`` set).

    Called by `zkernel.initialize` once per trainable group, before the group
    is placed (and once before partitioning, for its capabilities, when the
    config asks for one: ``per_param_hyper``), so the optimizer tier can
    allocate (pin, or give swap space to) the state up front; it is then
    handed to every step as
    ``group.optim_state``, zero-initialised. An optimizer that declares nothing
    gets an empty dict it may fill lazily on tiers that keep state in memory.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def zkernel_step_optimizer(group: ParamGroup, options: StepOptions) -> bool | None:
    """Apply one optimizer update to ``group.master`` from ``group.grad``.

    Called by the engine at an accumulation boundary for every trainable group
    whose step is not skipped, on every rank, over the shard this rank owns, on
    the device where ``group.master`` lives (the host worker thread runs it for
    groups the tier keeps on the host; the main thread otherwise).

    :param group: ``master`` (fp32, updated in place), ``grad`` (same numel,
        fp32 or bf16, *not* yet multiplied by ``options.grad_scale``; read
        only), ``optim_state`` (the declared state), ``copy_out`` (None, or a
        low-precision tensor of the same numel that must receive the updated
        values rounded to its dtype).
    :param options: hyperparameters for this step and the gradient
        coefficient (unscale times clip); an optimizer that declared
        ``per_param_hyper`` steps the parameters in ``group.param_hyper`` with
        their own instead (`zkernel.spec.groups.ParamHyper`: rate scale, weight
        decay, betas, eps); ``options.skip_params`` names the
        parameters (positions in ``group.params``) that no rank gave a
        gradient in this window: their elements of ``master``, state and
        ``copy_out`` must stay as they are, as torch skips a parameter whose
        ``grad`` is None (``group.shard_layout`` says where each parameter's
        elements are in the shard). ``options.found_inf`` (only for an
        optimizer that declared ``takes_found_inf``): a device flag; where it
        is set the update must leave ``master``, the state and ``copy_out`` as
        they are, decided on the device without reading the flag on the host.
    :return: True once stepped.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def zkernel_uncount_step(group: ParamGroup, options: StepOptions) -> bool | None:
    """Forget the last `zkernel_step_optimizer` of ``group``, which ``options.found_inf`` made a no-op.

    Called by the engine on the training thread, on every rank, for every
    group stepped with ``options.found_inf`` once the host has read the flag
    as set: one step late, before the group's next step and before its state
    is read (a checkpoint, `Engine.close`). The update changed nothing on the
    device; what the optimizer counted on the host for it (step counts, for
    bias correction) must go back to where it was, as if the step had not
    been called. Only called for optimizers that declared ``takes_found_inf``.

    :return: True once done. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def zkernel_rollback_optimizer(group: ParamGroup, options: StepOptions) -> bool | None:
    """Undo the last `zkernel_step_optimizer` of ``group``, made with ``options``.

    Called by the engine's step pipeline, in the thread that steps the group,
    when a speculative step turns out wrong (the gradient had to be clipped, or
    an fp16 overflow skips the step), with the same gradient still in
    ``group.grad``. Only called for optimizers that declared
    ``can_rollback``. ``copy_out`` need not be rewritten (a redo or the
    unchanged shard follows).

    :return: True once rolled back. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def zkernel_can_rollback_step(group: ParamGroup, options: StepOptions) -> bool | None:
    """Say whether a step of ``group`` with ``options`` could be undone by `zkernel_rollback_optimizer`.

    Called by the engine's step pipeline in the thread that steps the group,
    before it steps the group speculatively (during backward, before the
    window's gradient coefficient is known), for optimizers that declared
    ``can_rollback``. Some hyperparameters make a step overwrite what a
    rollback needs (Adam with ``beta1 == 0``, AdamW with
    ``lr * weight_decay == 1`` for any parameter), and a schedule or a
    parameter's own rate or betas can reach them at any step.

    :return: False to have the group stepped only once the coefficient is
        known; True, or None from every plugin, to let it step now. Stops at
        the first non-None result.
    """


# ---------------------------------------------------------------------------
# Persistence
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def zkernel_describe_shard(group: ParamGroup) -> ShardLayout | None:
    """Say which elements of which parameters this rank's shard of ``group`` holds.

    Called by `zkernel.checkpoint` on every rank for every group, between
    steps: when a checkpoint is saved or loaded and by `Engine.state_dict`.
    The partitioner that made the group answers. Checkpoints are keyed by
    parameter name and element offset, so they outlive groups, which differ
    by partitioner, unit policy, bucket size and world size.

    :return: a `zkernel.spec.groups.ShardLayout`: ``numel`` is the length of the
        shard tensors (``group.master`` and each per-element optimizer state of
        a trainable group, ``group.param_shard`` of a frozen one), and
        ``fragments`` place every parameter element the shard holds; the
        fragments of all ranks cover each parameter of the group exactly once,
        or, with ``replicated``, every rank's fragments cover it (rank 0's are
        written). A frozen group without ``param_shard`` (parameters whole on
        every rank) answers None and its parameters are saved whole.

    Stops at the first non-None result.
    """


@hookspec
def zkernel_restore_state(group: ParamGroup) -> None:
    """``group``'s shard was replaced from a checkpoint: refresh every copy derived from it.

    Called by `Engine.load_checkpoint` on every rank for every group, in the
    same order on all ranks (the call may be collective), after the optimizer
    tier took the loaded master and state (`OptimizerTier.write_state`, which
    also refreshed ``group.param_shard``) or, for a frozen group, after the
    params tier took the loaded shard (`ParamsTier.write_shard`). A partitioner
    that keeps whole parameters makes them match the shard again (ZeRO-1/2: the
    all-gather of a publish); one whose parameters are released until their
    next fetch drops anything gathered or prefetched before the load.

    All implementations are called.
    """


# ---------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------


@hookspec
def zkernel_memory_tensors(group: ParamGroup) -> dict[str, list[torch.Tensor]] | None:
    """Name the tensors this plugin holds for ``group``, by category.

    Called by `Engine.memory_report` on the calling rank for every group.
    Categories: ``"params"``, ``"grads"``, ``"master_weights"``,
    ``"optimizer_state"``. The engine counts each storage once, by device.
    Bytes held outside memory (a swap file) are listed as
    `zkernel.spec.tiers.StoredBytes`, counted under their ``place``.

    All results are collected.
    """


@hookspec
def zkernel_memory_whole(group: ParamGroup) -> WholeParams | None:
    """Say which of ``group``'s parameters this plugin holds whole on this rank now, and why.

    Called by `Engine.memory_report` on the calling rank for every group, after
    ``zkernel_memory_tensors``. A partitioner that keeps some parameters whole
    (zero3's units under its persistence threshold, or units gathered ahead of
    their next use) answers with a `zkernel.spec.tiers.WholeParams`: how many,
    their bytes, why, and the config key that changes it; the report lists them
    beside its bytes. A plugin that holds none whole for ``group``, or whose
    whole parameters are the point (no sharding), returns None.

    All results are collected.
    """


# ---------------------------------------------------------------------------
# Sizing (see [Note: components answer for their bytes] in zkernel.spec.sizing)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def zkernel_size_partition(
    name: str, module: torch.nn.Module, world_size: int, options: object
) -> PartitionSizing | None:
    """Lay ``module`` out as partitioner ``name`` would on ``world_size`` ranks, without allocating.

    Called on the *installed* manager by `zkernel.kernel.sizing.Estimator` (for
    `zkernel.estimate`, ``zkernel estimate``, a planner through
    `zkernel.spec.sizing.SizingService`, and `initialize`'s capacity error), in
    one process, any number of times, before or without any training. The plugin offering the
    partitioner ``name`` answers; every other plugin returns None.

    :param module: the model, read for parameter shapes, ``requires_grad``
        and module structure only (usually on the meta device).
    :param options: the partitioner's validated options object (its defaults
        filled in), as `initialize` would build it.
    :return: a `zkernel.spec.sizing.PartitionSizing`: its groups with their
        per-rank extents, and the buffers it keeps for each where the tiers
        put them, exactly as its ``zkernel_partition_params`` and
        ``zkernel_memory_tensors`` would count them.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def zkernel_size_offload_tier(name: str, role: str, options: object, device: str) -> TierSizing | None:
    """Say where offload tier ``name`` keeps the buffers of ``role`` (``"optimizer"``, ``"params"``).

    Called on the *installed* manager by `zkernel.kernel.sizing.Estimator`, like
    `zkernel_size_partition`, for the selected tier of each role and, for the
    ``zkernel estimate`` table and a planner, for every installed tier. The
    plugin offering the tier ``name`` answers; every other plugin, and a
    tier that does not serve ``role``, returns None.

    :param options: the tier's validated options object for ``role`` (None
        when it takes none).
    :param device: the compute device's type (``"cuda"``, ``"cpu"``).
    :return: a `zkernel.spec.sizing.TierSizing`: where each owned role's
        buffers live, the fractions of its groups it keeps elsewhere, its
        staging and page-locked pools, exactly as its ``zkernel_memory_tensors``
        would count them after a step.

    Stops at the first non-None result.
    """
