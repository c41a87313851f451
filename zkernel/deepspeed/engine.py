"""The engine `zkernel.deepspeed.initialize` returns: DeepSpeed's engine methods over a zkernel `Engine`,
and the optimizer and scheduler objects a script may touch."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

from zkernel.checkpoint.reader import committed_tags
from zkernel.kernel.torch_optim_sync import TorchOptimizerSync
from zkernel.telemetry.log import get_logger

log = get_logger()

_STAGES = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3}


class _ParamGroup(MutableMapping):
    """One of `ClientOptimizer.param_groups`: ``"lr"`` is the engine's learning rate (read and set);
    the other keys are the config's optimizer hyperparameters, read-only."""

    def __init__(self, engine, params: list) -> None:
        self._engine = engine
        options = engine.config.optimizer
        self._fixed = {"params": params}
        for key in ("betas", "eps", "weight_decay"):
            value = getattr(options, key, None)
            if value is not None:
                self._fixed[key] = tuple(value) if key == "betas" else value

    def __getitem__(self, key: str) -> Any:
        if key == "lr":
            return self._engine.lr
        return self._fixed[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "lr":
            self._engine.lr = value
        elif key in self._fixed and self._fixed[key] == value:
            pass
        else:
            raise KeyError(
                f"param_groups[...][{key!r}] cannot be changed through zkernel.deepspeed: only 'lr' is the "
                "engine's between steps; set the others in the config's optimizer section"
            )

    def __delitem__(self, key: str) -> None:
        raise KeyError(f"param_groups[...][{key!r}] cannot be deleted")

    def __iter__(self) -> Iterator[str]:
        return iter(["lr", *self._fixed])

    def __len__(self) -> int:
        return len(self._fixed) + 1


class ClientOptimizer:
    """What ``initialize`` returns as the optimizer: ``param_groups[0]["lr"]`` reads and sets the engine's
    learning rate; ``zero_grad()`` does nothing (``engine.step()`` zeroes gradients); stepping it or its
    state dict is an error naming the engine's method to call instead."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.param_groups = [_ParamGroup(engine, [p for p in engine.module.parameters() if p.requires_grad])]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine zeroes gradients after each step."""

    def step(self, closure=None):
        raise RuntimeError("the optimizer steps in engine.step(), at the end of each accumulation window; "
                           "call engine.step() instead of optimizer.step()")

    def state_dict(self):
        raise RuntimeError("the optimizer's state is saved by engine.save_checkpoint(dir) and restored by "
                           "engine.load_checkpoint(dir)")

    def load_state_dict(self, state_dict):
        self.state_dict()


class ConfigScheduler:
    """What ``initialize`` returns as the lr scheduler where the config has a ``scheduler`` section: the
    engine applies the schedule in ``engine.step()``; ``step()`` does nothing and ``get_last_lr()`` is
    the learning rate of the next step."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def step(self, *args, **kwargs) -> None:
        """Nothing to do: the engine moves the schedule on in each optimizer step."""

    def get_last_lr(self) -> list[float]:
        return [self._engine.lr]

    def get_lr(self) -> list[float]:
        return [self._engine.lr]

    def state_dict(self) -> dict[str, Any]:
        return {}  # the schedule's position is saved in the engine's checkpoints

    def load_state_dict(self, state_dict) -> None:
        """Nothing to do: engine.load_checkpoint restores the schedule's position."""


class _ClientScheduler:
    """A client's torch lr scheduler over its torch optimizer (``mapping``, the optimizer as mapped):
    stepped after each optimizer step of the engine, the optimizer's groups then carried into the engine
    ([Note: following a torch optimizer] in `zkernel.kernel.torch_optim_sync`)."""

    def __init__(self, engine, scheduler, mapping) -> None:
        self.scheduler = scheduler
        self._sync = TorchOptimizerSync(mapping, engine, owns_rate=True)
        self._sync.sync()

    def advance(self) -> None:
        with warnings.catch_warnings():  # the torch optimizer never steps: the engine's does
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self._sync.sync()


class DeepSpeedEngine:
    """DeepSpeed's engine methods over a zkernel `Engine` (``engine.engine``); other attributes are the
    zkernel engine's (``state_dict()``, ``close()``, ``gathered_parameters()``, ``memory_report()``)."""

    def __init__(self, engine, micro_batch: int, *, client_scheduler: _ClientScheduler | None = None) -> None:
        self.engine = engine
        self._micro_batch = micro_batch
        self._client_scheduler = client_scheduler
        self.optimizer = ClientOptimizer(engine)
        self.lr_scheduler = ConfigScheduler(engine) if _has_schedule(engine.config) else None
        if client_scheduler is not None:
            self.lr_scheduler = client_scheduler.scheduler

    def __getattr__(self, name: str) -> Any:
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    # -- running ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Back-propagate ``loss``, divided by the accumulation steps unless ``scale_wrt_gas`` is False
        (and multiplied by the fp16 loss scale); ``retain_graph`` as torch's. Returns the loss as
        DeepSpeed's does: divided by the accumulation steps where it was. A plain ``loss.backward()``
        works too ([Note: a backward the engine is not told of] in `zkernel.kernel.user_backward`)."""
        self.engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        steps = self.engine.config.gradient_accumulation_steps
        return loss / steps if scale_wrt_gas and steps > 1 else loss

    def scale(self, loss):
        """``loss`` with the fp16 loss scale applied, for a ``.backward()`` of the script's own
        (``loss`` itself in other precisions); the backward divides by the accumulation steps."""
        return self.engine.scale(loss)

    def step(self, lr_kwargs=None) -> None:
        """Count the micro-batch; at the end of an accumulation window, step the optimizer (and schedule)."""
        before = self.engine.global_steps
        self.engine.step()
        if self._client_scheduler is not None and self.engine.global_steps != before:
            self._client_scheduler.advance()

    def zero_grad(self) -> None:
        """Nothing to do: the engine zeroes gradients after each step."""

    def destroy(self) -> None:
        """Collective: free what the engine holds and give the model back its parameters (`Engine.close`),
        as DeepSpeed's ``destroy()`` at the end of a script."""
        self.engine.close()

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    # -- what a script reads ------------------------------------------------------

    @property
    def module(self):
        return self.engine.module

    def parameters(self, recurse: bool = True) -> Iterator:
        """The model's parameters (DeepSpeed's engine is a module holding the model: the same tensors)."""
        return self.engine.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        """The model's parameters named as in DeepSpeed's engine, under ``module.``."""
        return self.engine.module.named_parameters(_under_module(prefix), recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator:
        return self.engine.module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        """The model's buffers named as in DeepSpeed's engine, under ``module.``."""
        return self.engine.module.named_buffers(_under_module(prefix), recurse, remove_duplicate)

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_steps * self.train_batch_size()

    @property
    def world_size(self) -> int:
        return self.engine.dist.world_size

    @property
    def global_rank(self) -> int:
        return self.engine.dist.rank

    @property
    def local_rank(self) -> int:
        return self.engine.dist.local_rank

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.engine.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self._micro_batch * self.gradient_accumulation_steps() * self.world_size

    def get_lr(self) -> list[float]:
        return [self.engine.lr]

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_accumulation_boundary

    def zero_optimization_stage(self) -> int:
        return _STAGES.get(self.engine.config.partitioner, 3)

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def fp16_enabled(self) -> bool:
        return self.engine.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.precision == "bf16"

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the last boundary's gradients (after the fp16 unscale, before clipping),
        as the engine measured it for clipping and the non-finite check; inf for an overflow; None
        where it was not measured (no clipping, no fp16, every group stepped on a GPU: [Note:
        non-finite gradients] in `zkernel.kernel.step_scaling`), as DeepSpeed's is None when its optimizer
        computes none."""
        return self.engine.last_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` changed the parameters: False inside an accumulation window and
        after a skipped step (an fp16 overflow, a non-finite gradient), as DeepSpeed's."""
        engine = self.engine
        _ = engine.skipped_steps  # reads a pending non-finite flag of the last step first
        at_boundary = engine.micro_steps > 0 and engine.micro_steps % engine.config.gradient_accumulation_steps == 0
        return at_boundary and engine.pipeline.last_applied

    # -- checkpoints ----------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective: write the checkpoint to ``save_dir/tag``, the tag DeepSpeed's default
        ``global_step<global steps>`` where none is given (``str(tag)`` otherwise, as DeepSpeed names an
        integer tag); ``save_latest=False`` is not offered (``latest`` always names the newest)."""
        if not save_latest:
            raise ValueError("save_checkpoint(save_latest=False) is not supported: zkernel points "
                             f"{Path(save_dir) / 'latest'} at each committed checkpoint")
        tag = f"global_step{self.engine.global_steps}" if tag is None else str(tag)
        self.engine.save_checkpoint(save_dir, tag, client_state=dict(client_state or {}),
                                    exclude_frozen_parameters=exclude_frozen_parameters)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn=None):
        """``(path, client_state)``, or ``(None, None)`` with a warning where ``load_dir`` holds no
        checkpoint, as DeepSpeed's. The learning-rate schedule's position is part of the engine's
        state: ``load_lr_scheduler_states=False`` keeps it only with ``load_module_only=True``."""
        if not load_module_strict:
            raise ValueError("load_checkpoint(load_module_strict=False) is not supported: zkernel loads a "
                             "checkpoint only into the model it was saved from")
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported")
        root = Path(load_dir)
        if tag is None and not (root / "latest").exists() and not committed_tags(root):
            log.warning("zkernel.deepspeed.no_checkpoint", directory=str(root),
                        note="no 'latest' file and no committed checkpoint: nothing loaded; "
                        "load_checkpoint returns (None, None)")
            return None, None
        loaded = self.engine.load_checkpoint(load_dir, tag, load_optimizer_states=load_optimizer_states,
                                             load_module_only=load_module_only)
        if loaded is None:  # an engine that answers an empty directory itself
            return None, None
        return str(loaded[0]), loaded[1]

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective: rank 0 writes the model's state dict in the compute dtype (bf16/fp16, or fp32 in an
        fp32 run; integer buffers as they are) to ``save_dir/save_filename``, loadable into the plain
        model with ``load_state_dict``: a pickle by ``torch.save``, or a safetensors file where the name
        ends in ``.safetensors``. ZeRO-3 parameters are gathered whatever
        ``stage3_gather_16bit_weights_on_model_save`` says. Returns True, as DeepSpeed's does when it saved."""
        from zkernel.deepspeed.model_file import on_rank0, sixteen_bit_state_dict, write_state_dict

        state = sixteen_bit_state_dict(self.engine, exclude_frozen_parameters)
        path = Path(save_dir) / save_filename

        def write() -> None:
            log.info("zkernel.deepspeed.save_16bit_model", path=str(path), tensors=len(state))
            write_state_dict(state, path)

        on_rank0(self.engine.dist, write, f"save_16bit_model could not write {path}")
        return True

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)


def _under_module(prefix: str) -> str:
    return f"{prefix}.module" if prefix else "module"


def _has_schedule(config) -> bool:
    schedule = getattr(config, "lr_schedule", None)
    return schedule is not None and getattr(schedule, "name", "none") != "none"
