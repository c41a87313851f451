"""The hook specifications: the contract between zkernel's scheduler and its plugins.

Two plugin managers use these specs (see `zkernel.plugin_manager`):

* the *installed* manager holds every plugin found (entry points of group
  ``zkernel``, plugins passed in code, dotted paths from config). Only the
  registration hooks are called on it.
* the *runtime* manager of one engine holds only the component objects the
  config selected (one partitioner, one optimizer, one tier per role). The
  lifecycle hooks are called on it, so an installed but unselected component
  never sees a ``fetch``.

The unit of every lifecycle call is a `zkernel.groups.ParamGroup`, never a
single tensor: a pluggy call costs about a microsecond, and per-tensor work
stays inside the plugin, batched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from zkernel.groups import ParamGroup, Phase, StepOptions
    from zkernel.registry import ComponentRegistry
    from zkernel.runtime import RuntimeContext

PROJECT = "zkernel"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------
# Bootstrapping: registration of named components
# ---------------------------------------------------------------------------


@hookspec
def zkernel_register_partitioners(registry: ComponentRegistry) -> None:
    """Offer partitioners that config can select by name (``partitioner = "..."``).

    Called by `zkernel.plugin_manager.collect_components` once per installed
    plugin manager, on every rank, before the config's names are resolved. Each implementation is called on
    its own with a registry bound to its plugin's name, so every component
    records which plugin offered it.

    :param registry: call ``registry.add(name, factory, description=...)``; the
        factory is called as ``factory(context)`` with a
        `zkernel.runtime.RuntimeContext` and returns an object with
        ``@hookimpl`` methods, which is then registered on the runtime manager.

    All implementations are called; results are ignored.
    """


@hookspec
def zkernel_register_offload_tiers(registry: ComponentRegistry) -> None:
    """Offer storage tiers for optimizer state and parameters (``[offload]``).

    Called like `zkernel_register_partitioners`. A tier factory is called as
    ``factory(context, role)`` where ``role`` is ``"optimizer"`` or
    ``"params"``; one object per selected role joins the runtime manager.

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


# ---------------------------------------------------------------------------
# Partitioning
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def zkernel_partition_params(
    module: torch.nn.Module, context: RuntimeContext
) -> list[ParamGroup] | None:
    """Decide who owns which slice of params, grads and optimizer state.

    Called by `zkernel.initialize` once, on every rank, after the module was
    moved to the compute device (ZeRO-3 partitioners get the module as built,
    possibly already sharded by `zkernel.partitioned_init`).

    :param module: the user's model.
    :param context: rank, world size, device, config, process group.
    :return: the parameter groups, in registration order, with
        ``master``, ``grad`` and ``copy_out`` set up for the step (see
        `zkernel.groups.ParamGroup`). Every trainable parameter is in exactly
        one trainable group.

    Stops at the first non-None result.
    """


# ---------------------------------------------------------------------------
# Fetch and release
# ---------------------------------------------------------------------------


@hookspec
def zkernel_fetch_params(group: ParamGroup, phase: Phase, boundary: bool) -> None:
    """Make what ``phase`` needs of ``group`` present on the compute device, and wait for it.

    Called by the scheduler on every rank:

    * ``Phase.FORWARD`` from the forward pre-hook of ``group.module`` (and from
      the scheduler's guard when a released parameter is used outside its own
      module): make the parameters whole.
    * ``Phase.BACKWARD`` when the first gradient reaches ``group.module``'s
      outputs: make the parameters whole again for the backward.
    * ``Phase.STEP`` for every trainable group at an accumulation boundary,
      before the gradient norm and the optimizer step: finish outstanding
      gradient reductions; bring the master shard, its gradient and optimizer
      state to where the optimizer runs.
    * ``Phase.USER`` from `Engine.gathered_parameters`, on every rank, for groups
      whose parameters are not whole: make them whole in storage of their own,
      so views the user keeps stay valid after the release.

    :param boundary: True when the current micro-batch ends an accumulation window.

    All implementations are called. Tiers run first (``tryfirst``), so data is
    brought up the hierarchy before the partitioner all-gathers it.
    """


@hookspec
def zkernel_prefetch_params(group: ParamGroup, phase: Phase) -> None:
    """Start bringing ``group``'s parameters in for ``phase`` without waiting.

    Called by the scheduler's prefetcher for the groups that follow the running
    one in the traced module order, within ``prefetch_bytes``. A later
    `zkernel_fetch_params` for the same group and phase must find the started
    transfer and wait only for it.

    All implementations are called.
    """


@hookspec
def zkernel_release_params(group: ParamGroup, phase: Phase, boundary: bool) -> None:
    """Give back what ``phase`` no longer needs of ``group``.

    Called by the scheduler on every rank:

    * ``Phase.FORWARD`` from the forward post-hook of ``group.module``: drop
      gathered copies (ZeRO-3) unless the partitioner keeps them.
    * ``Phase.BACKWARD`` once every trainable parameter of the group received
      its gradient in this backward (or at the end of backward for groups
      without gradients): drop gathered copies.
    * ``Phase.GRADIENTS`` right after ``Phase.BACKWARD``, for trainable groups:
      reduce the gradients to their owners (all-reduce, reduce-scatter),
      possibly asynchronously, accumulate into ``group.grad`` and offload them.
      ``boundary`` tells whether the reduction may be deferred.
    * ``Phase.STEP`` after the optimizer step (or its skip) at a boundary:
      publish the updated parameters to the compute copies, zero the gradient
      accumulators, write optimizer state back to its tier.
    * ``Phase.USER`` at the end of `Engine.gathered_parameters`.

    All implementations are called. Tiers run last (``trylast``).
    """


# ---------------------------------------------------------------------------
# Step
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def zkernel_step_optimizer(group: ParamGroup, options: StepOptions) -> bool | None:
    """Apply one optimizer update to ``group.master`` from ``group.grad``.

    Called by the engine at an accumulation boundary for every trainable group
    whose gradients are finite, on every rank, over the shard this rank owns,
    on the device where ``group.master`` lives.

    :param group: ``master`` (fp32, updated in place), ``grad`` (same numel,
        fp32 or bf16, *not* yet multiplied by ``options.grad_scale``),
        ``optim_state`` (the optimizer's own dict, kept per group),
        ``copy_out`` (None, or a low-precision tensor of the same numel that
        must receive the updated values rounded to its dtype).
    :param options: hyperparameters for this step and the gradient
        coefficient (unscale times clip).
    :return: True once stepped.

    Stops at the first non-None result.
    """


# ---------------------------------------------------------------------------
# Persistence
# ---------------------------------------------------------------------------


@hookspec
def zkernel_persist_state(group: ParamGroup, state: dict[str, Any]) -> None:
    """Contribute ``group``'s state to a checkpoint being written.

    Called by `Engine.save_checkpoint` on every rank for every group; each
    implementation adds its own entries to ``state`` (tensors on CPU, keyed by
    a name the same plugin reads back in `zkernel_restore_state`).

    All implementations are called.
    """


@hookspec
def zkernel_restore_state(group: ParamGroup, state: dict[str, Any]) -> None:
    """Take ``group``'s state back from a checkpoint being loaded.

    Called by `Engine.load_checkpoint` on every rank for every group, with the
    entries written by `zkernel_persist_state` (re-sharded for this world size).

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

    All results are collected.
    """
