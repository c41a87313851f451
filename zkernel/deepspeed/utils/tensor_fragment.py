"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` / ``safe_get_local_*`` over a zkernel engine.

A parameter of the model is given (``engine.module.named_parameters()``);
its fp32 master, optimizer state and reduced gradient are sharded over the
ranks and may live on the CPU or on disk (the optimizer tier's). A *full*
getter is collective: each rank writes the elements its shard holds
(`ParamSite.fragments`) into a zeroed flat tensor of the whole parameter and
one all-reduce (a sum: each element comes from one rank) makes it whole on
every rank, so every rank must ask for the same parameters in the same order,
as with DeepSpeed. A *local* getter returns this rank's elements alone (1-D,
possibly empty), with no collective. Results are fp32 tensors on the compute
device, shaped as the parameter (a full one), and copies: writing them changes
nothing.

A parameter the engine does not train (frozen, or of no engine built by
`zkernel.deepspeed.initialize`) gets None, as in DeepSpeed, except that
``safe_get_full_grad`` then returns ``param.grad`` as DeepSpeed does.

[Note: the gradient's scale] ``safe_get_full_grad`` returns the gradient the
optimizer will read at the step, as DeepSpeed's: reduced over the ranks
(their mean), summed over the accumulation window's micro-batches each of
whose losses `engine.backward` divided by ``gradient_accumulation_steps``, and
under fp16 still multiplied by the loss scale (``engine.loss_scaler.scale``;
the step divides it out, and clipping applies after). So after the window's
last backward it equals the ``.grad`` a plain torch model gets from the mean
loss over the global batch (times the loss scale under fp16). Valid after a
backward and before its step; after the step (or before any backward) there
is no gradient and it returns None.

[Note: masters during a host step] Where the optimizer steps a group on the
host (``offload.optimizer`` ``cpu`` or ``nvme``), the window's step starts
during its last backward ([Note: early and speculative steps] in
`zkernel.kernel.step_pipeline`), so between that backward and `step` the
master and state are being updated, and may yet be rolled back: reading or
setting them then is refused with an error saying when to call instead
(before the backward, or after ``engine.step()``), rather than answering
with values DeepSpeed would not give or losing a write. The gradient stays
readable then (the step only reads it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zkernel.deepspeed.utils.param_sites import ParamSite, site_of
from zkernel.kernel.closed import closed_error
from zkernel.params.shard_values import read_shard_values, write_shard_values

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]


# -- getters ----------------------------------------------------------------------------------


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (what the next step starts from), shaped as the parameter, on
    the compute device; None where the engine does not train it. Collective: call on every rank."""
    site = site_of(param)
    if site is None:
        return None
    return _whole(site, _read_shard(site, None, "safe_get_full_fp32_param()"))


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` of ``param`` (``"exp_avg"``, ``"exp_avg_sq"`` for
    Adam), fp32, shaped as the parameter; None where the engine does not train it. A key the optimizer
    does not keep per element is a `KeyError` listing those it keeps. Collective."""
    site = site_of(param)
    if site is None:
        return None
    return _whole(site, _read_shard(site, optim_state_key, "safe_get_full_optimizer_state()"))


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole reduced gradient of ``param`` for the step to come ([Note: the gradient's scale]), fp32,
    shaped as the parameter; None where none landed in this window or the engine does not train it
    (``param.grad`` for a parameter of no engine). Call after ``engine.backward`` and before
    ``engine.step()``. Collective."""
    site = site_of(param)
    if site is None:
        return param.grad
    return _whole(site, _read_grad(site, "safe_get_full_grad()"))


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of ``param``'s fp32 master, 1-D in the parameter's element order (empty
    where this rank's shard holds none of it; the whole parameter where every rank holds it whole);
    None where the engine does not train it. Not collective."""
    site = site_of(param)
    if site is None:
        return None
    return _local(site, _read_shard(site, None, "safe_get_local_fp32_param()"))


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's elements of ``param``'s optimizer state ``optim_state_key``, as
    `safe_get_local_fp32_param` gives the master's. Not collective."""
    site = site_of(param)
    if site is None:
        return None
    return _local(site, _read_shard(site, optim_state_key, "safe_get_local_optimizer_state()"))


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of ``param``'s reduced gradient, as `safe_get_local_fp32_param` gives the
    master's; None where none landed in this window or the engine does not train it. Not collective."""
    site = site_of(param)
    if site is None:
        return None
    shard = _read_grad(site, "safe_get_local_grad()")
    return None if shard is None else _local(site, shard)


# -- setters ----------------------------------------------------------------------------------


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (the whole parameter, any float dtype and device) ``param``'s fp32 master: the next
    step starts from it and the next forward computes with it (rounded to the compute dtype). The
    optimizer state stays. Collective (the ranks' whole copies are refreshed): call on every rank with
    the same value. Does nothing where the engine does not train ``param``."""
    site = site_of(param)
    if site is None:
        return
    engine = _writable(site, "safe_set_full_fp32_param()")
    _write_fragments(engine, site, value, key=None)
    with engine.scheduler.plugin_call():  # the partitioner's whole copies take the new values
        engine.params_tier.to_device(site.group, consume=True, block=True)
        engine.hook.zkernel_restore_state(group=site.group)
        engine.params_tier.drop_device(site.group)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Make ``value`` (the whole parameter's shape) ``param``'s optimizer state ``optim_state_key``; the
    next step uses it. Call on every rank with the same value (each keeps its own elements). Does
    nothing where the engine does not train ``param``."""
    site = site_of(param)
    if site is None:
        return
    engine = _writable(site, "safe_set_full_optimizer_state()")
    _write_fragments(engine, site, value, key=optim_state_key)


# -- internals --------------------------------------------------------------------------------


def _write_fragments(engine, site: ParamSite, value, key: str | None) -> None:
    """Write this rank's elements of the whole ``value`` into ``site``'s group: its master (``key``
    None) or its optimizer state ``key``; the rest of the group's values stay."""
    flat = _flat_value(site, value)
    master, kept = read_shard_values(engine, site.group)
    target = master if key is None else kept[_state_key(site, kept, key)]
    for frag in site.fragments:
        target[frag.offset : frag.offset + frag.numel].copy_(flat[frag.start : frag.start + frag.numel])
    write_shard_values(engine, site.group, master, kept)


def _open_engine(site: ParamSite, what: str):
    engine = site.engine
    if engine is None or engine.closed:
        raise closed_error(what)
    return engine


def _check_not_stepping(site: ParamSite, what: str):
    """The engine, once the group's master and state are at rest ([Note: masters during a host step])."""
    engine = _open_engine(site, what)
    if engine._backward_done and engine.is_accumulation_boundary and engine.optimizer_tier.steps_on_host(site.group):
        raise RuntimeError(
            f"{what} of {site.name!r} was called between the last backward of an accumulation window and "
            "engine.step(): with the optimizer on the host (offload.optimizer) that step starts during "
            "backward, so the fp32 master and optimizer state are being updated now; call it after "
            "engine.step() (or before the window's last backward). safe_get_full_grad works here"
        )
    engine.pipeline.wait_all()  # the last step's host updates are in
    return engine


def _writable(site: ParamSite, what: str):
    engine = _check_not_stepping(site, what)
    if any(g.gathered for g in engine.scheduler.bound):
        raise RuntimeError(
            f"{what} of {site.name!r} cannot run between a forward and its backward or inside "
            "GatheredParameters (the gathered parameters would keep the old values); call it between steps"
        )
    engine._fold_writes()  # writes to whole parameters reach the masters first, as state_dict() does
    return engine


def _read_shard(site: ParamSite, key: str | None, what: str) -> torch.Tensor:
    """This rank's fp32 master (``key`` None) or state ``key`` of the parameter's group, as the tier
    lends it: read only, before the next call into the tier."""
    engine = _check_not_stepping(site, what)
    state = engine.optimizer_tier.read_state(site.group)
    if key is None:
        return state.master
    return state.state[_state_key(site, state.state, key)]


def _state_key(site: ParamSite, state, key: str) -> str:
    per_element = sorted(
        name for name, t in state.items() if isinstance(t, torch.Tensor) and tuple(t.shape) == (site.layout.numel,)
    )
    if key not in per_element:
        raise KeyError(
            f"optimizer state {key!r} is not one the optimizer keeps per element of {site.name!r}; "
            f"valid: {per_element}"
        )
    return key


def _read_grad(site: ParamSite, what: str) -> torch.Tensor | None:
    engine = _open_engine(site, what)
    try:
        return engine.optimizer_tier.read_grad(site.group)
    except NotImplementedError as exc:
        raise NotImplementedError(
            f"{what}: offload tier {type(engine.optimizer_tier).__name__} does not lend its gradients "
            "(OptimizerTier.read_grad)"
        ) from exc


def _whole(site: ParamSite, shard: torch.Tensor | None) -> torch.Tensor | None:
    """The whole parameter from every rank's fragments (collective where the layout is sharded); None
    where no rank had a ``shard``. The last element of the sum counts the ranks that had one."""
    engine = site.engine
    numel = site.numel
    flat = torch.zeros(numel + 1, dtype=torch.float32, device=site.comm_device())
    if shard is not None:
        source = shard.detach().reshape(-1)
        for frag in site.fragments:
            flat[frag.start : frag.start + frag.numel].copy_(source[frag.offset : frag.offset + frag.numel])
        flat[numel] = 1.0
    if engine.dist.distributed and not site.layout.replicated:
        dist.all_reduce(flat)
    if flat[numel].item() == 0:
        return None
    return flat[:numel].view(site.shape).to(engine.device)


def _local(site: ParamSite, shard: torch.Tensor) -> torch.Tensor:
    source = shard.detach().reshape(-1)
    pieces = [source[f.offset : f.offset + f.numel] for f in sorted(site.fragments, key=lambda f: f.start)]
    out = torch.cat(pieces) if pieces else source.new_empty(0)
    return out.to(device=site.engine.device, dtype=torch.float32, copy=True)


def _flat_value(site: ParamSite, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"the value for {site.name!r} must be a tensor, not a {type(value).__name__}")
    if value.numel() != site.numel:
        raise ValueError(
            f"the value for {site.name!r} has shape {tuple(value.shape)} ({value.numel()} elements); "
            f"valid: the whole parameter's {tuple(site.shape)} ({site.numel} elements)"
        )
    return value.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
