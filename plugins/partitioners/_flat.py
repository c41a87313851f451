"""Helpers the partitioners share: flat layouts, grouping, gradient gathering.

[Note: flat layout] A group's parameters are laid end to end in one flat
buffer, padded to a multiple of the number of shards; rank ``r`` owns the
contiguous slice ``[r * S, (r + 1) * S)``. A parameter may straddle two ranks'
slices, which is harmless because Adam is elementwise and the gradient norm is
a sum of squares. This layout makes every collective a single call on one
contiguous tensor (``all_gather_into_tensor`` writes the gathered parameters
straight into the buffer the parameters are views of, ``reduce_scatter_tensor``
reads the flat gradient as is), and it gives the optimizer one flat fp32 shard
per group, which is what a fused or native Adam wants. Per-parameter sharding
(FSDP2) would keep 0-dim parameters and dim-0 slicing natural but needs a copy
in and out around each collective.

[Note: aligned parameters] Each parameter starts at a multiple of `ALIGN`
elements of the flat buffer, and each rank's slice is a multiple of `ALIGN`
long (the buffers themselves come from the caching allocator, 512-byte
aligned). Laid end to end, one parameter whose element count is not a multiple
of 8 (a vocabulary bias of 30,522 or 50,265, a scalar gate) would move every
later parameter of its group off the 16-byte boundary that cuBLAS's fastest
matmul kernels and torch's vectorised elementwise kernels need (FSDP1 pads
its flat parameters for the same reason). The gaps hold zeros in
the parameters, gradients and optimizer state, so they never change a norm or
an update. A bf16 weight a few bytes off the boundary runs its matmuls several
times slower (`bench/flat_alignment.py`; BENCHMARKS.md, "Figures formerly in docstrings").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs
import torch
import torch.distributed as dist
from torch import nn

from zkernel.spec.groups import Fragment, ShardLayout
from zkernel.params.unit_modules import unit_module_ids

ALIGN = 16  # elements: 16 bytes in 1-byte dtypes, 32 in bf16, 64 in fp32 (see [Note: aligned parameters])
# A gradient at least this large is copied by the copy engines where a stream of its own moves it.
COPY_ENGINE_MIN_BYTES = 1 << 20


@attrs.frozen
class FlatLayout:
    """Where each parameter of a group sits in the group's flat buffer."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int  # up to the end of the last parameter, alignment gaps included
    shards: int
    rank: int
    gaps: tuple[tuple[int, int], ...] = ()  # [start, stop) between parameters, zeros

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], shards: int, rank: int) -> FlatLayout:
        offsets, gaps, total = [], [], 0
        for p in params:
            start = _round_up(total, ALIGN)
            if start > total:
                gaps.append((total, start))
            offsets.append(start)
            total = start + p.numel()
        return cls(
            shapes=tuple(p.shape for p in params),
            offsets=tuple(offsets),
            numels=tuple(p.numel() for p in params),
            numel=total,
            shards=shards,
            rank=rank,
            gaps=tuple(gaps),
        )

    @property
    def shard_size(self) -> int:
        return _round_up(max(1, math.ceil(self.numel / self.shards)), ALIGN)

    @property
    def padded(self) -> int:
        return self.shard_size * self.shards

    @property
    def own(self) -> slice:
        start = self.rank * self.shard_size
        return slice(start, start + self.shard_size)

    def shard_layout(self, replicated: bool = False) -> ShardLayout:
        """Which parameter elements this rank's slice holds (see `zkernel_describe_shard`)."""
        own = self.own if self.shards > 1 else slice(0, self.padded)
        fragments = []
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(offset, own.start), min(offset + numel, own.stop)
            if lo < hi:
                fragments.append(Fragment(param=index, start=lo - offset, numel=hi - lo, offset=lo - own.start))
        return ShardLayout(numel=own.stop - own.start, fragments=tuple(fragments), replicated=replicated)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view into ``flat`` (a tensor of ``padded`` elements)."""
        return [
            flat[o : o + n].view(shape)
            for o, n, shape in zip(self.offsets, self.numels, self.shapes)
        ]

    def zero_padding(self, flat: torch.Tensor) -> None:
        """Zero the gaps between parameters and the end padding of ``flat`` (``padded`` elements)."""
        pads = [flat[start:stop] for start, stop in self.gaps]
        if self.padded > self.numel:
            pads.append(flat[self.numel :])
        if len(pads) == 1:
            pads[0].zero_()
        elif pads:
            torch._foreach_zero_(pads)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def flatten_into(flat: torch.Tensor, layout: FlatLayout, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` into their places in ``flat`` and zero the padding."""
    torch._foreach_copy_(layout.views(flat), [t.detach() for t in tensors])
    layout.zero_padding(flat)


def _take_grads(params: Sequence[nn.Parameter], layout: FlatLayout, out: torch.Tensor):
    """Each parameter's ``.grad`` beside its view into ``out``, dropping it from the parameter:
    (views, gradients), and the views of the parameters without a gradient in this backward."""
    views, grads, missing = [], [], []
    # ZeRO-3 has released the parameters by now: ``.grad`` is readable, but through the
    # released-parameter trap's Python handler (`zkernel.params.released`) unless subclasses are off.
    with torch._C.DisableTorchFunctionSubclass():
        for p, view in zip(params, layout.views(out)):
            grad = p.grad
            if grad is None:
                missing.append(view)
            else:
                views.append(view)
                grads.append(grad)
                p.grad = None
    return views, grads, missing


def gather_grads(
    params: Sequence[nn.Parameter], layout: FlatLayout, out: torch.Tensor, accumulate: bool
) -> None:
    """Move each parameter's ``.grad`` into ``out`` (added when ``accumulate``) and drop it.

    A parameter without a gradient in this backward contributes zeros.
    """
    views, grads, missing = _take_grads(params, layout, out)
    if accumulate:
        if views:
            torch._foreach_add_(views, grads)  # casts to ``out``'s dtype in the same pass
    else:
        if views:
            torch._foreach_copy_(views, grads)
        for view in missing:
            view.zero_()
        layout.zero_padding(out)


def copy_grads_by_copy_engine(params: Sequence[nn.Parameter], layout: FlatLayout, out: torch.Tensor) -> list[torch.Tensor]:
    """Copy each parameter's ``.grad`` into ``out`` on the current stream and drop it; returns the
    gradients read, which the caller keeps from reuse until the stream is past them (``record_stream``).

    Gradients of at least `COPY_ENGINE_MIN_BYTES` in ``out``'s dtype go one copy each, which the
    GPU's copy engines carry without a multiprocessor; the rest go in one kernel. Missing
    gradients and the padding are zeros.
    """
    views, grads, missing = _take_grads(params, layout, out)
    small_views, small_grads = [], []
    for view, grad in zip(views, grads):
        if grad.dtype == out.dtype and grad.is_contiguous() and grad.numel() * grad.element_size() >= COPY_ENGINE_MIN_BYTES:
            view.copy_(grad)
        else:
            small_views.append(view)
            small_grads.append(grad)
    if small_views:
        torch._foreach_copy_(small_views, small_grads)
    for view in missing:
        view.zero_()
    layout.zero_padding(out)
    return grads


def unique_named_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters with tied ones listed once, under their first name."""
    return list(module.named_parameters(remove_duplicate=True))


def split_buckets(
    named: Sequence[tuple[str, nn.Parameter]], bucket_numel: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of parameters of at most ``bucket_numel`` elements (one may exceed it alone).

    Parameters are taken in reverse registration order, which approximates the
    order their gradients become ready in backward, so early buckets can be
    reduced while backward goes on.
    """
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in reversed(list(named)):
        if current and size + p.numel() > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += p.numel()
    if current:
        buckets.append(current)
    return buckets


def split_trainable(
    named: Iterable[tuple[str, nn.Parameter]],
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    trainable, frozen = [], []
    for name, p in named:
        (trainable if p.requires_grad else frozen).append((name, p))
    return trainable, frozen


def module_units(
    module: nn.Module, policy: str = "modules", leaf_modules: tuple[str, ...] = (), leaf_experts: bool = True
) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """The units of ZeRO-3: modules with the parameters gathered around their forward.

    ``"modules"``: every module that directly owns parameters is a unit with
    those parameters (DeepSpeed's granularity). ``"blocks"``: the root and every
    element of an ``nn.ModuleList``/``nn.Sequential`` is a unit, holding all
    parameters of its subtree that no nested unit holds (FSDP2's usual
    per-block wrapping: fewer, larger collectives). Under either, a module
    compiled in place is a unit with its whole subtree (see [Note: compiled
    units] in `zkernel.platform.compiled`), and so is each module ``leaf_modules``
    selects (see [Note: leaf modules] in `zkernel.params.unit_modules`), and, with
    ``leaf_experts``, each mixture-of-experts layer (see [Note: expert
    layers] there). A tied parameter belongs to the first unit that reaches it.
    """
    unit_ids = unit_module_ids(module, policy, leaf_modules, leaf_experts)
    seen: set[int] = set()
    units: dict[int, tuple[str, nn.Module, list]] = {}

    def visit(name: str, mod: nn.Module, unit_name: str, unit: nn.Module) -> None:
        if id(mod) in unit_ids:
            unit_name, unit = name, mod
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            entry = units.setdefault(id(unit), (unit_name, unit, []))
            entry[2].append((f"{name}.{pname}" if name else pname, p))
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, unit_name, unit)

    visit("", module, "", module)
    return list(units.values())


# torch 2.13 renamed the flat collectives (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_gloo() -> bool:
    return dist.is_initialized() and dist.get_backend() == "gloo"


def all_gather_flat(full: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
    """All-gather ``shard`` from every rank into ``full``; ``shard`` may be a view of ``full``."""
    if is_gloo() and shard.data_ptr() >= full.data_ptr() and shard.data_ptr() < full.data_ptr() + full.numel() * full.element_size():
        shard = shard.clone()  # gloo does not support the in-place form
    return _all_gather(full, shard, async_op=async_op)


def _mean_op(full: torch.Tensor):
    """NCCL averages in the collective; gloo has no AVG, so ``full`` is pre-divided."""
    if dist.get_backend() == "nccl":
        return dist.ReduceOp.AVG
    full.mul_(1.0 / dist.get_world_size())
    return dist.ReduceOp.SUM


def reduce_scatter_mean(shard_out: torch.Tensor, full: torch.Tensor, async_op: bool = False):
    """Average ``full`` over ranks and leave this rank's slice in ``shard_out`` (``full`` may be scaled)."""
    return _reduce_scatter(shard_out, full, op=_mean_op(full), async_op=async_op)


def all_reduce_mean(full: torch.Tensor, async_op: bool = False):
    """Average ``full`` over ranks in place."""
    return dist.all_reduce(full, op=_mean_op(full), async_op=async_op)

