"""How the engine, its scheduler and its step pipeline refer to each other.

`Engine.__init__` builds the three in one order and hands each what it asks
for, by these names:

* the step pipeline first (`zkernel.kernel.step_pipeline.StepPipeline`): it
  refers to neither of the others. The scheduler it publishes through is an
  argument of `StepPipeline.step` (a `Publisher`), the one call that needs it.
  The step's scaling and skip decisions
  (`zkernel.kernel.step_scaling.StepScaling`) are built over it; they too
  refer to neither the engine nor the scheduler.
* the scheduler next (`zkernel.kernel.scheduler.Scheduler`): it gets the
  pipeline as its `StepGate` (the gradient handoff and the pending updates)
  and the engine's side as one `EngineServices` value.
* the engine keeps both, and counts micro-steps in the `MicroSteps` it shares
  with the scheduler.

[Note: weak links] The scheduler is reachable from the model (its module
hooks, its gradient hooks in the parameters' autograd state, the
released-parameter trap, the ``generate`` guard), and a user may keep the
model after dropping the engine, closed or not (after a failed step, say).
Whatever the model reaches must not reach the engine: an engine kept alive by
its model never runs its finalizer, which takes the hooks off again. So:

* nothing the scheduler holds refers to the engine. What it reads of the
  engine's state, the micro-step count, lives in `MicroSteps`, which both hold;
  `EngineServices` carries no engine.
* the step pipeline holds no scheduler (the engine passes it to
  `StepPipeline.step`), so the two form no cycle: once the hooks are off, both
  go with the engine, by reference counting.
* the hooks installed on the model refer to the scheduler weakly: a gradient
  hook lives in a parameter's C++ autograd state, which Python's cycle
  collector cannot see through, so a strong reference there would make a cycle
  (parameter, hook, scheduler, its groups, parameter) that is never collected,
  even after the user drops the engine and the model
  (`Scheduler._make_grad_ready_hook`, `Scheduler._make_fetcher`, and
  `zkernel.kernel.entries.GenerateGuarded`).
* `zkernel.params.param_writes.WriteFolder`, which the scheduler calls to keep
  writes to whole parameters, reaches the engine's tiers and pipeline through
  a weak reference to the engine, for the same reason.
* the engine's finalizer (``weakref.finalize`` in `Engine.__init__`, registered
  with `zkernel.kernel.lifecycle`) holds the hook handles, tiers, worker and
  path check, and weak references to the modules; never the engine.

These are the only weak references among the three; each site refers here.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
from torch import nn

from zkernel.params.param_writes import WriteFolder
from zkernel.params.unset import UnsetValues
from zkernel.spec.groups import ParamGroup, ReducedGradient


class StepGate(Protocol):
    """What the scheduler asks of the step pipeline (`StepPipeline` is one).

    Called on the training thread (a forward's fetches) and on autograd's thread
    (a backward's fetches, prefetches and gradient handoffs)."""

    def land(self, group: ParamGroup, reduced: ReducedGradient, final: bool, unused: frozenset[int] = frozenset()) -> None:
        """Hand ``group``'s reduced gradient to the optimizer tier."""

    def wait_update(self, group: ParamGroup) -> None:
        """Block until ``group``'s pending update is in its parameter shard."""

    def update_pending(self, group: ParamGroup) -> bool:
        """Whether ``group`` has an update still running on the host."""


class Publisher(Protocol):
    """What the step pipeline asks of the scheduler during `StepPipeline.step` (`Scheduler` is one).

    Called on the training thread, inside `Engine.step`."""

    def publish(self, group: ParamGroup) -> None:
        """Make ``group``'s updated parameters visible (the partitioner's all-gather)."""

    def prefetch_updated(self, group: ParamGroup) -> None:
        """``group``'s device update is queued: start its gather when the next forward starts with it."""


@attrs.define(slots=True)
class MicroSteps:
    """The engine's micro-step count, shared with the scheduler ([Note: weak links]).

    `Engine.step` advances it (training thread); the scheduler reads it where a
    forward of the model begins, however the model is called."""

    accumulation_steps: int
    count: int = 0

    def window(self) -> tuple[bool, int]:
        """(whether the micro-step being computed ends an accumulation window, its number)."""
        return (self.count + 1) % self.accumulation_steps == 0, self.count


@attrs.frozen(kw_only=True)
class EngineServices:
    """What the scheduler asks of the engine that built it; nothing in it refers to the engine
    ([Note: weak links]).

    ``root``: the model (its entry modules bracket a pass; None: no pass tracking);
    ``micro_steps``: the engine's count; ``unset``: values no one has written, which a
    forward refuses ([Note: values left unset]); ``writes``: folds writes to whole
    parameters into their masters ([Note: writes to gathered parameters]); ``backward_pass``:
    what opens and closes a ``loss.backward()`` the engine is not told of ([Note: a backward the
    engine is not told of] in `zkernel.kernel.user_backward`), reaching the engine weakly."""

    root: nn.Module | None
    micro_steps: MicroSteps
    unset: UnsetValues | None
    writes: WriteFolder
    # Hears of a backward nobody announced (`zkernel.kernel.user_backward.BackwardPass`); None: none.
    backward_pass: Any = None
