"""The state both Adam optimizers keep, declared the same way so a checkpoint of one resumes with the other.

[Note: per-parameter steps] torch's Adam keeps a step count per parameter and
skips a parameter whose ``grad`` is None, so after a window in which a
parameter got no gradient (a branch not taken, an expert no token chose, a
parameter frozen after `zkernel.initialize`) its count lags the others' for
good, and its bias corrections with it. A group here is one flat shard of many
parameters, so ``step`` is one count per parameter (``per_param`` state: a
checkpoint stores each parameter's own) and a step is one kernel call per
*run*: the longest stretches of the shard whose parameters are all stepped now,
all at the same count and all with the same hyperparameters (rate, weight
decay, betas and eps: ``group.param_hyper``, [Note: per-parameter
hyperparameters] in `zkernel.kernel.param_hyper`). While nothing was ever skipped and
no parameter has hyperparameters of its own that is one run over the whole
shard, the call it always was; alignment gaps inside a run are zeros and stay
zeros. The counts live where the tier keeps the state (on the GPU for
the device tier); `StepCounts` keeps their values on the host, so a step reads
the device only after something else changed them (a checkpoint load).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import attrs
import torch

from zkernel.platform import adam_math, native
from zkernel.platform.adam_math import check_rollback_possible
from zkernel.spec.groups import OptimizerDeclaration, ParamGroup, ParamHyper, StateSpec, StepOptions


def adam_declaration(numel: int, param_count: int, can_rollback: bool, takes_found_inf: bool = False) -> OptimizerDeclaration:
    """``exp_avg`` and ``exp_avg_sq`` (fp32, per element) and ``step`` (fp32, one count per parameter)."""
    return OptimizerDeclaration(
        state=(
            StateSpec("exp_avg", torch.float32, (numel,)),
            StateSpec("exp_avg_sq", torch.float32, (numel,)),
            StateSpec("step", torch.float32, (param_count,), per_param=True),
        ),
        can_rollback=can_rollback,
        skips_params=True,
        per_param_hyper=True,
        takes_found_inf=takes_found_inf,
    )


def init_state(group: ParamGroup) -> dict:
    """Zero moments and step counts, for a tier that does not allocate declared state."""
    state, master = group.optim_state, group.master
    state["exp_avg"] = torch.zeros_like(master)
    state["exp_avg_sq"] = torch.zeros_like(master)
    state["step"] = torch.zeros(len(group.params), dtype=torch.float32, device=master.device)
    return state


@attrs.frozen
class Run:
    """Elements ``[start, stop)`` of a shard, stepped by one kernel call at count ``step``."""

    start: int
    stop: int
    step: int  # the count the update uses: 1 for a parameter's first step
    # The run's parameters' own hyperparameters (``group.param_hyper``), or None: the step's.
    hyper: ParamHyper | None = None

    def lr(self, options: StepOptions) -> float:
        return options.lr if self.hyper is None else self.hyper.lr(options)

    def weight_decay(self, options: StepOptions) -> float:
        return options.weight_decay if self.hyper is None else self.hyper.decay(options)

    def betas(self, options: StepOptions) -> tuple[float, float]:
        return options.betas if self.hyper is None else self.hyper.betas_for(options)

    def eps(self, options: StepOptions) -> float:
        return options.eps if self.hyper is None else self.hyper.eps_for(options)


class StepCounts:
    """The host's copy of each group's per-parameter step counts on a GPU (see [Note: per-parameter
    steps]); counts in host memory are read where they are. It holds no tensor: a tier's state may be
    a view of a buffer it reuses for other groups (the nvme tier's pool)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[list[int], int, weakref.ref]] = {}  # id(tensor) -> (counts, version, tensor)

    def read(self, step: torch.Tensor) -> list[int]:
        """The counts in ``step``, read from a device tensor only when it changed behind this object's back."""
        if step.device.type == "cpu":
            return [int(c) for c in step.reshape(-1).tolist()]
        known = self._known.get(id(step))
        if known is not None and known[2]() is step and known[1] == step._version:
            return known[0]
        counts = [int(c) for c in step.reshape(-1).tolist()]
        self._known[id(step)] = (counts, step._version, weakref.ref(step))
        return counts

    def add(self, step: torch.Tensor, positions: frozenset[int] | None, delta: int) -> None:
        """Add ``delta`` to the counts at ``positions`` (None: all), in the tensor and here."""
        counts = list(self.read(step))
        if positions is None:
            step.add_(delta)
            counts = [c + delta for c in counts]
        else:
            for lo, hi in _spans(sorted(positions)):
                step[lo:hi].add_(delta)
                counts[lo:hi] = [c + delta for c in counts[lo:hi]]
        if step.device.type != "cpu":
            self._known[id(step)] = (counts, step._version, weakref.ref(step))


def _spans(positions: list[int]) -> Iterator[tuple[int, int]]:
    """Sorted positions as maximal ``[lo, hi)`` ranges."""
    start = None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            yield start, p + 1
            start = None


def step_runs(group: ParamGroup, counts: list[int], skip: frozenset[int], advance: int = 1) -> list[Run]:
    """The runs of ``group``'s shard to step, each at its parameters' count plus ``advance`` (1 for a
    step, 0 to undo the step that counted it), leaving out the parameters in ``skip``; a run's
    parameters share their hyperparameters (``group.param_hyper``)."""
    numel = group.master.numel()
    own = group.param_hyper
    uniform = not own or (len(own) == len(group.params) and len(set(own.values())) == 1)
    if not skip and min(counts, default=0) == max(counts, default=0) and uniform:
        return [Run(0, numel, (counts[0] if counts else 0) + advance, own.get(0))]
    layout = group.shard_layout
    if layout is None:
        raise RuntimeError(
            f"group {group.name!r} must step some of its parameters and not others (or at different step "
            "counts, or with hyperparameters of their own), but its partitioner does not describe its shard "
            "(zkernel_describe_shard)"
        )
    runs: list[Run] = []
    extend = False
    for frag in sorted(layout.fragments, key=lambda f: f.offset):
        if frag.param in skip:
            extend = False
            continue
        step, hyper = counts[frag.param] + advance, own.get(frag.param)
        if extend and runs[-1].step == step and runs[-1].hyper == hyper:
            runs[-1] = attrs.evolve(runs[-1], stop=frag.offset + frag.numel)
        else:
            runs.append(Run(frag.offset, frag.offset + frag.numel, step, hyper))
        extend = True
    return runs


def step_group(
    group: ParamGroup,
    options: StepOptions,
    counts: StepCounts,
    update: Callable[[Run, dict], None],
    grad: torch.Tensor | None = None,
) -> None:
    """Step ``group`` run by run (``update(run, slices)``, slices of master, gradient (``grad``, default
    ``group.grad``), moments and copy-out by name) and advance the counts of the parameters stepped."""
    state = group.optim_state
    runs = step_runs(group, counts.read(state["step"]), options.skip_params)
    whole = len(runs) == 1 and runs[0].start == 0 and runs[0].stop == group.master.numel()
    tensors = _tensors(group, group.grad if grad is None else grad)
    for run in runs:
        update(run, tensors if whole else _slices(tensors, run))
    counts.add(state["step"], _stepped(group, options.skip_params), 1)


def uncount_group(group: ParamGroup, options: StepOptions, counts: StepCounts) -> None:
    """Take back the count of the parameters a step with ``options`` counted, whose update its
    ``options.found_inf`` made a no-op on the device (`zkernel_uncount_step`)."""
    counts.add(group.optim_state["step"], _stepped(group, options.skip_params), -1)


def kernel_arguments(run: Run, options: StepOptions, decoupled: bool) -> dict:
    """The keyword arguments every Adam kernel here takes (`zkernel.platform.native.adam_step`, its rollback,
    the Triton kernel, `zkernel.platform.adam_math.adam_rollback`) for one run."""
    return dict(
        step=run.step,
        lr=run.lr(options),
        betas=run.betas(options),
        eps=run.eps(options),
        weight_decay=run.weight_decay(options),
        grad_scale=options.grad_scale,
        adamw=decoupled,
    )


def _tensors(group: ParamGroup, grad: torch.Tensor) -> dict:
    state = group.optim_state
    return {"master": group.master, "grad": grad, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"],
            "copy_out": group.copy_out}  # fmt: skip


def _slices(tensors: dict, run: Run) -> dict:
    return {name: None if t is None else t[run.start : run.stop] for name, t in tensors.items()}


def _stepped(group: ParamGroup, skip: frozenset[int]) -> frozenset[int] | None:
    """Positions of the parameters a step with ``skip`` counts (None: all of them)."""
    return frozenset(range(len(group.params))) - skip if skip else None


def rollback_possible(group: ParamGroup, options: StepOptions, decoupled: bool) -> bool:
    """Whether a step of ``group`` with ``options`` can be undone, at the step's rate, decay and betas
    and at every parameter's own (see `zkernel.platform.adam_math.check_rollback_possible`)."""
    for hyper in {ParamHyper(), *group.param_hyper.values()}:
        try:
            check_rollback_possible(
                lr=hyper.lr(options),
                betas=hyper.betas_for(options),
                weight_decay=hyper.decay(options),
                adamw=decoupled,
            )
        except ValueError:
            return False
    return True


def rollback_group(group, options, decoupled: bool, native_kernel: bool, counts: StepCounts) -> None:
    """Undo the last step of ``group`` and its step counts: with the native kernel for a CPU master the
    native step updated (``native_kernel``), else in torch arithmetic (as torch's kernels stepped)."""
    state = group.optim_state
    grad = group.grad
    on_host = native_kernel and group.master.device.type == "cpu"
    if on_host and grad.device.type != "cpu":
        grad = grad.cpu()
    elif not on_host:
        grad = grad.to(group.master.device, group.master.dtype)
    tensors = _tensors(group, grad)
    rollback = native.adam_rollback if on_host else adam_math.adam_rollback
    for run in step_runs(group, counts.read(state["step"]), options.skip_params, advance=0):
        t = _slices(tensors, run)
        rollback(t["master"], t["grad"], t["exp_avg"], t["exp_avg_sq"], **kernel_arguments(run, options, decoupled))
    counts.add(state["step"], _stepped(group, options.skip_params), -1)
