"""The Trainer's accelerator, with an engine's backward, gradient norm and optimizer behind it.

[Note: the accelerator] The Trainer's loop reaches the distributed backend through its
``Accelerator``: ``backward(loss)`` per micro-batch, ``clip_grad_norm_`` before the step,
``optimizer_step_was_skipped`` before the scheduler's step, ``unwrap_model`` to find the model,
``prepare`` for the optimizer. These are where DeepSpeed plugs in behind the Trainer too (Accelerate's
``DeepSpeedEngineWrapper.backward`` runs the engine's backward and step). The Trainer builds its
accelerator in ``create_accelerator_and_postprocess`` from many of its arguments, which differ
between transformers releases; rather than rebuild it, `bind_engine_accelerator` gives that one
instance a subclass of its own class with these five methods, each falling back to Accelerate's
where no engine is bound. Nothing outside that instance changes.
"""

from __future__ import annotations

from typing import Any

from zkernel.integrations.transformers.model import EngineModule
from zkernel.integrations.transformers.optimizer import EngineOptimizer

_SUBCLASSES: dict[type, type] = {}


class EngineAccelerator:
    """The methods `bind_engine_accelerator` puts in front of an ``accelerate.Accelerator``'s class."""

    zkernel_model: EngineModule | None = None

    def backward(self, loss, **kwargs: Any) -> None:
        """The engine's backward and step for one micro-batch (the Trainer's ``training_step`` calls this)."""
        if self.zkernel_model is None:
            return super().backward(loss, **kwargs)
        self.zkernel_model.backward_and_step(loss, window_ends=bool(self.gradient_state.sync_gradients))
        return None

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The global norm the engine measured before it clipped (it clips at ``gradient_clipping``, the
        Trainer's ``max_grad_norm``); the Trainer logs it as ``grad_norm``."""
        if self.zkernel_model is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return self.zkernel_model.grad_norm()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the engine skipped the last step (an fp16 overflow): the Trainer then holds its schedule."""
        if self.zkernel_model is None:
            return super().optimizer_step_was_skipped
        return self.zkernel_model.last_step_skipped

    def unwrap_model(self, model, *args: Any, **kwargs: Any):
        """The user's model inside an `EngineModule`; Accelerate's unwrapping otherwise."""
        if isinstance(model, EngineModule):
            return model.module
        return super().unwrap_model(model, *args, **kwargs)

    def prepare_optimizer(self, optimizer, *args: Any, **kwargs: Any):
        """An `EngineOptimizer` as it is: nothing of Accelerate's (loss scaler, device placement) applies to
        an optimizer that never steps ([Note: who steps])."""
        if isinstance(optimizer, EngineOptimizer):
            return optimizer
        return super().prepare_optimizer(optimizer, *args, **kwargs)


def bind_engine_accelerator(accelerator) -> None:
    """Give ``accelerator`` (the Trainer's) `EngineAccelerator`'s methods ([Note: the accelerator]);
    called once by `ZKernelTrainer.create_accelerator_and_postprocess`."""
    base = type(accelerator)
    if issubclass(base, EngineAccelerator):
        return
    subclass = _SUBCLASSES.get(base)
    if subclass is None:
        subclass = _SUBCLASSES[base] = type(f"ZKernel{base.__name__}", (EngineAccelerator, base), {
            "__module__": __name__,
            "__doc__": f"{base.__name__} with an engine's backward, gradient norm and optimizer behind it.",
        })
    accelerator.__class__ = subclass
