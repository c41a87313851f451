"""The engine users drive: forward, backward, step, over the selected components.

Gradient accumulation: `Engine.step` is called after every micro-batch and
applies the optimizer only at an accumulation boundary. `Engine.backward`
divides the loss by the accumulation steps (and multiplies it by the fp16 loss
scale); partitioners average over ranks when they reduce. So the applied
gradient is the mean over every sample of the global batch, as with DDP and
DeepSpeed, when the loss is a per-sample mean. A plain ``loss.backward()``
divides the gradients where they enter the model's outputs instead, and runs
the same prologue and epilogue from autograd's hooks ([Note: a backward the
engine is not told of] in `zkernel.kernel.user_backward`).

The optimizer phase is `zkernel.kernel.step_pipeline.StepPipeline` (see its notes):
gradients are handed to the optimizer tier as they are reduced during
backward, the global norm is known when a boundary backward ends, and groups
step one by one (on the host worker thread where the tier keeps them on the
host). The step's scaling and skip decisions (the loss scale, whether the norm
is read, the coefficient, a non-finite gradient) are
`zkernel.kernel.step_scaling.StepScaling`'s ([Note: non-finite gradients] there).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils._pytree import tree_map_with_path
from torch.utils.checkpoint import CheckpointError

from zkernel.kernel import closing, lifecycle
from zkernel.spec.config import Config
from zkernel.platform.distributed import DistInfo
from zkernel.spec.groups import ParamGroup, StepOptions
from zkernel.telemetry.log import get_logger
from zkernel.kernel.engine_inputs import LossScaledTwice, input_name, prepare_input
from zkernel.kernel.engine_parts import EngineParts
from zkernel.kernel.loss_scale import DynamicLossScaler
from zkernel.kernel.memory_report import MemoryReport, measure_memory
from zkernel.params.param_writes import WriteFolder
from zkernel.telemetry.profiling import profiler_range
from zkernel.kernel.closed import closed_error, requires_open
from zkernel.kernel.reduction_order import ReductionOrder
from zkernel.kernel.scheduler import Scheduler, streams_device
from zkernel.kernel.step_pipeline import StepPipeline, StepPolicy
from zkernel.kernel.step_scaling import StepScaling
from zkernel.telemetry.timeline import SpanKind
from zkernel.params.unset import UnsetValues
from zkernel.kernel.user_backward import BackwardPass
from zkernel.kernel.user_gather import gathered
from zkernel.kernel.wiring import EngineServices, MicroSteps

log = get_logger()


class Engine:
    """Wraps a model: call it like the model, then `backward` and `step`; `close` when done."""

    def __init__(self, module: nn.Module, config: Config, dist_info: DistInfo, parts: EngineParts) -> None:
        self._module = module
        self.config = config
        self.dist = dist_info
        self.plugin_manager = parts.runtime_pm
        self.hook = parts.runtime_pm.hook
        self.groups = parts.groups
        self.trainable_groups = [g for g in self.groups if g.requires_grad]
        self.compute_dtype = parts.compute_dtype
        self.optimizer_tier = parts.optimizer_tier
        self.params_tier = parts.params_tier
        self._original_dtypes = parts.original_dtypes
        self._whole_bytes = parts.whole_bytes
        # name -> (shape, dtype) of each parameter and buffer as the plain model had it.
        self.original_tensors = {n: (torch.Size(shape), dtype) for n, shape, dtype in parts.original_tensors}
        self._worker = parts.worker
        self.timeline = parts.timeline
        # What the planner chose and why (`zkernel.spec.planner.Plan`) when the config said "auto"; else None.
        self.placement_plan = parts.placement_plan
        opt = config.optimizer
        self._base_hyper = StepOptions(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
        self.lr_schedule = parts.lr_schedule
        # The wiring between the engine, the step pipeline and the scheduler: see `zkernel.kernel.wiring`.
        self._micro_steps = MicroSteps(config.gradient_accumulation_steps)
        self.pipeline = StepPipeline(
            self.hook,
            parts.optimizer_tier,
            parts.params_tier,
            self.groups,
            policy=StepPolicy(
                distributed=dist_info.distributed,
                can_rollback=parts.can_rollback,
                skips_params=parts.skips_params,
                speculate=parts.speculate,
                max_norm=config.gradient_clipping,
            ),
            hyper=self._base_hyper,
            worker=parts.worker,
            timeline=parts.timeline,
        )
        self.scaling = StepScaling(config, self.pipeline, dist_info.device, parts.takes_found_inf)
        self.unset = UnsetValues(module, parts.left_unset)  # [Note: values left unset] in `zkernel.params.unset`
        self.writes = WriteFolder(self)  # [Note: writes to gathered parameters] in `zkernel.params.param_writes`
        # [Note: a backward the engine is not told of] in `zkernel.kernel.user_backward`
        self.backward_pass = BackwardPass(
            self, [p for g in self.trainable_groups for p in g.params], config.gradient_accumulation_steps
        )
        self.scheduler = Scheduler(
            self.hook,
            self.groups,
            config.prefetch_bytes,
            params_tier=parts.params_tier,
            streams=parts.streams,
            steps=self.pipeline,
            engine=EngineServices(
                root=module, micro_steps=self._micro_steps, unset=self.unset, writes=self.writes,
                backward_pass=self.backward_pass,
            ),
            order=ReductionOrder.of_model(module, self.groups, streams_device(parts.streams)) if dist_info.distributed else None,
        )
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._apply_lr_schedule()
        self._coefficient: tuple[float | None] | None = None  # this window's (coefficient,), once known
        self._backward_done = False  # a backward ran for the micro-batch that step() has not counted yet
        self._pass_boundary = False  # whether the backward running now ends a window
        self._user_span: Any = None  # the timeline span of a backward nobody announced, while it runs
        self._scaled_twice = LossScaledTwice(config.gradient_accumulation_steps)  # [Note: a loss scaled twice]
        self._redo_window = False  # the last step was not taken: its window must run again
        self._closed = False
        # The finalizer must not reach the engine or the model (it would keep them alive):
        # hook handles hold their hooks weakly, and tiers keep no reference to groups
        # ([Note: weak links] in `zkernel.kernel.wiring`).
        self._finalizer = weakref.finalize(
            self,
            closing.abandon,
            id(self),
            [weakref.ref(m) for m in module.modules()],
            list(self.scheduler.handles),
            parts.optimizer_tier,
            parts.params_tier,
            parts.worker,
            self.scheduler.paths,
        )
        lifecycle.register_cleanup(id(self), self._finalizer)

    # -- public API -----------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        return self._module

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def training(self) -> bool:
        """Whether the model is in training mode."""
        return self._module.training

    @requires_open("train()")
    def train(self, mode: bool = True) -> Engine:
        """Put the model in training mode (``mode`` False: evaluation), as DeepSpeed's engine does; returns the engine."""
        self._module.train(mode)
        return self

    @requires_open("eval()")
    def eval(self) -> Engine:
        """Put the model in evaluation mode; returns the engine."""
        return self.train(False)

    @property
    def lr(self) -> float:
        """The learning rate of the next step (may be changed between steps; with an
        ``[lr_schedule]`` other than ``none``, the schedule sets it again after each step)."""
        if self.lr_schedule is not None:
            self._settle_found_inf()  # the schedule follows the applied steps
        return self.pipeline.hyper.lr

    @lr.setter
    @requires_open("lr = ...")
    def lr(self, value: float) -> None:
        if self.lr_schedule is not None:
            self._settle_found_inf()  # the schedule has its say about the last step first
        self.pipeline.hyper = attrs.evolve(self.pipeline.hyper, lr=float(value))

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        """The fp16 run's dynamic loss scaler (None in other precisions): `StepScaling.loss_scaler`."""
        return self.scaling.loss_scaler

    @property
    def last_grad_norm(self) -> float | None:
        """The last global gradient norm read on the host, unscaled (None before any): `StepScaling.last_grad_norm`."""
        return self.scaling.last_grad_norm

    @last_grad_norm.setter
    def last_grad_norm(self, value: float | None) -> None:
        self.scaling.last_grad_norm = value

    @property
    def micro_steps(self) -> int:
        """Micro-batches counted by `step` so far (shared with the scheduler: `zkernel.kernel.wiring.MicroSteps`)."""
        return self._micro_steps.count

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self._micro_steps.count = value

    @property
    def skipped_steps(self) -> int:
        """Boundary steps not applied (an fp16 overflow, a non-finite gradient), counted in ``global_steps`` too."""
        self._settle_found_inf()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_steps = value

    @property
    def is_accumulation_boundary(self) -> bool:
        """Whether the micro-batch being computed now ends an accumulation window."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    @requires_open("__call__() (a forward)")
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward on the engine's device and dtype, profiled and in the timeline.

        The pass itself begins and ends at the model's own hooks ([Note: forward
        entry] in `zkernel.kernel.scheduler`), so calling ``engine.module`` directly (as
        Hugging Face's ``generate`` does) works too. With ZeRO-3 the
        released-parameter guard stays active from the forward to the end of
        `backward`, so user code between the two (a regulariser on a weight, say)
        may read parameters too, as long as every rank does the same reads.
        """
        args, kwargs = tree_map_with_path(
            lambda path, v: prepare_input(v, self.device, self.compute_dtype, input_name(path)), (args, kwargs)
        )
        try:
            with profiler_range("zkernel::forward"), self._compute_span("forward"):
                out = self._module(*args, **kwargs)
        except BaseException:  # also where the model's hooks did not run (KeyboardInterrupt)
            self.scheduler.abandon_forward()
            raise
        self._scaled_twice.saw(out)
        return out

    @requires_open("gathered_parameters()")
    def gathered_parameters(self, *, modifier_rank: int | None = None):
        """Make every parameter whole inside the block (collective: call it on every rank).

        Between steps ZeRO-3 parameters are released (their ``.data`` is an
        empty tensor). Inside this block they hold their current values in
        storage of their own, so tensors taken from them stay valid after the
        block; writes to them are kept ([Note: writes to gathered parameters] in
        `zkernel.params.param_writes`). With ``modifier_rank=r``, rank r's values of
        the parameters written on any rank are broadcast to all at the end of the
        block (write on rank r only); without it, a parameter written with values
        that differ between ranks is a `ParamWriteError` naming it ([Note: writes on
        some ranks only]). Parameters in no group (the frozen ones of none, ZeRO-1
        and ZeRO-2) are settled the same way ([Note: parameters in no group]).
        """
        return gathered(self, modifier_rank)

    @requires_open("backward()")
    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Back-propagate ``loss`` (scaled for accumulation and fp16) and reduce gradients.

        ``retain_graph``: keep the graph for another backward, as torch's. ``scale_wrt_gas=False``:
        the loss is not divided by ``gradient_accumulation_steps`` (the script averages itself).
        A plain ``loss.backward()`` works too ([Note: a backward the engine is not told of] in
        `zkernel.kernel.user_backward`); this call does the same at no extra cost."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + "; for a non-scalar output call output.backward(gradient) itself"
            )
        steps = self.config.gradient_accumulation_steps
        if scale_wrt_gas and steps > 1:
            self._scaled_twice.check(loss)  # [Note: a loss scaled twice] in `zkernel.kernel.engine_inputs`
        self._check_one_backward("engine.backward was called")
        scale = 1.0 / steps if scale_wrt_gas else 1.0
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        boundary = self._begin_pass(loss)
        self.backward_pass.begin_driven()
        try:
            with profiler_range("zkernel::backward"), self._compute_span("backward"):
                (loss.float() * scale).backward(retain_graph=retain_graph)
                self.scheduler.finish_backward()
            # The norm at every boundary where reading it adds no sync ([Note: non-finite gradients] in
            # `zkernel.kernel.step_scaling`).
            norm = self.pipeline.end_backward(boundary, self.scaling.reads_norm(), self.scheduler.readiness.window_used)
        except CheckpointError as error:
            raise type(error)(self.scheduler.explain_recompute_error(error)) from error
        finally:
            self.backward_pass.end_driven()
            self._exit_guard()
        self._end_pass(boundary, norm)

    @requires_open("scale()")
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` scaled for a ``loss.backward()`` of the script's own: multiplied by the fp16 loss
        scale (as float32), or ``loss`` itself in other precisions. The division by
        ``gradient_accumulation_steps`` happens in the backward, as for any ``loss.backward()``
        ([Note: a backward the engine is not told of] in `zkernel.kernel.user_backward`)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError(
                "engine.scale expects a scalar loss tensor computed from the engine's outputs, got "
                + (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__)
                + (" without a graph (requires_grad False)" if isinstance(loss, torch.Tensor) and loss.grad_fn is None else "")
            )
        if self.loss_scaler is None:
            return loss
        self.backward_pass.scaled = True
        return loss.float() * self.loss_scaler.scale

    def _check_one_backward(self, what: str) -> None:
        if self._backward_done:
            # [Note: one backward per step] step() counts micro-batches; a second backward before it
            # would silently fold another micro-batch into this one (the window then spans more
            # batches than configured), and at a boundary it would add gradients to a window whose
            # optimizer step may already have started.
            raise RuntimeError(
                f"{what} twice without engine.step() between them: step() counts "
                f"micro-batches (gradient_accumulation_steps = {self.config.gradient_accumulation_steps}), so "
                "call it after every backward; for several losses of one micro-batch, backward their sum"
            )

    def _begin_pass(self, roots: torch.Tensor | list[torch.Tensor] | None) -> bool:
        """The prologue of a backward: tell the step pipeline and the scheduler (``roots``: where the
        search for unreachable parameters starts). Returns whether the pass ends a window."""
        self._scaled_twice.forget()  # the output's graph is gone after this backward; keep none of it
        boundary = self.is_accumulation_boundary
        unscale = self.scaling.unscale()
        known = None if self.scaling.needs_norm() else unscale
        self.pipeline.begin_backward(boundary, known=known, speculative=unscale)
        self.scheduler.begin_backward(boundary, roots)
        self._pass_boundary = boundary
        return boundary

    def _end_pass(self, boundary: bool, norm: float | None) -> None:
        """The micro-batch's backward is complete: count it for step(); at a boundary, the coefficient."""
        self._backward_done = True
        self._redo_window = False
        if boundary:
            self._coefficient = (None if self.pipeline.outcome.failed else self.scaling.coefficient_from(norm, self.global_steps),)

    def _begin_user_backward(self, roots: list[torch.Tensor] | None) -> float:
        """Called by `BackwardPass.enter` inside a backward nobody announced, at its first event:
        the prologue; returns the factor the outputs' gradients are multiplied by."""
        if self.loss_scaler is not None and not self.backward_pass.scaled:
            raise RuntimeError(
                "Loss scaling is required for this configuration (precision = \"fp16\"), but backward() "
                "was called on an unscaled loss: call engine.backward(loss), or "
                "engine.scale(loss).backward()"
            )
        self.backward_pass.scaled = False
        self._check_one_backward("a backward through the engine's model ran")
        with profiler_range("zkernel::backward_begin"):
            self._begin_pass(roots)
        # The timeline's backward span, from the model's first backward event to the end of the
        # pass (entered here, left by `_end_user_backward`, maybe on another thread).
        self._user_span = self._compute_span("backward")
        self._user_span.__enter__()
        return 1.0 / self.config.gradient_accumulation_steps

    def _abandon_user_backward(self) -> None:
        """Called by `BackwardPass.abandon`: the backward `_begin_user_backward` opened raised, and
        its epilogue will not run. The micro-batch is not counted; the next backward begins afresh."""
        self._user_span = None
        self._exit_guard()

    def _end_user_backward(self) -> None:
        """Called by autograd at the end of the graph task that `_begin_user_backward` opened: the
        epilogue of `backward`, on the thread and streams autograd finishes on."""
        boundary = self._pass_boundary
        try:
            with profiler_range("zkernel::backward_end"):
                self.scheduler.finish_backward()
                norm = self.pipeline.end_backward(boundary, self.scaling.reads_norm(), self.scheduler.readiness.window_used)
        finally:
            self._exit_guard()
            span, self._user_span = self._user_span, None
            if span is not None:
                span.__exit__(None, None, None)
        self._end_pass(boundary, norm)

    @requires_open("step()")
    def step(self) -> None:
        """Count a micro-batch; at an accumulation boundary apply the optimizer and zero gradients.

        [Note: a step without a backward] A step() with no backward since the last one has no
        micro-batch to count: it logs a WARNING and counts nothing (micro_steps, global_steps and the
        schedule stay), as DeepSpeed applies no step then; what a forward kept for its backward is
        released.
        """
        if self.backward_pass.task is not None:  # a loss.backward() that raised before its end
            self.backward_pass.abandon()
        if self._redo_window and not self._backward_done:
            raise RuntimeError(
                f"step {self.global_steps} was not taken (a write of the optimizer's state failed, "
                "see the OSError step() raised), and no backward ran since: run this accumulation "
                "window's micro-batches again (forward, backward, step) on every rank"
            )
        if not self._backward_done:
            self.scheduler.release_kept()  # a forward whose backward never came: its values change now
            log.warning(
                "zkernel.step.no_backward",
                micro_steps=self.micro_steps,
                global_steps=self.global_steps,
                advice="engine.step() counts the micro-batch of the last backward (engine.backward(loss) or "
                "loss.backward() through the engine's outputs); call backward first "
                "(this step was not counted and changed no parameter)",
            )
            return
        boundary = self.is_accumulation_boundary
        self.micro_steps += 1
        self._backward_done = False
        if not boundary:
            return
        self.scheduler.release_kept()  # a forward whose backward never came: its values change now
        if self._coefficient is None:  # no backward ended this window: step what got gradients
            self.pipeline.begin_backward(True, known=None, speculative=None)
            norm = self.pipeline.end_backward(True, True, self.scheduler.readiness.window_used)
            self._coefficient = (None if self.pipeline.outcome.failed else self.scaling.coefficient_from(norm, self.global_steps),)
        (coefficient,), self._coefficient = self._coefficient, None
        self._settle_found_inf()  # the last step's flag: its counts and rate before this step's
        if self.pipeline.outcome.failed:
            self._not_taken()
        with profiler_range("zkernel::step"), log_context(self.dist.rank, self.global_steps):
            if coefficient is None:
                self._skipped_steps += 1
                if self.loss_scaler is not None:
                    log.info("zkernel.step.skipped", reason="fp16 overflow", loss_scale=self.loss_scaler.scale)
            self.pipeline.step(coefficient, self.scheduler)
            self.scheduler.prefetch_next_forward()
        self.scheduler.readiness.window_used.clear()
        self.timeline.end_step(self.global_steps)
        self.global_steps += 1
        self._apply_lr_schedule()
        if self.loss_scaler is not None:  # last: it may raise, with the skipped step recorded
            self.loss_scaler.update(coefficient is None)

    def _not_taken(self) -> None:
        """This window's step is taken on no rank: a write failed ([Note: a step is all-or-nothing]
        in `zkernel.kernel.step_outcome`). Undo what stepped early, rewind to the window's start, raise."""
        also: list[BaseException] = []
        try:
            with profiler_range("zkernel::step"), log_context(self.dist.rank, self.global_steps):
                self.pipeline.step(None, self.scheduler)  # early steps rolled back, every window ended
            self.pipeline.wait_all()
        except Exception as exc:  # noqa: BLE001 - a rollback that failed here: raised with the agreed failure
            also.append(exc)  # (every rank still reaches the agreement below, so none waits alone)
        finally:
            self.scheduler.readiness.window_used.clear()
            self.micro_steps -= self.config.gradient_accumulation_steps
            self._redo_window = True
        self.pipeline.outcome.raise_failure((self.optimizer_tier, self.params_tier), self.global_steps, also)

    def num_parameters(self, *, trainable_only: bool = False) -> int:
        """Elements of the model's parameters as `initialize` saw them, whole (a released zero3
        parameter reports ``numel() == 0``; its shape here is the whole one); tied parameters once."""
        return sum(
            self.original_tensors.get(name, (p.shape, p.dtype))[0].numel()
            for name, p in self._module.named_parameters()
            if p.requires_grad or not trainable_only
        )

    @requires_open("memory_report()")
    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, by category (params, grads, master_weights, optimizer_state) and place
        (a device, or ``"nvme"`` for swap files).

        Each storage is counted once, under the first category that names it.
        The result is a dict of those; its ``whole`` lists the parameters the
        partitioner holds whole on this rank, and why (`MemoryReport`, [Note:
        parameters kept whole]); ``report.whole_lines()`` says it in words.
        """
        return measure_memory(self.groups, self.hook, self._module)

    def close(self) -> None:
        """Give the model back and free everything the engine holds (collective: call on every rank).

        Pending updates finish; every parameter gets its whole, current value
        (the fp32 master for trainable ones) in storage of its own, in the dtype
        it had at `zkernel.initialize`; hooks come off the model; tiers free
        their memory and swap files; the host worker stops. The module can then
        be trained on its own or wrapped by a new engine. Closing twice is a
        no-op. A pending update that failed is raised after all that is done
        (`zkernel.kernel.closing`: [Note: where a closed model goes], [Note:
        closing after a failure]).
        """
        if not self._closed:
            self._settle_found_inf()
        closing.close(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @requires_open("save_checkpoint()")
    def save_checkpoint(
        self,
        directory,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        exclude_frozen_parameters: bool = False,
    ):
        """Write a checkpoint to ``directory/tag`` (default tag ``step<global steps>``); collective.

        Call on every rank after a `step`; inside an accumulation window it saves
        the last applied step's state, not the window's gradients, with a
        WARNING ([Note: a save inside an accumulation window]). Each rank
        writes its own shards (masters, optimizer state, frozen values) from
        wherever its tiers keep them; rank 0 commits with ``manifest.json`` and
        points ``directory/latest`` at it. ``client_state``: a dict of the
        script's own (epoch, data position; tensors, containers, primitive
        values), rank 0's saved beside the model and handed back by
        `load_checkpoint`. ``exclude_frozen_parameters``: write no values of
        parameters that do not require grad (a frozen base under adapters); a
        load keeps the loading engine's own. A save that fails or is killed
        leaves the previous checkpoint loadable. Returns the checkpoint's path.
        See `zkernel.checkpoint`.
        """
        from zkernel.checkpoint.save import save

        self.unset.require("engine.save_checkpoint()")
        self._fold_writes()
        return save(self, directory, tag, client_state, exclude_frozen_parameters)

    @requires_open("load_checkpoint()")
    def load_checkpoint(
        self,
        directory,
        tag: str | None = None,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
    ):
        """Restore parameters, optimizer state, counters, loss scale and RNG states; collective.

        ``tag`` defaults to the one ``directory/latest`` names. The checkpoint
        may come from another world size, partitioner or offload setting.
        ``load_optimizer_states=False`` keeps this engine's optimizer state
        (another optimizer, or a fresh one); ``load_module_only=True`` loads the
        model's weights and buffers only, as a fine-tuning start. Returns
        ``(path, client_state)`` as DeepSpeed does (a `LoadedCheckpoint`, whose
        ``tag`` is the tag loaded): the checkpoint's directory and the
        ``client_state`` saved with it ({} where none was). Without ``tag``, a
        directory with no ``latest`` (nothing saved there yet) logs a WARNING and
        returns None on every rank, the engine unchanged, as DeepSpeed's does.
        """
        from zkernel.checkpoint.load import load

        self._settle_found_inf()  # before the loaded counts replace the ones it would correct
        return load(
            self, directory, tag, load_optimizer_states=load_optimizer_states, load_module_only=load_module_only
        )

    @requires_open("state_dict()")
    def state_dict(self, *, rank0_only: bool = False, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The full model state dict, as the plain model's ``state_dict()`` would give it; collective.

        CPU tensors with the plain model's keys (tied parameters under each name),
        shapes and dtypes (trainable parameters from their fp32 masters), buffers
        included, on every rank; with ``rank0_only`` on rank 0 alone (the others
        get ``{}``), as FSDP's ``full_state_dict`` with ``cpu_offload``.
        ``exclude_frozen_parameters``: leave out the parameters that do not
        require grad, without gathering them (an adapter over a frozen base;
        [Note: a state dict without the frozen parameters]). Under zero3
        ``engine.module.state_dict()`` cannot gather released parameters and
        raises; use this instead.
        """
        from zkernel.checkpoint.state_dict import full_state_dict

        self.unset.require("engine.state_dict()")
        self._fold_writes()
        return full_state_dict(self, rank0_only, exclude_frozen_parameters)

    @requires_open("load_state_dict()")
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, *, broadcast_from_rank0: bool = False):
        """Write a plain model's state dict (as `state_dict` gives it) into the engine; collective.

        Every rank passes the same keys, or with ``broadcast_from_rank0`` rank 0
        alone passes the dict (the others' argument is not read: pass ``{}``)
        and its tensors are broadcast. The parameters' fp32 masters, frozen
        values and buffers take the given tensors; the optimizer state, counters
        and loss scale stay. ``strict=False`` takes a part of the model (one file
        of a sharded checkpoint, say); a call may follow another. Returns the
        missing and unexpected keys, as ``nn.Module.load_state_dict``; a key
        whose shape differs, or with ``strict`` a missing or unexpected key,
        raises on every rank and changes nothing.
        """
        from zkernel.checkpoint.state_dict import load_full_state_dict

        self._settle_found_inf()
        return load_full_state_dict(self, state_dict, strict, broadcast_from_rank0)

    @requires_open("training_state()")
    def training_state(self) -> dict[str, Any]:
        """Counters and scales a checkpoint keeps so training continues as if uninterrupted (JSON values)."""
        return {
            "micro_steps": self.micro_steps,
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "last_grad_norm": self.last_grad_norm,
            "lr": self.lr,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    @requires_open("load_training_state()")
    def load_training_state(self, state: dict[str, Any]) -> None:
        """Take back what `training_state` gave (a loss scale is restored only when both runs use fp16)."""
        self._settle_found_inf()
        self.micro_steps = int(state["micro_steps"])
        self.global_steps = int(state["global_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.last_grad_norm = state["last_grad_norm"]
        self.lr = float(state["lr"])
        self._apply_lr_schedule()  # a schedule's rate follows from the counters, whatever the saving run's was
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    def _apply_lr_schedule(self) -> None:
        """The next step's hyperparameters from the schedule ([Note: a schedule is a function of the applied steps])."""
        if self.lr_schedule is None:
            return
        hyper = self.lr_schedule.hyper(self.global_steps - self._skipped_steps, self._base_hyper)
        if hyper is None:
            return
        if not (math.isfinite(hyper.lr) and hyper.lr >= 0):
            raise ValueError(
                f"lr_schedule {self.config.lr_schedule.name!r} gave the learning rate {hyper.lr!r} for step "
                f"{self.global_steps}; valid: a finite number >= 0"
            )
        self.pipeline.hyper = hyper

    @requires_open("refresh_param_shard()")
    def refresh_param_shard(self, group: ParamGroup) -> None:
        """After a load replaced ``group``'s master: its parameter shard takes the rounded values."""
        if group.param_shard is None and self.params_tier.on_compute_device:
            return  # gathers cast the master
        values = self.optimizer_tier.read_master(group)
        self.params_tier.write_shard(group, values.to(group.param_shard.dtype if group.param_shard is not None else self.compute_dtype))

    # -- internals --------------------------------------------------------------

    def _settle_found_inf(self) -> None:
        """Read the last step's device flag if it is pending (`StepScaling.settle_found_inf`): a set
        flag counts that step as skipped and gives the schedule's rate for the steps actually applied."""
        if self.scaling.settle_found_inf(step=self.global_steps - 1):  # the last step: read before the next one
            self._skipped_steps += 1
            self._apply_lr_schedule()

    def _fold_writes(self) -> None:
        """Writes made to whole parameters since the last forward reach the masters before they are read."""
        self._settle_found_inf()
        self.pipeline.wait_all()
        with self.scheduler.plugin_call():
            self.scheduler.fold_writes()

    def _compute_span(self, label: str):
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        return self.timeline.span(SpanKind.COMPUTE, stream=stream, label=label)

    def _check_open(self, name: str | None = None) -> None:
        """Raise `EngineClosedError` naming ``name`` after close ([Note: a closed engine] in `zkernel.kernel.closed`)."""
        if self._closed:
            raise closed_error(name)

    def _exit_guard(self) -> None:
        self.scheduler.guarding = False


def log_context(rank: int, step: int):
    import structlog

    return structlog.contextvars.bound_contextvars(rank=rank, step=step)


