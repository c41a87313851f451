"""Which groups have all their gradients in this backward, and which to reduce when.

The scheduler's post-accumulate-grad hooks report each parameter's gradient
here (`arrived`); a group is complete when every trainable parameter of it got
one, or, once the rank searches the autograd graph (see [Note: reduction
order] in `zkernel.kernel.reduction_order`), when every one the graph can reach did.
Complete groups are reduced at once with one rank, and in the order every rank
follows with several (`complete`); the end of backward reduces the rest
(`flush`). It also records which parameters got a gradient in the window, for
the optimizer's skipping (see [Note: parameters without a gradient] in
`zkernel.kernel.unused_params`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zkernel.spec.groups import ParamGroup
from zkernel.kernel.reduction_order import ReductionOrder, unreachable_params


class GradReadiness:
    """Per-backward gradient counts of ``groups``, and the window's used parameters."""

    def __init__(self, groups: Sequence[ParamGroup], order: ReductionOrder | None) -> None:
        self.order = order  # the order reductions are issued in, with several ranks
        self.trainable = [g for g in groups if g.requires_grad]
        self._by_index = {g.index: g for g in groups}
        # Trainable group index -> positions of its parameters that got a gradient in this window.
        self.window_used: dict[int, set[int]] = {}
        self.complete: set[int] = set()  # groups whose gradients are all in, this backward
        self.reduced: set[int] = set()  # groups whose reduction was issued, this backward
        self._count = {g.index: 0 for g in self.trainable}
        self._presumed: set[tuple[int, int]] = set()  # (group, position) the graph cannot reach

    def begin(self, loss: torch.Tensor | Sequence[torch.Tensor] | None) -> list[ParamGroup]:
        """A backward of ``loss`` starts (also after one that raised): the groups complete already,
        none of whose parameters the loss's graph reaches (only once the rank searches it).
        ``loss`` may be the outputs a backward the engine was not told of starts from; None: no
        search."""
        self.reset()
        if self.order is None:
            return []
        self.order.begin()
        if not self.order.search_unreachable or loss is None:
            return []
        unreachable = unreachable_params(loss, (p for g in self.trainable for p in g.params))
        if not unreachable:
            return []
        done = []
        for group in self.trainable:
            for position, p in enumerate(group.params):
                if id(p) in unreachable:
                    self._presumed.add((group.index, position))
                    self._count[group.index] += 1
            if self._count[group.index] == len(group.params):
                done.append(group)
        return done

    def reset(self) -> None:
        """Forget this backward's counts (at its end, and before the next)."""
        self.complete.clear()
        self.reduced.clear()
        self._presumed.clear()
        self._count = dict.fromkeys(self._count, 0)

    def arrived(self, index: int, position: int, total: int) -> ParamGroup | None:
        """The parameter at ``position`` of group ``index`` (of ``total``) got its gradient: the
        group, if that completes it."""
        used = self.window_used.get(index)
        if used is None:
            used = self.window_used[index] = set()
        used.add(position)
        if self._presumed and (index, position) in self._presumed:
            self._presumed.discard((index, position))  # counted at `begin`
            if index in self.reduced:
                group = self._by_index[index]
                raise RuntimeError(
                    f"parameter {group.param_names[position]!r} got a gradient in backward that the autograd "
                    "graph of the loss did not reach when the backward began (something computed inside the "
                    f"backward used it), after its group {group.name!r} was reduced without it. Compute it in "
                    "the forward, or use a non-reentrant checkpoint (torch.utils.checkpoint with use_reentrant=False)"
                )
            return None
        count = self._count[index] = self._count[index] + 1
        return self._by_index[index] if count == total else None

    def to_reduce(self, group: ParamGroup) -> list[ParamGroup]:
        """``group`` is complete: the groups to reduce now, in order."""
        self.complete.add(group.index)
        if self.order is None:
            return [group]
        ready = self.order.complete(group.index)
        if len(ready) == 1 and ready[0] == group.index:
            return [group]
        return [self._by_index[i] for i in ready]

    def incomplete(self) -> list[ParamGroup]:
        """At the end of backward: the trainable groups some of whose gradients never came, in group order."""
        return [g for g in self.trainable if g.index not in self.complete]

    def flush(self) -> list[ParamGroup]:
        """At the end of backward: every group not reduced yet, in the order to reduce them."""
        if self.order is None:
            return [g for g in self.trainable if g.index not in self.reduced]
        return [self._by_index[i] for i in self.order.finish()]

    def unused_in_window(self, group: ParamGroup) -> frozenset[int]:
        """Positions of ``group``'s parameters that got no gradient in this window so far."""
        used = self.window_used.get(group.index, ())
        return frozenset(range(len(group.params))).difference(used) if len(used) < len(group.params) else frozenset()
