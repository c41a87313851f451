"""The one order in which every rank issues its groups' gradient reductions, whatever it used.

[Note: reduction order] A group's reduction is a collective, so every rank
must issue the groups' reductions in the same order. The scheduler used to
issue each as soon as the group's last gradient arrived. Where ranks use
different parameters (an expert no token of this rank chose, a branch taken
on one rank, LayerDrop), a group is complete at different points of the
backward on different ranks, or only at its end, and the reductions
mismatched: the path check stopped the job with `RankDivergenceError`.
DDP solves this with a fixed bucket order, and we do the same:

* every rank issues the reductions in one order; a group complete before
  those ahead of it waits for them, and `finish` issues the rest in order
  (those a rank left incomplete as well);
* the first backward uses a provisional order (groups by their first
  parameter's registration, latest first: the order backward usually reaches
  them), and records the order its groups actually completed in; rank 0's
  record, broadcast once at the end of that backward, is every rank's order
  from then on (DDP rebuilds its buckets once from the first iteration the
  same way). Groups that did not complete in that backward go at its end, so
  they hold nothing up when they are unused again;
* where ranks use the same parameters, groups complete in that order and
  nothing waits. A group left incomplete by a parameter this rank did not use
  holds back those after it until the end of backward; once that happened,
  the rank looks, at the start of each backward, for the parameters the
  autograd graph cannot reach (DDP's ``find_unused_parameters``) and counts
  them as done at once (`unreachable_params`). The search is skipped where
  the graph holds a reentrant checkpoint (which reaches its parameters only
  when it runs). A parameter counted as done that gets a gradient anyway
  joins its group's reduction where that has not been issued yet, and is an
  error naming it where it has: never a silently wrong gradient.

Only the order in which reductions are *issued* is fixed; a module-bound
group still releases its gathered parameters as soon as its gradients are
complete (but not one complete at the start of backward, which the backward
may still gather). Which groups are complete differs between ranks, so under
zero3 it decides no gather, a collective too (the prefetcher's rank-local
stages only). With one rank there is no collective and no order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from zkernel.spec.groups import ParamGroup


def provisional_order(groups: Sequence[ParamGroup], registration: Mapping[int, int]) -> list[int]:
    """Trainable groups' indices, latest first parameter (by ``registration``: parameter id -> its
    position among the model's parameters) first; ties and unknown parameters by group index."""
    def first_registered(group: ParamGroup) -> int:
        return min((registration.get(id(p), -1) for p in group.params), default=-1)

    trainable = [g for g in groups if g.requires_grad]
    return [g.index for g in sorted(trainable, key=lambda g: (-first_registered(g), g.index))]


def broadcast_from_rank0(order: list[int], device: torch.device) -> list[int]:
    """Rank 0's ``order`` on every rank (a collective; every rank passes a list of the same length)."""
    values = torch.tensor(order, dtype=torch.int64)
    if dist.get_backend() == "nccl":
        values = values.to(device)
    dist.broadcast(values, src=0)
    return values.cpu().tolist()


class ReductionOrder:
    """Which complete groups may be reduced now, so that every rank issues them in one order."""

    def __init__(self, order: list[int], agree: Callable[[list[int]], list[int]]) -> None:
        self.order = list(order)
        self._agree = agree
        self.learned = False
        self.search_unreachable = False  # see [Note: reduction order]
        self.begin()

    @classmethod
    def of_model(cls, root: torch.nn.Module, groups: Sequence[ParamGroup], device: torch.device) -> ReductionOrder:
        """The order of ``groups`` of ``root``'s parameters, agreed through ``device`` (the collectives')."""
        registration = {id(p): i for i, p in enumerate(root.parameters())}
        return cls(provisional_order(groups, registration), lambda record: broadcast_from_rank0(record, device))

    def begin(self) -> None:
        """A backward starts (also after one that raised)."""
        self._next = 0  # position in ``order`` of the next group to issue
        self._waiting: set[int] = set()  # complete, not issued: a group ahead of them is not complete
        self._completed: list[int] = []  # this backward's completion order, for `learn`

    def complete(self, index: int) -> list[int]:
        """Group ``index`` has all its gradients: the groups to reduce now, in order."""
        if not self.learned:
            self._completed.append(index)
        order, at = self.order, self._next
        if not self._waiting and at < len(order) and order[at] == index:  # the usual case: next in order
            self._next = at + 1
            return [index]
        self._waiting.add(index)
        ready = []
        while self._next < len(self.order) and self.order[self._next] in self._waiting:
            self._waiting.discard(self.order[self._next])
            ready.append(self.order[self._next])
            self._next += 1
        return ready

    def finish(self) -> list[int]:
        """End of backward: every group not issued yet, in order (complete or not). A group this
        rank left incomplete that held complete ones back turns on the search for unreachable
        parameters; the first backward's completion order becomes every rank's order."""
        rest = self.order[self._next:]
        if self._waiting and self.learned:
            self.search_unreachable = True
        if not self.learned:
            seen = set(self._completed)
            record = self._completed + [i for i in self.order if i not in seen]
            self.order = self._agree(record)
            self.learned = True
        self.begin()
        return rest


_REENTRANT = ("CheckpointFunctionBackward",)


def unreachable_params(
    loss: torch.Tensor | Sequence[torch.Tensor], params: Iterable[torch.Tensor]
) -> set[int] | None:
    """Ids of ``params`` the autograd graph of ``loss`` (or of every tensor of a sequence: the
    outputs a backward the engine was not told of starts from) does not reach (no gradient will
    come), or None where that cannot be known (a reentrant checkpoint reaches its parameters only
    when it runs in backward)."""
    tensors = [loss] if isinstance(loss, torch.Tensor) else list(loss)
    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    if not roots:
        return None
    reached: set[int] = set()
    seen = set(roots)
    stack = list(roots)
    while stack:
        node = stack.pop()
        if type(node).__name__ in _REENTRANT:
            return None
        for child, _ in node.next_functions:
            if child is None or child in seen:
                continue
            seen.add(child)
            variable = getattr(child, "variable", None)  # AccumulateGrad: a leaf
            if variable is not None:
                reached.add(id(variable))
            else:
                stack.append(child)
    return {id(p) for p in params if id(p) not in reached}
