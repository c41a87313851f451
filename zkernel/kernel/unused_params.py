"""Which parameters a window skips, agreed by every rank, and what an optimizer must leave as it was.

[Note: parameters without a gradient] torch's optimizers skip a parameter
whose ``grad`` is None: one no sample of the window used (a branch not taken,
an expert no token chose, a parameter frozen after `zkernel.initialize`). The
scheduler records which parameters of each group got a gradient in the window
(post-accumulate-grad hooks), and at the boundary every rank learns which no
rank gave one (`UnusedParams.agree`: one all-reduce of a flag per parameter;
the host waits for it only where it has something unused itself), so a
parameter some rank used is stepped on every rank, as under DDP. The step
pipeline does not step a group none of whose parameters got one (nor bring its
state in); a group some of whose parameters got none steps with
``StepOptions.skip_params`` naming them, so the optimizer leaves their elements
and state as they are (the Adam optimizers keep a step count per parameter, see
[Note: per-parameter steps] in ``plugins/optimizers/_adam_state.py``). For an
optimizer that does not declare ``skips_params`` the pipeline puts their
elements back after the step (`keep_elements`), which is exact for
per-element state such as momentum. Such a group is never stepped during
backward: which of its parameters another rank used is known only after it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from zkernel.spec.groups import ParamGroup


class UnusedParams:
    """The ranks' agreement on the parameters no rank gave a gradient in a window."""

    def __init__(self, trainable: Sequence[ParamGroup], distributed: bool) -> None:
        self.trainable = list(trainable)
        self.distributed = distributed
        self._base: dict[int, int] = {}  # group index -> its first parameter's flag
        self._count = 0
        for group in self.trainable:
            self._base[group.index] = self._count
            self._count += len(group.params)

    def agree(self, used: Mapping[int, Collection[int]]) -> dict[ParamGroup, frozenset[int]]:
        """``used``: group index -> positions of the parameters this rank gave a gradient in the
        window. Returns each group with parameters no rank gave one, with their positions. A
        collective on every rank at every boundary."""
        partial = [g for g in self.trainable if len(used.get(g.index, ())) < len(g.params)]
        if not partial and not self.distributed:
            return {}
        flags = [1] * self._count
        for group in partial:
            got, base = used.get(group.index, ()), self._base[group.index]
            for position in range(len(group.params)):
                flags[base + position] = int(position in got)
        if self.distributed:
            agreed = torch.tensor(flags, dtype=torch.int32)
            if dist.get_backend() == "nccl":
                agreed = agreed.pin_memory().to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
            work = dist.all_reduce(agreed, op=dist.ReduceOp.MAX, async_op=True)
            if not partial:
                # Every parameter got a gradient here, so none is skipped: this rank only takes
                # part for the others, and its host does not wait for the result.
                return {}
            work.wait()
            # .cpu() waits for the device with the interpreter lock released (the path watcher's reporter needs it).
            flags = agreed.cpu().tolist()
        unused = {}
        for group in partial:  # only where this rank gave some parameter no gradient can no rank have
            base = self._base[group.index]
            positions = frozenset(i for i in range(len(group.params)) if not flags[base + i])
            if positions:
                unused[group] = positions
        return unused


def keep_elements(group: ParamGroup, skip: frozenset[int]) -> Callable[[], None]:
    """Copy the elements of the parameters at ``skip`` in every tensor of ``group`` an optimizer writes
    per element (the master and its per-element state); return what puts them back, and rounds the
    master's into the copy-out, after a step. For an optimizer that does not skip parameters itself
    (see [Note: parameters without a gradient])."""
    if group.shard_layout is None:
        raise RuntimeError(
            f"group {group.name!r} has parameters no rank gave a gradient, which its optimizer does not "
            "skip itself, but its partitioner does not describe its shard (zkernel_describe_shard)"
        )
    numel = group.master.numel()
    tensors = [group.master]
    tensors += [t for t in group.optim_state.values() if isinstance(t, torch.Tensor) and t.shape == (numel,)]
    spans = [slice(f.offset, f.offset + f.numel) for f in group.shard_layout.fragments if f.param in skip]
    kept = [(tensor[span], tensor[span].clone()) for span in spans for tensor in tensors]

    def restore() -> None:
        for view, saved in kept:
            view.copy_(saved)
        if group.copy_out is not None:  # it may be a buffer lent for this step: rounded anew
            for span in spans:
                group.copy_out[span].copy_(group.master[span])

    return restore
