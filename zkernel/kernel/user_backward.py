"""A backward through the engine's model that nobody announced: ``loss.backward()`` after ``engine(...)``.

[Note: a backward the engine is not told of] `Engine.backward` brackets
its pass itself: a prologue (the window's boundary, the gradient scale,
``pipeline.begin_backward``, ``scheduler.begin_backward``), then
``backward()``, then an epilogue (``scheduler.finish_backward``,
``pipeline.end_backward``, the step's coefficient, the micro-batch counted).
A script written for plain torch calls ``loss.backward()`` (or
``output.backward(grad)``, or one backward over the losses of two engines)
and the engine never hears of it. `BackwardPass` hears of it from autograd:

* the end of every forward pass with autograd on (the root's bracket, [Note:
  forward entry] in `zkernel.kernel.scheduler`, however the model was called)
  registers a gradient hook on each of its outputs that requires grad (at the
  output's base where it is a view, as the scheduler's own hooks are: [Note:
  outputs modified in place]); a tensor hook, not an identity autograd
  Function, because a Function's outputs are views that the caller may not
  modify in place, and it leaves the outputs the very tensors the model
  returned;
* every engine event of a backward calls `BackwardPass.enter` first: those
  output hooks, the scheduler's backward fetches on a module's outputs (which
  may come first: they were registered on the same tensors earlier), and its
  post-accumulate-grad hooks on the parameters (a loss term that reaches a
  parameter without going through an output). The first such event of a
  graph task opens the pass: the engine's prologue runs there, inside the
  backward, before any gradient of the model exists, and the epilogue is
  queued to run when autograd has finished the whole graph task
  (``queue_callback``, as torch's FSDP queues its post-backward callback);
* the output hooks multiply the incoming gradient by 1 / gradient_accumulation_steps,
  what `Engine.backward` multiplies its loss by (with fp16 the loss scale
  comes from `Engine.scale`; a bare backward under fp16 without it raises
  before anything changed, since its gradients would be unscaled ones that
  the step then divides by the scale). With an accumulation of 1 the hooks
  return nothing and the gradient passes untouched.

While `Engine.backward` runs (``driven``) the hooks pass everything through
at the cost of one attribute test, so it keeps its behaviour and cost.

A graph task that accumulates no gradient into the model's parameters
(``torch.autograd.grad`` of an output for a gradient penalty,
``backward(inputs=...)`` of inputs only) is not a training backward: it opens
nothing and its gradients are not scaled. Which it is, autograd says through
``_will_engine_execute_node`` on the parameters' gradient accumulators (the
graph's own, taken inside the backward), asked once per graph task: for a
plain ``backward()`` each question walks the graph in autograd's C++ (about
0.1 ms for a thousand nodes), so the parameter the last training backward
reached is asked first and the answer is usually the first one.

A graph task inside the open pass (a reentrant checkpoint runs its own
backward) belongs to it. A pass whose backward raised never reaches its
epilogue (autograd runs queued callbacks only for a task that completed): the
next forward or step finds it stale and drops it, as `Engine.backward` leaves
an exception (the micro-batch is not counted, the next backward begins
afresh).

What the hooks cannot see: a loss term that reaches a parameter without
going through an output of a forward (a regulariser on a weight, read outside
the model) gets no 1 / accumulation factor, and an output fed into another
forward (of this model or another engine's) is scaled once per output it
passes through; the
documentation says to use `Engine.backward` for those ([Note: an output fed
to a forward] warns of the second). `Engine.backward` divides its loss once:
another engine whose outputs that backward reaches opens its pass as above
(the micro-batch is counted for its ``step()``) but divides nothing more, so
engines chained in one loss (``b(a(x))``) train right under
``b.backward(loss)``. The search for
parameters the graph cannot reach ([Note: reduction order]) starts from the
outputs marked since the last backward; where one of them is gone already
(held by nobody but the graph) there is no search, which costs overlap, never
correctness.

Threads: the prologue runs on the thread that runs the backward's hooks
(autograd's device thread on CUDA, the calling thread on the CPU), the
epilogue on the thread that completes the graph task, with the streams that
were current when ``backward()`` was called (autograd's post-processing sets
them and first makes them wait for the leaf streams); the thread that called
``backward()`` waits for both.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from zkernel.kernel.scheduler import hook_target
from zkernel.telemetry.log import get_logger

log = get_logger()

__all__ = ["BackwardPass"]

_PRUNE_AT = 64  # marked outputs kept before the dead ones are dropped
# Set on each output a forward returned, to the accumulation steps its hooks divide by: a forward
# that takes it as an argument divides its gradient again ([Note: an output fed to a forward]).
_MARK = "_zkernel_divides_by"
# How many engines run `Engine.backward` now (any thread: autograd's device threads run the hooks).
_driving = [0]


class BackwardPass:
    """Whether a backward through the engine's model is running, and its start and end when nobody
    announced it ([Note: a backward the engine is not told of]).

    Built by `Engine.__init__` over the trainable parameters; the engine's hooks in
    ``begin``/``end`` are reached through a weak reference to the engine ([Note: weak links] in
    `zkernel.kernel.wiring`). The scheduler calls `mark` at the end of each forward pass and
    `enter` at each backward event; the engine sets ``driven`` around its own backward."""

    def __init__(self, engine: Any, params: Iterable[torch.Tensor], accumulation_steps: int) -> None:
        self._engine = weakref.ref(engine)
        self._steps = accumulation_steps
        self._warned_fed = False
        self._fed = False  # a forward since the last backward took a marked output as an argument
        self._params = list(params)
        self._hit = 0  # the parameter a training backward reached last time
        self.driven = False  # `Engine.backward` runs the pass itself
        self.task: int | None = None  # the graph task of the open pass nobody announced
        self._ignored = -1  # the last graph task found to accumulate no parameter gradient
        self.scaled = False  # `Engine.scale` gave the loss of the next backward its loss scale
        self.factor = 1.0  # what the output hooks multiply gradients by in the open pass
        self._outputs: list[weakref.ref] = []  # outputs marked since the last backward began

    # -- forward ------------------------------------------------------------------

    def mark(self, output: Any) -> None:
        """Called by the scheduler at the end of a forward pass with autograd on: hook each output
        tensor that requires grad (a view at its base)."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        targets = {id(h): h for h in map(hook_target, tensors)}.values()
        me = weakref.ref(self)  # the hook lives in the graph: it must not hold the engine's side
        if len(self._outputs) >= _PRUNE_AT:
            self._outputs = [r for r in self._outputs if r() is not None]
        for target in targets:
            target.register_hook(functools.partial(_output_grad, me))
            self._outputs.append(weakref.ref(target))
        for t in tensors:
            setattr(t, _MARK, self._steps)

    def forward_begins(self, args: tuple) -> None:
        """Called by the scheduler when a forward pass begins (not a recomputation), with its
        positional arguments: a pass still open is one whose backward raised before its end
        ([Note: a backward the engine is not told of]); it is dropped.

        [Note: an output fed to a forward] A marked output passed to another forward (of this
        model or another engine's: ``b(a(x))``, an encoder's output to the decoder's pass) has
        its gradient divided by the accumulation steps at both outputs under a plain backward;
        under `Engine.backward` it is divided once. So a plain backward that opens after such a
        forward warns once, where either output divides (the arguments themselves are looked at,
        not what was computed from them, nor keyword arguments)."""
        if self.task is not None:
            self.abandon()
        if self._warned_fed or self._fed:
            return
        for arg in args:
            steps = getattr(arg, _MARK, None) if isinstance(arg, torch.Tensor) else None
            if steps is not None and max(steps, self._steps) > 1:
                self._fed = True
                return

    def _warn_fed(self) -> None:
        """A plain backward opens after a forward that took a marked output ([Note: an output fed
        to a forward])."""
        self._warned_fed = True
        log.warning(
            "zkernel.backward.output_fed_to_forward",
            gradient_accumulation_steps=self._steps,
            advice="a forward took another forward's output as an argument, and loss.backward() divides "
            "the gradient by the accumulation steps at both outputs; back-propagate with "
            "engine.backward(loss) there (it divides once, at the loss)",
        )

    def abandon(self) -> None:
        """Forget an open pass whose epilogue will never run (its backward raised)."""
        log.debug("zkernel.backward.abandoned", task=self.task)
        self.task = None
        self.factor = 1.0
        engine = self._engine()
        if engine is not None:
            engine._abandon_user_backward()

    # -- backward -----------------------------------------------------------------

    def enter(self) -> bool:
        """Called at each backward event of the model: whether it belongs to a training backward,
        opening the pass (the engine's prologue, the epilogue queued) at the first event of one."""
        if self.driven:
            return True
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False
        if self.task is not None:
            return True  # this pass's task, or one nested in it (a reentrant checkpoint)
        if task == self._ignored:
            return False
        if not self._accumulates():
            self._ignored = task  # torch.autograd.grad, or backward(inputs=...) of inputs only
            return False
        engine = self._engine()
        if engine is None or engine.closed:
            return False
        roots = self._take_outputs()
        factor = engine._begin_user_backward(roots)  # may raise: nothing is open then
        # Inside another engine's `Engine.backward` the loss was divided once already.
        self.factor = 1.0 if _driving[0] else factor
        if self._fed and not _driving[0] and not self._warned_fed:
            self._warn_fed()
        self._fed = False
        self.task = task
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_end, weakref.ref(self)))
        return True

    def _accumulates(self) -> bool:
        """Whether the running graph task accumulates a gradient into a parameter of the model.

        A parameter's accumulator is the graph's own while a graph holds it; one made here for a
        parameter no graph uses is dropped at once (made before a forward, it would keep the shape
        of a released zero3 parameter). Taking it is a view, not a read of the values."""
        edge = torch.autograd.graph.get_gradient_edge
        params = self._params
        with torch._C.DisableTorchFunctionSubclass():
            for i in itertools.chain((self._hit,), range(len(params))) if params else ():
                if torch._C._will_engine_execute_node(edge(params[i]).node):
                    self._hit = i  # asked first next time: each question is a walk of the graph
                    return True
        return False

    def begin_driven(self) -> None:
        """`Engine.backward` starts its own pass: the marked outputs are its roots no more."""
        self._outputs.clear()
        self._fed = False
        self.driven = True
        _driving[0] += 1

    def end_driven(self) -> None:
        """`Engine.backward`'s pass ended (or raised)."""
        if self.driven:
            self.driven = False
            _driving[0] -= 1

    def _take_outputs(self) -> list[torch.Tensor] | None:
        """The outputs marked since the last backward, as roots for the search of unreachable
        parameters; None where one of them is gone (its graph is unknown)."""
        refs, self._outputs = self._outputs, []
        outputs = [r() for r in refs]
        return None if not outputs or any(t is None for t in outputs) else outputs

    def _end(self) -> None:
        engine = self._engine()
        self.task = None
        self.factor = 1.0
        if engine is not None:
            engine._end_user_backward()


def _output_grad(me: weakref.ref, grad: torch.Tensor) -> torch.Tensor | None:
    """The gradient hook on a marked output: opens the pass at the first event of a training
    backward nobody announced, and scales the gradient as `Engine.backward` scales its loss."""
    bp = me()
    if bp is None or bp.driven or grad is None or not bp.enter():
        return None
    return grad * bp.factor if bp.factor != 1.0 else None


def _end(me: weakref.ref) -> None:
    """Autograd's final callback of the graph task that opened the pass."""
    bp = me()
    if bp is not None and bp.task is not None:
        bp._end()
