"""Closing an engine: the model given back, everything the engine holds freed, also after a failure.

`Engine.close` calls `close`; the engine's finalizer (an engine dropped without
close, or alive at exit) calls `abandon`. These functions read the engine's own
state (its groups, tiers, scheduler, the dtypes and shapes `initialize` saw):
they are the engine's, kept apart because closing is a job of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from zkernel.kernel import lifecycle
from zkernel.kernel.divergence import RankDivergenceError
from zkernel.params import param_writes
from zkernel.params.released import is_released, mark_gathered
from zkernel.platform.machine import available_host_bytes
from zkernel.platform.sizes import format_bytes
from zkernel.spec.groups import ParamGroup
from zkernel.telemetry.log import get_logger

log = get_logger()


def restore_home(engine) -> torch.device:
    """Where `close` puts the whole parameters ([Note: where a closed model goes])."""
    released = any(is_released(p) for p in engine._module.parameters())  # held as shards (zero3)
    missing = engine._whole_bytes if released else 0
    device = engine.dist.device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if missing <= 0.9 * free:
            return device
    host = available_host_bytes()
    if host is None or missing <= 0.9 * host:
        return device if device.type == "cpu" else torch.device("cpu")
    log.warning(
        "zkernel.engine.params_released",
        needed=format_bytes(missing),
        host_available=format_bytes(host),
        advice="the whole model fits neither the compute device nor host memory: its parameters are left "
        "as meta tensors; save a checkpoint (engine.save_checkpoint) before close to keep the trained values",
    )
    return torch.device("meta")


def close(engine) -> None:
    """Give the model back and free everything the engine holds (collective: call on every rank).

    Pending updates finish; every parameter gets its whole, current value
    (the fp32 master for trainable ones) in storage of its own, in the dtype
    it had at `zkernel.initialize`; hooks come off the model; tiers free
    their memory and swap files; the host worker stops. The module can then
    be trained on its own or wrapped by a new engine. Closing twice is a no-op.
    A pending update that failed is raised after all that is done.

    [Note: where a closed model goes] Whole parameters go to the compute
    device if they fit in its free memory, else to host memory if they fit
    there, else nowhere: a model that only trains spread over GPUs, host
    memory and disk has no single place to be whole on every rank. Then the
    parameters are released (meta tensors) with a WARNING; save a checkpoint
    (`save_checkpoint`) before `close` to keep the trained values.

    [Note: closing after a failure] A step that failed (a swap file that no
    longer reads back, an optimizer that raised) leaves the engine open.
    `close` then still gives every group back that it can (a trainable
    group from its fp32 master even where its parameter shard cannot be
    read; a group with no readable values as meta tensors of its shape,
    with an ERROR), takes the hooks off, restores the classes, stops the
    threads and removes the swap files, and marks the engine closed, then
    raises the first error it met (or the failed update's), once; a later
    `close` is a no-op.
    """
    if engine._closed:
        return
    engine._exit_guard()
    diverged = ranks_apart(engine)
    if diverged is not None:
        close_locally(engine, diverged)  # raises it
    if engine.unset.names:  # [Note: values left unset]: given back as the initialiser left them (NaN)
        log.warning(
            "zkernel.close.values_unset",
            values=engine.unset.names[:8],
            count=len(engine.unset.names),
            advice="neither the initialiser nor a load wrote these values; the model gets them back as NaN",
        )
    failed: Exception | None = None
    try:
        engine.pipeline.wait_all()
    except Exception as exc:  # noqa: BLE001 - a failed update: give the model back, then raise it
        failed = exc
    try:
        home = restore_home(engine)
        with engine.scheduler.plugin_call():
            if failed is None:
                engine.scheduler.fold_writes()
            for group in engine.groups:
                error = give_back(engine, group, home)  # every group, also after one failed
                failed = failed or error
        restore_module(engine)  # undo the watch, dtypes, tiling, checkpointing
    except Exception as exc:  # noqa: BLE001 - [Note: closing after a failure]
        failed = failed or exc
    finally:
        error = teardown(engine)
        failed = failed or error
    if failed is not None:
        raise failed


def restore_module(engine) -> None:
    """The model's own again: no watched parameters, the dtypes `initialize` saw, tiling and
    checkpointing undone."""
    param_writes.unwatch([p for group in engine.groups for p in group.params])
    with torch.no_grad():
        for name, dtype in engine._original_dtypes:
            param = engine._module.get_parameter(name)
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
    engine.hook.zkernel_restore_module(module=engine._module)


def teardown(engine) -> Exception | None:
    """The last of `close`: mark the engine closed, stop its threads, free its tiers; the first error."""
    engine._closed = True
    engine.timeline.close()
    engine.scheduler.paths.close()
    engine._finalizer.detach()
    lifecycle.unregister_cleanup(id(engine))
    error = free(engine.scheduler.handles, engine.optimizer_tier, engine.params_tier, engine._worker)
    lifecycle.release(engine._module)
    log.debug("zkernel.engine.closed", rank=engine.dist.rank)
    return error


def ranks_apart(engine) -> Exception | None:
    """Whether another rank is not closing with this one ([Note: ranks a step apart] in
    `zkernel.kernel.divergence`): the error saying so (also the statement's own failure: a rank
    that is gone), or None."""
    paths = engine.scheduler.paths
    if paths.diverged is not None:
        return RankDivergenceError(paths.diverged)
    try:
        paths.before_close(engine.micro_steps)
    except Exception as exc:  # noqa: BLE001 - no collective can follow: close locally, then raise it
        return exc
    return None


def close_locally(engine, error: Exception) -> None:
    """`close` without a collective (the ranks diverged): whole parameters keep their values, released
    ones (zero3 shards) become meta tensors; everything this rank holds is freed. Raises ``error``."""
    try:
        for group in engine.groups:
            if any(is_released(p) for p in group.params):
                lose(engine, group)
        restore_module(engine)  # undo the watch, dtypes, tiling, checkpointing
    finally:
        teardown(engine)
    error.add_note(
        "engine.close() issued no collective (the other ranks would not have met it): it freed this rank's "
        "memory, threads and swap files; parameters kept whole on this rank keep their values, the others are "
        "meta tensors. Let every rank run the same steps: a rank that catches an error from its forward or "
        "backward must make the others skip that batch too (or end the job)"
    )
    raise error


def give_back(engine, group: ParamGroup, home: torch.device) -> Exception | None:
    """Put ``group``'s whole values in its parameters ([Note: closing after a failure]); the first error met."""
    error: Exception | None = None
    master = None
    if group.requires_grad:
        try:
            master = engine.optimizer_tier.read_master(group)
        except Exception as exc:  # noqa: BLE001
            error = exc
    try:
        engine.params_tier.to_device(group, consume=True, block=True)
        readable = True
    except Exception as exc:  # noqa: BLE001 - the master alone can give a trainable group back
        error, readable = error or exc, master is not None
    restored = False
    if readable:
        try:
            engine.hook.zkernel_restore_params(group=group, master=master, home=home)
            restored = True
        except Exception as exc:  # noqa: BLE001
            error = error or exc
    try:
        engine.params_tier.drop_device(group)
    except Exception as exc:  # noqa: BLE001
        error = error or exc
    if not restored:
        lose(engine, group)
    if error is not None:
        error.add_note(
            f"while engine.close() gave back group {group.name!r}: "
            + ("its parameters took their fp32 masters" if restored else "its values could not be read; its parameters are meta tensors now")
        )
    return error


def lose(engine, group: ParamGroup) -> None:
    """``group``'s values could not be read back at close: its parameters become meta tensors of their shape."""
    log.error(
        "zkernel.close.values_lost",
        group=group.name,
        params=list(group.param_names[:8]),
        advice="their values could not be read back (see the error close raises); load them again from a checkpoint",
    )
    param_writes.unwatch(group.params)
    for name, p in zip(group.param_names, group.params):
        mark_gathered(p)
        shape, dtype = engine.original_tensors.get(name, (p.shape, p.dtype))
        meta = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, meta)


def free(handles, optimizer_tier, params_tier, worker) -> Exception | None:
    """Take the hooks off, stop the host worker, close the tiers: each even if another failed; the first error."""
    error: Exception | None = None
    steps = [lambda: [handle.remove() for handle in handles], lambda: worker.shutdown(wait=True), optimizer_tier.close]
    if params_tier is not optimizer_tier:
        steps.append(params_tier.close)
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - free the rest, report the first
            log.warning("zkernel.engine.free_failed", error=str(exc))
            error = error or exc
    return error


def abandon(key, module_refs, handles, optimizer_tier, params_tier, worker, paths) -> None:
    """Finalizer of an engine dropped without close (or alive at exit): local clean-up only."""
    lifecycle.unregister_cleanup(key)
    paths.close()
    lifecycle.abandon(module_refs)
    free(handles, optimizer_tier, params_tier, worker)
