"""The optimizer phase: gradient handoff, global norm, and a per-group step pipeline.

[Note: step pipeline] The optimizer never runs as three barriers (fetch all,
step all, release all). Per trainable group:

1. backward: the partitioner reduces the group's gradient
   (`zkernel_reduce_gradients`) and the kernel hands the `ReducedGradient`,
   with its collective's handle, to the optimizer tier (`OptimizerTier.land`):
   the tier sees a gradient only through this handoff, never by hook order.
2. at the end of a boundary backward the tier completes its landings and the
   global gradient norm is summed from each group's squared norm (device
   scalars, plus host floats for gradients accumulated on the host), with one
   all-reduce of a scalar for sharded gradients.
3. the step of a group the tier keeps on the host runs on the engine's host
   worker thread (acquire -> optimizer -> release), so it overlaps device work;
   a group on the compute device steps inline. Jobs are submitted in the order
   the next forward needs the parameters (the reverse of this backward's
   landing order), groups whose parameters stay whole first, since they must be
   published (all-gathered) before `Engine.step` returns; a module-bound group
   (ZeRO-3) is published lazily: its next fetch waits for its update only.
   One exception on the device: the group whose gradient landed last (the
   forward's first) steps after others of at least twice its elements, so
   the compute stream does not wait for its reduction while gradients that
   are complete wait to be stepped (see [Note: the last landing] in the
   device tier). Its update and gather still finish before the step does.

[Note: early and speculative steps] The gradient coefficient of a step is the
loss-scale inverse times the clip factor. Without clipping and without fp16 it
is known before backward, so a host group steps as soon as its last gradient
lands, during backward. A group that steps on the compute device steps after
backward: stepped on a stream of its own during backward, the whole step ran
slower (measured: BENCHMARKS.md, "Figures formerly in docstrings"), its Adam
kernels taking multiprocessors from backward's matmuls for about as long as
they ran. With clipping or fp16 it is known only after backward;
the pipeline may then *speculate* (the SuperOffload technique): step with the
coefficient that assumes no clipping, and, when the norm says otherwise, roll
the step back (`zkernel_rollback_optimizer`) and redo it with the right
coefficient, or only roll back on an fp16 overflow. Policy ``auto`` speculates
when the previous step needed neither clipping nor a skip, so a run that clips
every step pays no rollbacks. Only an optimizer that declared it can roll back
is ever speculated on.

Where the host does not read the norm, a boundary's non-finite check is a
device flag its steps honour and the host reads one step late ([Note: a
non-finite flag read one step late] in `zkernel.kernel.found_inf`).

Parameters no rank gave a gradient in the window are not stepped, as torch
skips them ([Note: parameters without a gradient] in `zkernel.kernel.unused_params`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch
import torch.distributed as dist

from zkernel.spec.groups import ParamGroup, ReducedGradient, StepOptions
from zkernel.telemetry.log import get_logger
from zkernel.telemetry.profiling import profiler_range
from zkernel.platform.streams import current_stream
from zkernel.spec.tiers import SPECULATE_POLICIES, OptimizerTier, ParamsTier
from zkernel.telemetry.timeline import SpanKind, Timeline
from zkernel.kernel.found_inf import DeviceFlag, LateRead, host_buffer
from zkernel.kernel.step_outcome import StepOutcome
from zkernel.kernel.unused_params import UnusedParams, keep_elements
from zkernel.kernel.wiring import Publisher

log = get_logger()

_NOT_STEPPED = object()  # an early job that left its group for the step proper
LAST_LANDED_COVER = 2


@attrs.frozen(kw_only=True)
class StepPolicy:
    """How an engine's step pipeline steps, fixed for the engine's life (`Engine` builds it).

    ``distributed``: several ranks (the norm and the unused parameters are agreed on);
    ``can_rollback``: the optimizer declared it can roll a step back (speculation allowed);
    ``skips_params``: the optimizer leaves skipped parameters as they are itself;
    ``speculate``: one of `SPECULATE_POLICIES` ([Note: early and speculative steps]);
    ``max_norm``: the gradient clipping threshold (0: off)."""

    distributed: bool
    can_rollback: bool
    skips_params: bool = True
    speculate: str = "auto"
    max_norm: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.speculate not in SPECULATE_POLICIES:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE_POLICIES)}, got {self.speculate!r}")


class StepPipeline:
    """Lands gradients, computes the global norm, and steps and publishes groups in order.

    Built by `Engine.__init__` before the scheduler, which gets it as its
    `zkernel.kernel.wiring.StepGate`; it holds no reference to the scheduler or the
    engine ([Note: weak links] in `zkernel.kernel.wiring`).

    Threads: `begin_backward`, `end_backward`, `step` and `wait_all` run on the
    user's training thread; `land` runs where the scheduler's gradient hooks run,
    on autograd's thread for the device (the training thread in a CPU backward),
    and `wait_update` / `update_pending` on both, from the scheduler's fetches.
    Host steps (`_host_step`, `_early_step`, `_after_early`, `_host_skip`) run on
    the engine's host worker thread (``zkernel-host``, one thread), one job at a
    time in submission order; the tiers' accumulation and I/O threads run none of
    the pipeline's code. CUDA: a group on the compute device steps on the current
    (compute) stream; a host step's upload comes back as a CUDA event the current
    stream waits on (`wait_update`, publishing)."""

    def __init__(
        self,
        hook,
        tier: OptimizerTier,
        params_tier: ParamsTier,
        groups: Sequence[ParamGroup],
        *,
        policy: StepPolicy,
        hyper: StepOptions,
        worker: ThreadPoolExecutor,
        timeline: Timeline,
    ) -> None:
        self.hook = hook
        self.tier = tier
        self.params_tier = params_tier
        self.trainable = [g for g in groups if g.requires_grad]
        self.distributed = policy.distributed
        self.worker = worker
        self.timeline = timeline
        self.can_rollback = policy.can_rollback
        self.skips_params = policy.skips_params
        self.speculate = policy.speculate
        self.max_norm = policy.max_norm
        # Hyperparameters of the next step (the engine replaces it when ``engine.lr`` changes).
        self.hyper = hyper
        self._landing_order: list[ParamGroup] = []
        self._landed: set[int] = set()
        self._unused: set[int] = set()  # groups no rank gave a gradient in this window: not stepped
        # Groups some of whose parameters no rank gave a gradient in this window -> their positions.
        self._skip: dict[int, frozenset[int]] = {}
        self._unused_params = UnusedParams(self.trainable, policy.distributed)
        # Forward need order, refined after every boundary backward.
        self._order: list[ParamGroup] = list(reversed(self.trainable))
        # Host steps started during backward: group index -> (job, coefficient it used).
        self._early: dict[int, tuple[Future, float]] = {}
        self._early_coefficient: float | None = None
        self._early_exact = False
        self._speculative: float | None = None  # this window's no-clip coefficient
        self._abort_speculation = False  # a group's own gradient showed this window will clip or skip
        # Pending updates of parameter shards: group index -> job resolving to a CUDA event or None.
        self._updates: dict[int, Future] = {}
        self._last_clean = False  # the last boundary step applied no clip factor and no skip
        self._rebalanced = False
        self.outcome = StepOutcome(policy.distributed)  # [Note: a step is all-or-nothing]
        # [Note: a non-finite flag read one step late]: this boundary's flag, then the step's host read.
        self._found_inf: DeviceFlag | None = None
        self._late: LateRead | None = None
        self._flag_host: torch.Tensor | None = None
        # Whether the last boundary step changed the parameters (False: none yet, skipped, not taken);
        # a step skipped by its device flag turns False when the flag is read (`settle_found_inf`).
        self.last_applied = False
        self.rollbacks = 0
        self.early_steps = 0
        self.aborted_speculations = 0  # windows whose speculation a group's own gradient stopped

    # -- backward (main thread, then autograd's thread) ------------------------

    def begin_backward(self, boundary: bool, known: float | None, speculative: float | None) -> None:
        """Before a backward. ``known``: the step's coefficient when it is known now;
        ``speculative``: the coefficient to assume otherwise (see [Note: early and speculative steps])."""
        self._landing_order = []
        self._landed = set()
        if boundary:
            self._unused = set()
            self._skip = {}
        self._early_coefficient = None
        self._early_exact = False
        self._speculative = speculative
        self._abort_speculation = False
        if not boundary:
            return
        if known is not None:
            # Known, but not yet whether every gradient is finite: an early step may still be undone
            # ([Note: non-finite gradients] in `zkernel.kernel.step_scaling`), so only an optimizer
            # that can roll back takes it.
            if self.can_rollback:
                self._early_coefficient, self._early_exact = known, True
        elif speculative is not None and self.can_rollback and self._want_speculation():
            self._early_coefficient = speculative

    def _want_speculation(self) -> bool:
        if self.speculate == "never":
            return False
        return self.speculate == "always" or self._last_clean

    def land(self, group: ParamGroup, reduced: ReducedGradient, final: bool, unused: frozenset[int] = frozenset()) -> None:
        """Hand a reduced gradient to the tier (called by the scheduler, in autograd's thread).

        ``unused``: positions of the group's parameters that got no gradient in this window on this
        rank (see [Note: parameters without a gradient] in `zkernel.kernel.unused_params`); a group with any is not
        stepped early."""
        self.wait_update(group)  # the previous step must be done with the landing buffer
        if reduced.work is not None:
            full = reduced.keepalive if reduced.keepalive is not None else reduced.tensor
            self.timeline.collective(reduced.work, f"{group.name} reduce", nbytes=full.numel() * full.element_size())
        self.tier.land(group, reduced, final)
        if not final:
            return
        self._landing_order.append(group)
        self._landed.add(group.index)
        if unused:
            return
        if self._early_coefficient is not None and self.tier.steps_on_host(group) and not self._abort_speculation:
            self.tier.prepare(group)
            options = self._step_options(self._early_coefficient, group)
            job = self.worker.submit(self._early_step, group, options, self._early_exact)
            self._early[group.index] = (job, self._early_coefficient)

    def end_backward(self, boundary: bool, need_norm: bool, used: Mapping[int, Collection[int]]) -> float | None:
        """After a backward: complete landings; at a boundary learn which parameters no rank gave a
        gradient in the window (``used``: group index -> positions of parameters this rank gave one)
        and return the global norm when asked; when not, the step gets a device flag instead ([Note:
        a non-finite flag read one step late])."""
        self.tier.flush()
        if not boundary:
            return None
        landed = self._landing_order + [g for g in self.trainable if g.index not in self._landed]
        self._order = list(reversed(landed))
        self._agree_on_unused(used)
        self._found_inf = None
        if need_norm:
            return self._global_norm()
        sharded = any(g.grad_is_shard for g in self.trainable)
        # (a master kept on disk or split is not in memory between steps: [Note: split masters in the tiers])
        device = next((g.master.device for g in self.trainable if g.master is not None), torch.device("cpu"))
        self._found_inf = DeviceFlag(self._sq_sum(self.trainable), self.distributed and sharded, device)
        return None

    def _agree_on_unused(self, used: Mapping[int, Collection[int]]) -> None:
        """A parameter is skipped only where no rank gave it a gradient (see `zkernel.kernel.unused_params`)."""
        for group, positions in self._unused_params.agree(used).items():
            if len(positions) == len(group.params):
                self._unused.add(group.index)
            else:
                self._skip[group.index] = positions

    def _global_norm(self) -> float:
        """The global gradient norm (inf where any gradient is not finite), and, in the same
        all-reduce, whether a write of the optimizer's state failed on any rank
        (`failed_writes`, see [Note: a step is all-or-nothing] in `zkernel.kernel.step_outcome`)."""
        sharded = [g for g in self.trainable if g.grad_is_shard]
        whole = [g for g in self.trainable if not g.grad_is_shard]
        self.outcome.collect((self.tier, self.params_tier))
        sharded_sq = self._sq_sum(sharded)
        if self.distributed and (sharded or self.tier.may_fail_writes or self.params_tier.may_fail_writes):
            sharded_sq = self.outcome.agree(sharded_sq, self._all_reduce_scalar)
        total = float(sharded_sq) if sharded else 0.0
        if whole:
            total += float(self._sq_sum(whole))
        return math.sqrt(total) if total >= 0 and math.isfinite(total) else float("inf")

    def _sq_sum(self, groups: list[ParamGroup]) -> torch.Tensor:
        """The sum of ``groups``' squared gradient norms (device scalars and host floats)."""
        device_parts, host_parts = [], 0.0
        for sq in self.tier.grad_sq_norm(groups) if groups else ():
            if isinstance(sq, Future):
                host_parts += sq.result()
            elif isinstance(sq, torch.Tensor):
                device_parts.append(sq.reshape(()).float())
            else:
                host_parts += float(sq)
        part = torch.stack(device_parts).sum() if device_parts else torch.zeros(())
        return part + host_parts

    @staticmethod
    def _all_reduce_scalar(value: torch.Tensor) -> torch.Tensor:
        # NCCL reduces on the device; gloo on the host.
        if dist.get_backend() == "nccl":
            value = value.to(torch.device("cuda", torch.cuda.current_device()))
        else:
            value = value.cpu()
        dist.all_reduce(value)
        return value

    # -- step (main thread) ------------------------------------------------------

    def step(self, coefficient: float | None, publisher: Publisher) -> None:
        """Apply (``coefficient`` set) or skip (None: fp16 overflow) the optimizer for every group.

        ``publisher`` (the engine's scheduler) makes an updated group's parameters visible
        (the partitioner's all-gather): `Publisher.publish` is called here for groups that are
        not module-bound once their update is in, and never for a skipped step;
        `Publisher.prefetch_updated` for module-bound groups whose device update is queued.
        """
        self._last_clean = coefficient is not None and (self._early_exact or coefficient == self._speculative)
        self.last_applied = coefficient is not None
        if self._late is not None:
            raise RuntimeError("the previous step's non-finite flag was not read before this step (settle_found_inf)")
        found_inf = self._found_inf.ready() if self._found_inf is not None and coefficient is not None else None
        self._found_inf = None
        flagged: list[tuple[ParamGroup, StepOptions]] = []
        for group in self._order:
            if group.index in self._unused:  # as torch skips a parameter whose grad is None
                early = self._early.pop(group.index, None)
                job = self.worker.submit(self._after_early, early[0], group, self._step_options(early[1], group), None) if early else None
                if job is not None:
                    self._updates[group.index] = job
                elif self.tier.steps_on_host(group):
                    self._updates[group.index] = self.worker.submit(self._host_skip, group)
                else:
                    self.tier.end_window(group)
        order = [g for g in self._order if g.index not in self._unused]
        eager = [g for g in order if g.module is None]
        lazy = [g for g in order if g.module is not None]
        host = [g for g in (*eager, *lazy) if self.tier.steps_on_host(g)]
        for group in host:  # the tier starts bringing state in, in this order, as far as it has room
            # Not for a skipped step: only rollbacks acquire then, and a tier with bounded room must
            # not hold it for groups that will not step ahead of them.
            if group.index not in self._early and coefficient is not None:
                self.tier.prepare(group)
        for group in host:
            self._updates[group.index] = self._submit_host(group, coefficient)
        for group in self._device_order([g for g in (*eager, *lazy) if not self.tier.steps_on_host(g)]):
            event = self._device_step(group, coefficient, found_inf, flagged)
            if coefficient is not None and group.module is None:
                self._publish(publisher, group, event)
            elif group.module is not None and self._rebalanced:
                publisher.prefetch_updated(group)  # not in a first step: after it the tier may move buffers
        for group in eager:
            if self.tier.steps_on_host(group):
                event = self._updates.pop(group.index).result()
                if coefficient is not None:
                    self._publish(publisher, group, event)
        self._early.clear()
        self._early_coefficient = None
        if flagged:
            if self._flag_host is None:
                self._flag_host = host_buffer(found_inf.device)
            self._late = LateRead(found_inf, flagged, self._flag_host)
        if not self._rebalanced and coefficient is not None:
            self._rebalanced = True
            self.wait_all()
            for group in self.trainable:  # no transfer may still read a buffer the tier moves
                self.params_tier.before_update(group)
            self.tier.after_first_step(self._order)

    def _device_order(self, groups: list[ParamGroup]) -> list[ParamGroup]:
        """``groups`` (in forward order), with the one whose gradient landed last after other groups
        of at least `LAST_LANDED_COVER` times its elements (see [Note: step pipeline])."""
        last = self._landing_order[-1] if self._landing_order else None
        at = next((i for i, g in enumerate(groups) if g is last), None)
        if at is None:
            return groups
        rest = groups[:at] + groups[at + 1 :]
        covered, position = 0, at
        while position < len(rest) and covered < LAST_LANDED_COVER * last.numel:
            covered += rest[position].numel
            position += 1
        return [*rest[:position], last, *rest[position:]]

    def _submit_host(self, group: ParamGroup, coefficient: float | None) -> Future:
        final = None if coefficient is None else self._step_options(coefficient, group)
        early = self._early.get(group.index)
        if early is None:
            if final is None:
                return self.worker.submit(self._host_skip, group)
            return self.worker.submit(self._host_step, group, final, end_window=True)
        job, used = early
        return self.worker.submit(self._after_early, job, group, self._step_options(used, group), final)

    def _step_options(self, coefficient: float, group: ParamGroup) -> StepOptions:
        return attrs.evolve(self.hyper, grad_scale=coefficient, skip_params=self._skip.get(group.index, frozenset()))

    # Host jobs (worker thread). Each returns the event of the parameter-shard upload, or None.

    def _host_step(self, group: ParamGroup, options: StepOptions, *, end_window: bool, acquired: bool = False):
        if not acquired:
            self.tier.acquire(group)
        self.params_tier.before_update(group)
        with self.timeline.span(SpanKind.CPU_STEP, label=group.name):
            self._optimizer_step(group, options)
        event = self._finish_update(group)
        if end_window:
            self.tier.end_window(group)
        return event

    def _finish_update(self, group: ParamGroup):
        """Take the group's updated parameters home, then let the tier write its state back."""
        event = self.params_tier.commit(group)
        self.tier.release(group)
        return event

    def _early_step(self, group: ParamGroup, options: StepOptions, exact: bool):
        """A step during backward. It is not taken when the group's own gradient already shows the
        window will clip or skip (a non-finite step cannot be undone, and a rollback after a large
        spike loses precision); the window then stops stepping early."""
        if self._abort_speculation:
            # [Note: an untaken early step holds nothing] Not acquired: the step proper acquires it.
            # A tier may lend memory at `acquire` (a split master's rebuild buffer): every group of a
            # clipped window held one from backward to its step (up to ~27 GB for GPT-6.7B on the host).
            return _NOT_STEPPED
        self.tier.acquire(group)
        # Even an exact coefficient's step is undone when a gradient of the window is not finite
        # ([Note: non-finite gradients] in `zkernel.kernel.step_scaling`): it is checked as a
        # speculative one is.
        if self._abort_speculation or self._will_clip_or_skip(group, options.grad_scale):
            if not self._abort_speculation and not exact:
                self.aborted_speculations += 1
            self._abort_speculation = True
            return _NOT_STEPPED
        if self.hook.zkernel_can_rollback_step(group=group, options=options) is False:
            return _NOT_STEPPED  # stepped once the coefficient is known, like a group that lands late
        self.early_steps += 1
        return self._host_step(group, options, end_window=False, acquired=True)  # its window ends at the step

    def _will_clip_or_skip(self, group: ParamGroup, unscale: float) -> bool:
        (sq,) = self.tier.grad_sq_norm([group]) or (0.0,)
        if isinstance(sq, Future):
            sq = sq.result()
        norm = math.sqrt(float(sq)) * unscale if math.isfinite(float(sq)) else float("inf")
        return not math.isfinite(norm) or (self.max_norm > 0 and norm > self.max_norm)

    def _after_early(self, early: Future, group: ParamGroup, used: StepOptions, final: StepOptions | None):
        """Once the coefficient is known: keep, redo or undo a step taken during backward."""
        event = early.result()
        if event is _NOT_STEPPED:
            if final is None:
                return self._host_skip(group)
            # Acquires again (a tier's acquire is idempotent) and ends the window, as the step proper does.
            return self._host_step(group, final, end_window=True)
        if final is not None and final.grad_scale == used.grad_scale:
            self.tier.end_window(group)
            return event
        self.rollbacks += 1
        self.tier.acquire(group)
        self.params_tier.before_update(group)
        with self.timeline.span(SpanKind.CPU_STEP, label=f"{group.name} rollback"):
            rolled = self.hook.zkernel_rollback_optimizer(group=group, options=used)
            if not rolled:
                raise RuntimeError(
                    f"the optimizer declared it can roll a step back but did not roll back group {group.name!r}"
                )
            if final is not None:
                self._optimizer_step(group, final)
        event = self._finish_update(group)
        self.tier.end_window(group)
        return event

    def _host_skip(self, group: ParamGroup):
        self.tier.end_window(group)
        return None

    def _device_step(self, group: ParamGroup, coefficient: float | None, found_inf=None, flagged=None):
        """Step a group on the compute device; with ``found_inf`` (a device flag) the step is a no-op
        where it is set, and the group and its options join ``flagged`` for the late read."""
        event = None
        if coefficient is not None:
            self.tier.acquire(group)
            self.params_tier.before_update(group)
            options = self._step_options(coefficient, group)
            if found_inf is not None:
                options = attrs.evolve(options, found_inf=found_inf)
                flagged.append((group, options))
            self._optimizer_step(group, options)
            event = self._finish_update(group)
        self.tier.end_window(group)
        return event

    def _optimizer_step(self, group: ParamGroup, options: StepOptions) -> None:
        restore = keep_elements(group, options.skip_params) if options.skip_params and not self.skips_params else None
        with profiler_range("zkernel::optimizer_step"):
            stepped = self.hook.zkernel_step_optimizer(group=group, options=options)
        if not stepped:
            raise RuntimeError(
                f"no optimizer stepped group {group.name!r}: the selected optimizer returned nothing "
                "from zkernel_step_optimizer"
            )
        if restore is not None:
            restore()

    @staticmethod
    def _publish(publisher: Publisher, group: ParamGroup, event: Any) -> None:
        if event is not None:
            current_stream().wait_event(event)
        publisher.publish(group)

    def settle_found_inf(self) -> bool:
        """Read the last step's non-finite flag on the host, if one is pending ([Note: a non-finite
        flag read one step late]); where it was set, every group stepped with it forgets the step
        (`zkernel_uncount_step`). Returns whether that step was skipped. Called by the engine on the
        training thread before the next step and before anything reads counters or state."""
        late, self._late = self._late, None
        if late is None or not late.is_set():
            return False
        self.last_applied = False
        for group, options in late.stepped:
            if not self.hook.zkernel_uncount_step(group=group, options=options):
                raise RuntimeError(
                    f"the optimizer declared takes_found_inf but did not uncount group {group.name!r}'s "
                    "step (zkernel_uncount_step returned nothing)"
                )
        return True

    @property
    def found_inf_pending(self) -> bool:
        """Whether the last step's flag has not been read on the host yet."""
        return self._late is not None

    # -- updates ------------------------------------------------------------------

    def wait_update(self, group: ParamGroup) -> None:
        """Block until ``group``'s pending update (if any) is in its parameter shard; the
        current stream then waits for its upload."""
        job = self._updates.pop(group.index, None)
        if job is None:
            return
        if job.done():
            event = job.result()
        else:
            with self.timeline.span(SpanKind.UPDATE_WAIT, label=group.name):
                event = job.result()
        if event is not None:
            current_stream().wait_event(event)

    def update_pending(self, group: ParamGroup) -> bool:
        """Whether ``group`` has an update still running on the host (prefetch skips it)."""
        job = self._updates.get(group.index)
        return job is not None and not job.done()

    def wait_all(self) -> None:
        """Wait for every pending update and early step (before reads, checkpoints, close).

        All of them are waited for even when one failed; the first failure is raised then, with
        the others attached as notes."""
        errors: list[BaseException] = []
        for wait in [lambda g=g: self.wait_update(g) for g in self.trainable] + [
            job.result for job, _ in list(self._early.values())
        ]:
            try:
                wait()
            except Exception as exc:  # noqa: BLE001 - collected, raised below
                errors.append(exc)
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"also failed: {other}")
            raise errors[0]

