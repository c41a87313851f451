"""The scheduler: turns module and autograd events into lifecycle hook calls.

It knows *when* (a module is about to run, its gradients are ready, backward
ended) and fires ``zkernel_fetch_params`` / ``zkernel_prefetch_params`` /
``zkernel_release_params`` on the runtime plugin manager; what those do is the
plugins' business. It holds no partitioning or offload logic.

[Note: module-bound groups] A group with ``module`` set has its parameters
made whole around that module's forward and backward:

* forward pre-hook -> fetch(FORWARD), plus prefetch of the next groups in the
  traced order within ``prefetch_bytes``; forward post-hook -> release(FORWARD),
  except for the root module's own groups when a backward can follow (see
  [Note: root kept for backward]).
* the first gradient reaching the module's outputs (a multi-grad hook
  registered in the post-hook) -> fetch(BACKWARD), plus prefetch of the groups
  the backward reaches next (the forward's finish order reversed, see
  [Note: backward order] in `zkernel.kernel.trace`).
* once every trainable parameter of the group got its gradient
  (post-accumulate-grad hooks, which fire once per backward even for a module
  called twice) -> release(BACKWARD), then the gradient handoff:
  ``zkernel_reduce_gradients`` and, with its result, the ``on_reduced``
  callback (the engine's step pipeline hands it to the optimizer tier). With
  several ranks the handoffs follow one order on every rank (see [Note:
  reduction order] in `zkernel.kernel.reduction_order`).
* `finish_backward` reduces what is left (unused parameters) and releases
  every module-bound group, which also drops prefetches nobody consumed.

Before any fetch the scheduler waits for the group's pending update (a step
still running on the host, see `zkernel.kernel.step_pipeline`); the prefetcher skips
groups whose update is still running.

[Note: root kept for backward] The root module's post-hook is the last event
of a forward, and the multi-grad hook on its output the first of the backward:
releasing its groups there only to gather them again at once put a gather (the
embedding, for a GPT with block units) and its wait on the compute stream
between every forward and backward. So while autograd records, they
stay whole until their backward releases them. The same holds for whichever
module's groups the backward reaches first (the forward's last to finish, see
[Note: backward order] in `zkernel.kernel.trace`): where the root owns no parameters
(an ``nn.Sequential``), that is its last layer, kept from the pass after the
trace is known. A forward that no backward
follows (evaluation under ``torch.no_grad()``) releases them as before; one
whose backward never comes (a forward with grad, then ``step()``) has them
released by `release_kept` before the step changes their values.

[Note: prefetch across the step] A forward's first groups have nothing to
hide their gathers behind: the root's gather is waited for at once, and the
first blocks' gathers, started in the root's pre-hook, run beside an
embedding lookup, so the compute stream stood idle at the start of every
step and before each of the first blocks (measured: BENCHMARKS.md, "Figures
formerly in docstrings"). Their values are final as soon as the optimizer has
queued their update, and the optimizer steps groups in forward order, so
after each module-bound group's device update the scheduler starts its
gather when the training trace starts with it (within ``prefetch_bytes``),
and it runs on the copy engines or the communication stream beside the rest
of the optimizer's kernels; after the step it starts those the step did not
(frozen groups, groups stepped on the host, whose update it waits for as the
forward's first fetch would, and every group after a first step, which may
move optimizer state between tiers). Which groups it starts depends only on
the trace and ``prefetch_bytes``, never on where a group steps (the CPU
tier's ``gpu_share = "auto"`` places groups by each rank's free memory), so
every rank issues the same gathers. The next pass consumes the gathers as any
prefetch; one that does not follow the trace drops what it did not use at
its end, as any pass does. Outside a window's last micro-batch nothing
changes, and nothing is started.

[Note: guard] A parameter used outside its own module's forward (a tied
embedding reused as the output head, a weight read in a parent's forward) is
caught by the released parameter's own trap (`zkernel.params.released`, [Note: fetch
on first read]): from the start of a forward of the model (through the engine
or not, [Note: forward entry]) to the end of its backward, or to the end of a
forward without autograd (``guarding``), and while a model's own ``generate``
runs ([Note: reads inside generate] in `zkernel.kernel.entries`), the first operation that reads a
released parameter fetches its group, which is then kept whole until the end
of backward, in this and every later step. Outside that window, and inside a plugin call (the plugins
never read a released parameter), the trap raises as it does for any read
outside the engine.

The prefetcher follows the order groups ran in earlier passes, relearnt from
every pass (see [Note: trace] in `zkernel.kernel.trace`). Forward post-hooks run even
when the forward raises (``always_call``), and the engine then releases every
group, so an exception leaves nothing gathered or in flight. Ranks that run
different modules raise `zkernel.kernel.divergence.RankDivergenceError` (see
[Note: divergent ranks]).

[Note: outputs modified in place] The backward fetch is a hook on the
module's output tensors. When the output is a view (``F.linear`` on an input
of four dimensions returns its ``addmm`` result viewed back) and the caller
modifies it in place (Swinv2's ``ReLU(inplace=True)`` after such a Linear),
autograd rewrites the base's history and the view's own node leaves the graph,
with the hook on it: the unit was never fetched, and accumulating the gradient
of its released weight failed. So a view output is hooked at its base (the
tensor the module last computed; between the two there are only view
operations, which need no parameter), whose node stays in the graph under any
in-place change; a view of a parameter itself stays hooked as it is (a hook on
a leaf would outlive the pass).

[Note: recompute] Activation checkpointing (a plugin of its own family, or
``torch.utils.checkpoint`` in the user's model) runs a module's forward a
second time inside backward, to rebuild what it did not save. Fired as in a
forward, the hooks would gather the unit for the recomputation, release it,
and gather it again for its backward (two gathers), and append it to the
trace being recorded (a trace twice as long, in the wrong order). The
scheduler tells the two apart by asking autograd whether this thread is
running a backward pass (``torch._C._current_graph_task_id() != -1``, the
test ``torch.utils.checkpoint`` itself uses), so no plugin has to announce a
recomputation and a user's own checkpointing is handled the same way. In a
recomputation the pre-hook fetches for ``Phase.BACKWARD`` (prefetching in
backward order) and records nothing; the post-hook neither releases nor
registers gradient hooks (the unit is whole already, and it must stay so). The unit thus stays whole from its recomputation
through its backward and is released, as always, once its gradients are
ready: one gather for both. The cost is that every unit of a checkpointed
region is whole during that region's backward, so a region holds at most
its own parameters at once.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zkernel.platform.compiled import eager_hook
from zkernel.kernel.divergence import PathCheck
from zkernel.kernel.entries import GenerateGuarded, entry_modules
from zkernel.kernel.grad_readiness import GradReadiness
from zkernel.kernel.late_params import LateParameters
from zkernel.spec.groups import ParamGroup, Phase
from zkernel.telemetry.log import get_logger
from zkernel.kernel.lookahead import Lookahead, Stage
from zkernel.telemetry.profiling import profiler_range
from zkernel.kernel.reduction_order import ReductionOrder
from zkernel.params.released import is_released, set_fetcher
from zkernel.kernel.trace import ModuleTrace
from zkernel.kernel.wiring import EngineServices, StepGate

log = get_logger()


def _in_backward() -> bool:
    """Whether this thread runs a backward pass now (a forward here is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


class Scheduler:
    """Installs module and gradient hooks over ``groups`` and fires lifecycle hooks.

    Built by `Engine.__init__` after the step pipeline, which it gets as its
    ``steps`` (`zkernel.kernel.wiring.StepGate`); what it asks of the engine comes
    as one `zkernel.kernel.wiring.EngineServices`. The model's hooks refer to it
    weakly ([Note: weak links] in `zkernel.kernel.wiring`).

    Threads: the module hooks (forward pre/post hooks, the entry modules' bracket,
    the released-parameter trap) run on the thread that runs the model's forward,
    the user's training thread (a recomputation in backward, and a read the trap
    catches there, on autograd's); the gradient hooks (on a module's outputs, and
    post-accumulate-grad on its parameters) and what they call (fetch and prefetch
    for backward, release, reduce, the handoff to the step pipeline) run on
    autograd's thread for the device (the training thread in a CPU backward). The
    engine's calls (`begin_backward`, `finish_backward`, `release_kept`, `publish`,
    `prefetch_updated`, `prefetch_next_forward`) come from the training thread,
    except under a plain ``loss.backward()``, whose prologue and epilogue call
    `begin_backward` and `finish_backward` from autograd's thread while the
    training thread waits in ``backward()`` ([Note: a backward the engine is not
    told of] in `zkernel.kernel.user_backward`); never from the host worker. CUDA: a fetch is waited for on the current
    (compute) stream; a prefetched gather runs under the side streams'
    `prefetch_context` where the parameters' tier is off the compute device, and
    work crosses streams through events."""

    def __init__(
        self,
        hook,
        groups: Sequence[ParamGroup],
        prefetch_bytes: int,
        *,
        params_tier,
        streams,
        steps: StepGate,
        engine: EngineServices,
        order: ReductionOrder | None = None,
    ) -> None:
        self.hook = hook
        self._fold = engine.writes.fold  # keeps writes to a whole group's parameters ([Note: writes to gathered parameters])
        self.root = engine.root
        self._unset = engine.unset  # a forward refuses parameters no one has written ([Note: values left unset])
        # Opens a backward nobody announced ([Note: a backward the engine is not told of] in
        # `zkernel.kernel.user_backward`); None: only the engine's own backward.
        self._backward = engine.backward_pass
        self._window = engine.micro_steps.window  # () -> (whether the engine's micro-step ends a window, its number)
        self._forward_depth = 0  # forwards of the root running now, nested ones included
        self._kept: list[ParamGroup] = []  # groups left whole for the backward (see [Note: root kept for backward])
        self.params_tier = params_tier
        self.streams = streams
        self._on_reduced = steps.land
        self._wait_update = steps.wait_update
        self._update_pending = steps.update_pending
        self._leading: set[int] | None = None  # groups the next forward starts with (see [Note: prefetch across the step])
        self.groups = list(groups)
        self.prefetch_bytes = prefetch_bytes
        self.group_of_param = {id(p): g for g in self.groups for p in g.params}
        # Sizes are taken now: under the guard, touching a released parameter would fetch it.
        self._group_bytes = {g.index: g.numel * g.params[0].element_size() for g in self.groups}
        self.bound = [g for g in self.groups if g.module is not None]
        self.groups_of_module: dict[int, list[ParamGroup]] = {}
        for g in self.bound:
            self.groups_of_module.setdefault(id(g.module), []).append(g)
        self.external: set[int] = set()  # group indices kept whole through a step
        self.recomputed: nn.Module | None = None  # the unit module this backward recomputed last
        self.readiness = GradReadiness(self.groups, order)
        self.tracer = ModuleTrace()
        self.paths = PathCheck(self.groups, streams_device(streams), enabled=True)
        self._prefetched: set[int] = set()  # groups whose gather the prefetcher issued and nobody consumed
        sizes = self._group_bytes
        self._lookahead = {phase: Lookahead(lambda g: sizes[g.index]) for phase in (Phase.FORWARD, Phase.BACKWARD)}
        self.micro_step = 0  # the engine's micro-step, for errors
        self._boundary = True
        self.in_hook = False
        self.guarding = False  # from the engine's forward to the end of its backward (see [Note: guard])
        self.generating = 0  # entry modules' generate() running ([Note: reads inside generate])
        self.handles: list = []
        self._install()

    # -- installation ---------------------------------------------------------

    def _install(self) -> None:
        modules = {id(g.module): g.module for g in self.bound}
        for module in modules.values():
            self.handles.append(module.register_forward_pre_hook(eager_hook(self._pre_forward)))
            self.handles.append(module.register_forward_hook(eager_hook(self._post_forward), always_call=True))
        for group in self.groups:
            if not group.requires_grad:
                continue
            for position, p in enumerate(group.params):
                self.handles.append(p.register_post_accumulate_grad_hook(self._make_grad_ready_hook(group, position)))
        fetch = self._make_fetcher()
        for group in self.bound:
            for p in group.params:
                self.handles.append(set_fetcher(p, fetch))
        # [Note: parameters added after initialize] in `zkernel.kernel.late_params`, checked at the forward entry.
        self.late = LateParameters(self.root) if self.root is not None else None
        self.handles.extend(self.late.handles if self.late is not None else ())
        # After the units' hooks: an entry's own unit is fetched inside the bracket.
        for entry in entry_modules(self.root) if self.root is not None else ():
            self.handles.append(entry.register_forward_pre_hook(eager_hook(self._enter_root), prepend=True))
            self.handles.append(entry.register_forward_hook(eager_hook(self._leave_root), always_call=True))
            if callable(getattr(type(entry), "generate", None)):
                self.handles.append(GenerateGuarded(entry, weakref.ref(self)))  # [Note: weak links]

    def _make_fetcher(self):
        scheduler_ref = weakref.ref(self)  # held by the model's parameters ([Note: weak links] in `zkernel.kernel.wiring`)

        def fetch(param: nn.Parameter) -> bool:
            scheduler = scheduler_ref()
            return scheduler is not None and scheduler._fetch_read(param)

        return fetch

    def _fetch_read(self, param: nn.Parameter) -> bool:
        """A released parameter is being read: fetch its group when the engine's forward or
        backward is running (see [Note: guard]); whether it is whole now."""
        group = self.group_of_param.get(id(param))
        if not (self.guarding or self.generating) or self.in_hook or group is None:
            return False
        self.fetch_external(group)
        return not is_released(param)

    # -- forward ----------------------------------------------------------------

    def _enter_root(self, _module: nn.Module, _args) -> None:
        """[Note: forward entry] A forward of the model begins and ends at its root module's
        hooks, whoever calls it: ``engine(...)``, ``engine.module(...)``, or Hugging Face's
        ``generate``, which calls the model itself. So the pass is traced and the guard is on
        for each of them alike (a tied head reading the embedding's parameter fetches it).
        A root run again inside its own forward, or recomputed in backward, is part of the pass.
        ``generate`` of an encoder-decoder model also runs the encoder alone (``get_encoder()``,
        T5's ``encoder``, BART's ``model.encoder``), as multimodal models run their vision tower:
        the modules within two levels of the root are entries too (`entry_modules`), so such
        a call is a pass of its own. Within a pass they only count depth."""
        if _in_backward():
            return
        if self._forward_depth == 0 and self.late is not None:
            self.late.check()  # before any fetch: no rank is left in a collective
        if self._forward_depth == 0 and self._unset is not None:
            self._unset.require("A forward of the model")
        if self._forward_depth == 0 and self._backward is not None:
            self._backward.forward_begins(_args)
        self._forward_depth += 1
        if self._forward_depth == 1:
            self.begin_forward(*self._window())
            self.guarding = True

    def _leave_root(self, _module: nn.Module, _args, output) -> None:
        if _in_backward() or self._forward_depth == 0:
            return
        self._forward_depth -= 1
        if self._forward_depth:
            return
        # An always_call hook runs inside torch's handler when the forward raised (output None).
        if output is None and sys.exc_info()[0] is not None:
            self.abandon_forward()
        else:
            self.finish_forward()
            if self._backward is not None and torch.is_grad_enabled():
                self._backward.mark(output)

    def _pre_forward(self, module: nn.Module, _args) -> None:
        if _in_backward():  # a recomputation (see [Note: recompute])
            self.recomputed = module
            self._pre_backward(self.groups_of_module[id(module)])
            return
        for group in self.groups_of_module[id(module)]:
            position = self.tracer.visit(group)
            self._fetch(group, Phase.FORWARD)
            if position is not None:
                self._prefetch_after(group, Phase.FORWARD, position)

    def _post_forward(self, module: nn.Module, _args, output):
        if _in_backward():  # kept whole until its gradients are ready (see [Note: recompute])
            return output
        groups = self.groups_of_module[id(module)]
        for group in groups:
            self.tracer.finish(group)
        with self.plugin_call():  # the scheduler's own reads of the output
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            aliased = _shares_storage(groups, outputs)  # see [Note: outputs that alias a parameter]
        tensors = [t for t in outputs if t.requires_grad] if torch.is_grad_enabled() else []
        keep = aliased or (bool(tensors) and (module is self.root or self._reached_first(module)))
        for group in groups:
            if group.index in self.external:
                continue
            if keep:
                self._kept.append(group)
            else:
                self._release(group, Phase.FORWARD)
        # A view is hooked at its base, the last tensor the module computed (see [Note: outputs
        # modified in place]).
        if len(tensors) == 1:
            tensors = [hook_target(tensors[0])]
        elif tensors:
            tensors = list({id(h): h for h in map(hook_target, tensors)}.values())
        if len(tensors) == 1:  # the usual case, at half the host cost of a multi-grad hook
            tensors[0].register_hook(lambda _grad, groups=groups: self._pre_backward(groups))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads, groups=groups: self._pre_backward(groups), mode="any"
            )
        return output

    def _reached_first(self, module: nn.Module) -> bool:
        """Whether this pass follows the trace and its backward reaches ``module``'s groups first."""
        backward = self.tracer.backward
        return self.tracer.on_track and bool(backward) and backward[0].module is module

    def release_kept(self) -> None:
        """Release the groups a forward left whole for a backward that did not come."""
        kept, self._kept = self._kept, []
        for group in kept:
            if group.gathered:
                self._release(group, Phase.FORWARD)

    def fetch_external(self, group: ParamGroup) -> None:
        """A released parameter is read outside its module: fetch and keep it whole (see [Note: guard])."""
        if group.index not in self.external:
            log.debug("zkernel.scheduler.external_param", group=group.name)
        self.external.add(group.index)
        self._fetch(group, Phase.FORWARD)

    @property
    def trace(self) -> list[ParamGroup]:
        """The order of the current kind of pass, as the prefetcher follows it."""
        return self.tracer.trace

    def _fetch(self, group: ParamGroup, phase: Phase) -> None:
        with profiler_range("zkernel::fetch"), self.plugin_call():
            self.fetch_now(group, phase)

    def fetch_now(self, group: ParamGroup, phase: Phase) -> None:
        """Fetch ``group`` through every stage: its pending update, its shard on the device, the gather."""
        self._wait_update(group)
        if not group.gathered:
            if phase is not Phase.USER and group.index not in self._prefetched:
                self.paths.before(group, phase.value, self.micro_step)
            self._prefetched.discard(group.index)
            self.params_tier.to_device(group, consume=True, block=True)
        self.hook.zkernel_fetch_params(group=group, phase=phase)
        self.params_tier.drop_device(group)

    def _release(self, group: ParamGroup, phase: Phase) -> None:
        with self.plugin_call():
            if phase is Phase.FORWARD and group.gathered:
                self._fold(group)
            self.hook.zkernel_release_params(group=group, phase=phase)
            if phase is Phase.BACKWARD:
                self.params_tier.drop_device(group)
                self._prefetched.discard(group.index)

    @contextlib.contextmanager
    def plugin_call(self):
        """Mark plugin work: a released parameter read inside it is not fetched (see [Note: guard])."""
        outer, self.in_hook = self.in_hook, True
        try:
            yield
        finally:
            self.in_hook = outer

    def _prefetch_after(self, group: ParamGroup, phase: Phase, pos: int) -> None:
        """Start each stage of the groups after position ``pos`` of the pass's order (the trace in
        forward, the backward order in backward: [Note: backward order] in `zkernel.kernel.trace`), each
        within its own look-ahead (see [Note: parameter stages] in `zkernel.spec.tiers`): the all-gather
        for the nearest ``prefetch_bytes``, the upload to the device and the read into host memory
        further ahead. Each group is handed to each stage once per pass ([Note: lookahead windows])."""
        tier = self.params_tier
        gather_bytes = self.prefetch_bytes
        device_bytes = max(gather_bytes, tier.lookahead_device_bytes)
        host_bytes = max(device_bytes, tier.lookahead_host_bytes)
        if host_bytes <= 0:
            return
        order = self.tracer.trace if phase is Phase.FORWARD else self.tracer.backward
        lookahead = self._lookahead[phase]
        gathers, uploads, reads = lookahead.take(order, pos, (gather_bytes, device_bytes, host_bytes))
        # Gradients done: nothing in this backward reads the group again. Which groups are done
        # depends on what this rank used, so with several ranks it decides only rank-local stages,
        # never a gather, a collective (see [Note: reduction order]).
        done = self.readiness.complete if phase is Phase.BACKWARD else ()
        done_here = done if self.readiness.order is None else ()
        prefetched = self._prefetched
        with self.plugin_call():
            for i in gathers:
                nxt = order[i]
                if nxt.gathered or nxt.index in prefetched:
                    if lookahead.repeats(i):  # in use or in flight for an earlier occurrence: later
                        lookahead.again(Stage.GATHER, i)
                    continue
                if nxt.index not in done_here:
                    self._start_gather(nxt, phase)
            for stage, indices in ((Stage.DEVICE, uploads), (Stage.HOST, reads)):
                for i in indices:
                    nxt = order[i]
                    if nxt.gathered or nxt.index in done or nxt.index in prefetched:
                        continue
                    if self._update_pending(nxt):  # rank-local stages: skip what is not ready, until later
                        lookahead.again(stage, i)
                        continue
                    self._wait_update(nxt)
                    if stage is Stage.DEVICE:
                        tier.to_device(nxt, consume=False, block=False)
                    else:
                        tier.prefetch_host(nxt)

    # -- across the step ----------------------------------------------------------

    def prefetch_updated(self, group: ParamGroup) -> None:
        """The optimizer just queued ``group``'s update on the device: when the next training
        forward starts with it, start its gather now (see [Note: prefetch across the step])."""
        if group.index in self._leading_groups():
            self._prefetch_now(group)

    def prefetch_next_forward(self) -> None:
        """After the optimizer step: start the gathers of the groups the next training forward
        starts with that the step did not start (frozen ones, those of a skipped step)."""
        leading = self._leading_groups()
        self._leading = None
        for group in self.tracer.training():
            if group.index in leading:
                self._prefetch_now(group)

    def _leading_groups(self) -> set[int]:
        """The first groups of the training trace within ``prefetch_bytes``: they depend on the trace
        and the configuration only, the same on every rank (each start is a collective)."""
        if self._leading is None:
            leading, ahead = set(), 0
            if self.params_tier.on_compute_device:
                for group in self.tracer.training():
                    if ahead >= self.prefetch_bytes:
                        break
                    leading.add(group.index)
                    ahead += self._group_bytes[group.index]
            self._leading = leading
        return self._leading

    def publish(self, group: ParamGroup) -> None:
        """The step pipeline updated ``group`` (not module-bound): make its parameters visible,
        the partitioner's all-gather (`zkernel.kernel.wiring.Publisher`, in `Engine.step`)."""
        with self.plugin_call():
            self.params_tier.to_device(group, consume=True, block=True)
            self.hook.zkernel_publish_params(group=group)
            self.params_tier.drop_device(group)

    def _prefetch_now(self, group: ParamGroup) -> None:
        if group.gathered or group.index in self._prefetched or group.index in self.external:
            return
        with self.plugin_call():
            self._start_gather(group, Phase.FORWARD)

    def _start_gather(self, group: ParamGroup, phase: Phase) -> None:
        """Issue ``group``'s prefetched gather (in a plugin call). It is a collective: whether it is
        issued must not depend on timing (every rank issues the same gathers in the same order), so
        it waits for the group's update and its upload rather than skip it."""
        self._wait_update(group)
        self.paths.before(group, phase.value, self.micro_step)
        self._prefetched.add(group.index)
        tier = self.params_tier
        with contextlib.nullcontext() if tier.on_compute_device else self.streams.prefetch_context():
            tier.to_device(group, consume=True, block=True)
            self.hook.zkernel_prefetch_params(group=group, phase=phase)

    # -- backward ---------------------------------------------------------------

    def _pre_backward(self, groups: Sequence[ParamGroup]) -> None:
        if self._backward is not None:
            self._backward.enter()  # may open a backward nobody announced, before its first fetch
        for group in groups:
            if not group.gathered:
                self._fetch(group, Phase.BACKWARD)
            position = self.tracer.position(group)
            if position is not None:
                self._prefetch_after(group, Phase.BACKWARD, position)

    def _make_grad_ready_hook(self, group: ParamGroup, position: int):
        # The hook lives in the parameter's C++ autograd state: it holds the scheduler
        # weakly ([Note: weak links] in `zkernel.kernel.wiring`).
        scheduler_ref = weakref.ref(self)
        index, total = group.index, len(group.params)

        def on_grad_ready(_param: torch.Tensor) -> None:
            scheduler = scheduler_ref()
            if scheduler is not None:
                backward = scheduler._backward
                if backward is not None and not backward.driven:
                    backward.enter()  # a loss term that reached the parameter outside the outputs
                complete = scheduler.readiness.arrived(index, position, total)
                if complete is not None:
                    scheduler._grads_complete(complete)

        return on_grad_ready

    def _grads_complete(self, group: ParamGroup, release: bool = True) -> None:
        """Every gradient of ``group`` is in: release it, and reduce what the order allows now."""
        if release and group.module is not None and group.index not in self.external:
            self._release(group, Phase.BACKWARD)
        for ready in self.readiness.to_reduce(group):
            self._reduce(ready)

    def _reduce(self, group: ParamGroup) -> None:
        with profiler_range("zkernel::reduce"), self.plugin_call():
            self.paths.before(group, "reduce", self.micro_step)
            reduced = self.hook.zkernel_reduce_gradients(group=group, boundary=self._boundary)
            if reduced is not None:
                self._on_reduced(group, reduced, self._boundary, self.readiness.unused_in_window(group))
        self.readiness.reduced.add(group.index)

    def begin_backward(self, boundary: bool, loss: torch.Tensor | None = None) -> None:
        self._boundary = boundary
        self.recomputed = None
        self._lookahead[Phase.BACKWARD].restart()
        for group in self.readiness.begin(loss):
            # Not released here: whether it is whole must not differ between ranks while the
            # backward may still gather it (the end of backward releases it).
            self._grads_complete(group, release=False)

    def explain_recompute_error(self, error: Exception) -> str:
        """The message for torch's ``CheckpointError`` raised in a backward: which module was being
        recomputed (the last unit whose recomputation began, where zero3 hooks the modules), the
        usual cause, and torch's own message."""
        where = ""
        if self.recomputed is not None and self.root is not None:
            name = next((n for n, m in self.root.named_modules() if m is self.recomputed), None)
            if name is not None:
                where = (
                    f" (the last module whose recomputation began: {name or 'the root'!r}, a "
                    f"{type(self.recomputed).__name__}, inside the checkpointed module that failed)"
                )
        return (
            f"a checkpointed module computed something different when recomputed in backward{where}. "
            "A recomputed module must do what its forward did: one that changes its own state when it "
            "runs cannot be checkpointed, such as a model that grows a key/value cache (call a Hugging "
            "Face model with use_cache=False while it trains with checkpointed layers). torch: "
            + str(error).split("\n\nTip:")[0]
        )

    def finish_backward(self) -> None:
        """Called by the engine after ``loss.backward()``: release and reduce what is left, in group
        order (with several ranks, in the order every rank reduces in)."""
        for group in self.readiness.incomplete():
            if group.module is not None and group.index not in self.external:
                self._release(group, Phase.BACKWARD)
        for group in self.readiness.flush():
            self._reduce(group)
        self.readiness.reset()
        self._release_gathered()
        self._kept.clear()
        self.tracer.end()

    def fold_writes(self) -> None:
        """Keep what was written to whole parameters (see [Note: writes to gathered parameters])."""
        for group in self.groups:
            if group.gathered:
                self._fold(group)

    def begin_forward(self, boundary: bool, micro_step: int) -> None:
        with self.plugin_call():
            self.fold_writes()  # written between steps
        self._boundary = boundary
        self.micro_step = micro_step
        self.tracer.begin(torch.is_grad_enabled())
        for lookahead in self._lookahead.values():  # a backward without engine.backward begins with it too
            lookahead.restart()

    def finish_forward(self) -> None:
        """At the end of a forward; one without autograd ends its pass (no backward will release)."""
        with self.plugin_call():
            self.fold_writes()  # before a step may read the masters, in backward already
        if not torch.is_grad_enabled():
            self.guarding = False
            self._release_gathered()
            self._kept.clear()
            self.tracer.end()

    def abandon_forward(self) -> None:
        """The forward raised: release every group and drop what was prefetched (nothing stays whole)."""
        self.guarding = False
        self._forward_depth = 0
        self._kept.clear()
        with contextlib.suppress(Exception):
            self._release_gathered()
        self.tracer.begin(self.tracer.grad)  # the failed pass teaches nothing

    def _release_gathered(self) -> None:
        for group in self.bound:
            self._release(group, Phase.BACKWARD)



def streams_device(streams) -> torch.device:
    """The compute device of an engine's side streams (CPU without CUDA)."""
    stream = getattr(streams, "h2d", None)
    return torch.device("cuda", stream.device_index) if stream is not None else torch.device("cpu")


def _storage_pointer(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage of its own (sparse, some subclasses)
        return 0


def _shares_storage(groups: Sequence[ParamGroup], outputs: Sequence[torch.Tensor]) -> bool:
    """[Note: outputs that alias a parameter] A module may return its own parameter or a view of it
    (Perceiver's ``latents.expand(batch, -1, -1)``, a position table sliced to the sequence):
    releasing its unit after the forward freed the memory the output reads, and the next module
    read garbage, or crashed. So a unit whose output shares storage with one of its parameters
    stays whole as the root's does: to the end of a pass without autograd, or to its backward
    (the next module may have saved the output for it). One storage lookup per output and
    parameter, at each unit's forward end."""
    pointers = {_storage_pointer(t) for t in outputs}
    pointers.discard(0)
    return bool(pointers) and any(_storage_pointer(p) in pointers for group in groups for p in group.params)


def hook_target(output: torch.Tensor) -> torch.Tensor:
    """The tensor whose gradient says a backward reached a module's ``output`` (see [Note: outputs
    modified in place]): the base of a view the module computed, else the output itself."""
    base = output._base if output._is_view() else None
    return base if base is not None and base.grad_fn is not None else output
