"""The engine users drive: forward, backward, step, over the selected components.

Gradient accumulation: `Engine.step` is called after every micro-batch and
applies the optimizer only at an accumulation boundary. `Engine.backward`
divides the loss by the accumulation steps (and multiplies it by the fp16 loss
scale); partitioners average over ranks when they reduce. So the applied
gradient is the mean over every sample of the global batch, as with DDP and
DeepSpeed, when the loss is a per-sample mean.

The optimizer phase at a boundary: fetch(STEP) for every trainable group
(reductions finish, tiers bring state in), the global gradient norm from the
groups' gradient shards (one all-reduce of a scalar when shards are
partitioned), then step every group with one coefficient that folds the loss
unscale and the clip factor, then release(STEP) (publish parameters, zero
accumulators, write state back). An fp16 overflow anywhere shows up as a
non-finite global norm on every rank, so all ranks skip together.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from zkernel.config import Config
from zkernel.distributed import DistInfo
from zkernel.groups import ParamGroup, Phase, StepOptions
from zkernel.log import get_logger
from zkernel.loss_scale import DynamicLossScaler
from zkernel.scheduler import Scheduler

log = get_logger()

_MEMORY_CATEGORIES = ("params", "grads", "master_weights", "optimizer_state")


class Engine:
    """Wraps a model: call it like the model, then `backward` and `step`."""

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        dist_info: DistInfo,
        runtime_pm,
        groups: list[ParamGroup],
        compute_dtype: torch.dtype,
    ) -> None:
        self._module = module
        self.config = config
        self.dist = dist_info
        self.plugin_manager = runtime_pm
        self.hook = runtime_pm.hook
        self.groups = groups
        self.trainable_groups = [g for g in groups if g.requires_grad]
        self.compute_dtype = compute_dtype
        self.scheduler = Scheduler(self.hook, groups, config.prefetch_bytes)
        self.loss_scaler = (
            DynamicLossScaler(config.initial_loss_scale, config.loss_scale_window)
            if config.precision == "fp16"
            else None
        )
        self.lr = config.optimizer.lr
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._guard = None  # active released-parameter guard, from forward to end of backward

    # -- public API -----------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        return self._module

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def is_accumulation_boundary(self) -> bool:
        """Whether the micro-batch being computed now ends an accumulation window."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward under the scheduler.

        With ZeRO-3 the released-parameter guard (see `zkernel.scheduler`) stays
        active from here to the end of `backward`, so user code between the two
        (a regulariser on a weight, say) may read parameters too, as long as
        every rank does the same reads.
        """
        args, kwargs = tree_map(self._prepare_input, (args, kwargs))
        self.scheduler.begin_forward(self.is_accumulation_boundary)
        self._enter_guard()
        try:
            with torch.profiler.record_function("zkernel::forward"):
                out = self._module(*args, **kwargs)
        except BaseException:
            self._exit_guard()
            raise
        if not torch.is_grad_enabled():
            self._exit_guard()
        self.scheduler.finish_forward()
        return out

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Make every parameter whole inside the block (collective: call it on every rank).

        Between steps ZeRO-3 parameters are released (their ``.data`` is an
        empty tensor). Inside this block they hold their current values in
        storage of their own, so tensors taken from them stay valid after the
        block; writes to them are not propagated to the shards.
        """
        groups = [g for g in self.scheduler.bound if not g.gathered]
        with self.scheduler.plugin_call():
            for group in groups:
                self.hook.zkernel_fetch_params(group=group, phase=Phase.USER, boundary=False)
        try:
            yield self._module
        finally:
            with self.scheduler.plugin_call():
                for group in groups:
                    self.hook.zkernel_release_params(group=group, phase=Phase.USER, boundary=False)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (scaled for accumulation and fp16) and reduce gradients."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        scale = 1.0 / self.config.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        self.scheduler.begin_backward(self.is_accumulation_boundary)
        try:
            with torch.profiler.record_function("zkernel::backward"):
                (loss.float() * scale).backward()
                self.scheduler.finish_backward()
        finally:
            self._exit_guard()

    def step(self) -> None:
        """Count a micro-batch; at an accumulation boundary apply the optimizer and zero gradients."""
        boundary = self.is_accumulation_boundary
        self.micro_steps += 1
        if not boundary:
            return
        with torch.profiler.record_function("zkernel::step"), structlog.contextvars.bound_contextvars(
            rank=self.dist.rank, step=self.global_steps
        ):
            self._optimizer_step()
        self.global_steps += 1

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds, by category (params, grads, master_weights, optimizer_state) and device.

        Each storage is counted once, under the first category that names it.
        """
        seen: set[tuple[str, int]] = set()
        report: dict[str, dict[str, int]] = {c: defaultdict(int) for c in _MEMORY_CATEGORIES}
        for group in self.groups:
            for contribution in self.hook.zkernel_memory_tensors(group=group):
                for category in _MEMORY_CATEGORIES:
                    for t in (contribution or {}).get(category, ()):
                        storage = t.untyped_storage()
                        key = (str(t.device), storage.data_ptr())
                        if key in seen or storage.nbytes() == 0:
                            continue
                        seen.add(key)
                        report[category][str(t.device)] += storage.nbytes()
        return {c: dict(v) for c, v in report.items()}

    def save_checkpoint(self, directory) -> None:
        raise NotImplementedError(
            "engine.save_checkpoint is not implemented yet (checkpointing lands with its own issue)"
        )

    def load_checkpoint(self, directory) -> None:
        raise NotImplementedError(
            "engine.load_checkpoint is not implemented yet (checkpointing lands with its own issue)"
        )

    # -- internals --------------------------------------------------------------

    def _enter_guard(self) -> None:
        if self._guard is None:
            self._guard = self.scheduler.forward_guard()
            if self._guard is not None:
                self._guard.__enter__()

    def _exit_guard(self) -> None:
        if self._guard is not None:
            guard, self._guard = self._guard, None
            guard.__exit__(None, None, None)

    def _prepare_input(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point() and value.dtype != self.compute_dtype:
            return value.to(device=self.device, dtype=self.compute_dtype)
        return value.to(self.device)

    def _optimizer_step(self) -> None:
        for group in self.trainable_groups:
            self.hook.zkernel_fetch_params(group=group, phase=Phase.STEP, boundary=True)
        coefficient, overflow = self._gradient_coefficient()
        if overflow:
            self.skipped_steps += 1
            log.info("zkernel.step.skipped", reason="fp16 overflow", loss_scale=self.loss_scaler.scale)
        else:
            options = StepOptions(
                lr=self.lr,
                betas=self.config.optimizer.betas,
                eps=self.config.optimizer.eps,
                weight_decay=self.config.optimizer.weight_decay,
                grad_scale=coefficient,
            )
            for group in self.trainable_groups:
                stepped = self.hook.zkernel_step_optimizer(group=group, options=options)
                if not stepped:
                    raise RuntimeError(
                        f"no optimizer stepped group {group.name!r}: the selected optimizer "
                        f"{self.config.optimizer.name!r} returned nothing from zkernel_step_optimizer"
                    )
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        for group in self.trainable_groups:
            self.hook.zkernel_release_params(group=group, phase=Phase.STEP, boundary=True)

    def _gradient_coefficient(self) -> tuple[float, bool]:
        """(unscale x clip coefficient, fp16 overflow) from the global gradient norm."""
        unscale = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        need_norm = self.config.gradient_clipping > 0 or self.loss_scaler is not None
        if not need_norm:
            return unscale, False
        norm = self._global_grad_norm() * unscale
        self.last_grad_norm = norm
        if self.loss_scaler is not None and not math.isfinite(norm):
            return unscale, True
        clip = 1.0
        max_norm = self.config.gradient_clipping
        if max_norm > 0:
            clip = min(1.0, max_norm / (norm + 1e-6))
        return unscale * clip, False

    def _global_grad_norm(self) -> float:
        sharded, whole = [], []
        for group in self.trainable_groups:
            (sharded if group.grad_is_shard else whole).append(group.grad)
        totals = []
        for grads, reduce in ((sharded, True), (whole, False)):
            if not grads:
                continue
            sq = torch.zeros((), dtype=torch.float32, device=self.device)
            for norm in torch._foreach_norm(grads):
                sq += norm.to(self.device, torch.float32) ** 2
            if reduce and self.dist.distributed:
                dist.all_reduce(sq)
            totals.append(sq)
        if not totals:
            return 0.0
        return float(torch.stack(totals).sum().sqrt())
