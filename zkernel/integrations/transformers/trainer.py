"""`ZKernelTrainer`: the Hugging Face ``Trainer`` with a zkernel engine where DDP or DeepSpeed would be.

The Trainer's loop, data loading, logging, evaluation, callbacks and ``checkpoint-N`` layout stay
the Trainer's own. What changes, each in one overridden method:

* ``create_accelerator_and_postprocess``: the accelerator gets the engine's backward, gradient norm
  and optimizer handling ([Note: the accelerator] in `zkernel.integrations.transformers.accelerator`);
* ``_move_model_to_device``: nothing (``zkernel.initialize`` places the model, partitioned);
* ``create_optimizer`` / ``create_scheduler``: the Trainer's optimizer becomes zkernel's ``[optimizer]``
  and the Trainer holds a view of it ([Note: who steps] in `zkernel.integrations.transformers.optimizer`);
* ``_wrap_model``: ``zkernel.initialize`` with the config the arguments filled ([Note: the arguments
  fill the config] in `zkernel.integrations.transformers.config`), once, for training and evaluation;
* ``save_model``: the consolidated state dict (collective), written by ``save_pretrained`` on the main
  process: safetensors that ``from_pretrained`` loads, tied weights kept tied;
* ``_save_optimizer_and_scheduler`` / ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler``: the
  engine's sharded checkpoint in ``checkpoint-N/zkernel/`` beside the Trainer's own state, RNG states
  and scheduler;
* ``_load_best_model``: the best checkpoint's engine state back into the engine at the end of
  ``train`` ([Note: the best model at the end]).

A PEFT model (LoRA over a frozen base) trains its adapter alone; ``save_model`` writes the adapter and
the engine's checkpoints leave the frozen base out ([Note: an adapter over a frozen base] in
`zkernel.integrations.transformers.adapters`).

The Trainer's "Number of trainable parameters" and ``floating_point_ops`` (its ``total_flos``) count
the engine's whole shapes, also under zero3 ([Note: counting released parameters] in
`zkernel.integrations.transformers.param_count`).

[Note: meta-device construction] A model too large for one rank is built on the meta device
(``with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)``); with zero3 the
engine materialises each module on the ranks that own its shards, initialised by the model's own
``_init_weights``, and ``zkernel_pretrained=<directory>`` then loads a ``save_pretrained`` directory's
safetensors files into it one file at a time (`load_pretrained`), so no rank ever holds the whole model.

[Note: the best model at the end] With ``load_best_model_at_end`` the Trainer, once its loop is done,
calls ``_load_best_model`` on every rank; under DeepSpeed that loads the DeepSpeed checkpoint of
``state.best_model_checkpoint`` into the engine with its optimizer and lr scheduler states. A
ZKernelTrainer does the same with the engine's checkpoint in ``checkpoint-N/zkernel/`` (weights,
optimizer state, counters, the config's schedule) and the Trainer's scheduler from
``checkpoint-N/scheduler.pt``: the engine is as it was after the best step, so ``save_model``,
``evaluate`` and further training see the best weights on every rank, whatever the partitioner or
offload. The Trainer's ``state`` (its step count, log history) stays the finished run's, as with
DeepSpeed. The weights Trainer-side loading would read (``model.safetensors``) are written by the main
process alone; the engine's checkpoint has every rank's shards, so nothing is gathered or broadcast.
A best checkpoint without an engine checkpoint (deleted, or never written) raises `CheckpointError`
on every rank rather than leave the last step's weights in place; ``save_only_model=True``, whose
checkpoints have none, is refused when the trainer is built, as the Trainer refuses it with DeepSpeed.

[Note: the Trainer's gradient checkpointing] ``TrainingArguments(gradient_checkpointing=True)`` (in
transformers 5 also ``activation_checkpointing=True``) makes the Trainer call the model's
``gradient_checkpointing_enable`` before the engine is built: each decoder layer then runs through
``torch.utils.checkpoint``, reentrant or not as ``gradient_checkpointing_kwargs`` says. The engine needs
nothing for it: under zero1 and zero2 parameters are whole, and under zero3 the scheduler recognises a
recomputation inside backward whoever started it ([Note: recompute] in `zkernel.kernel.scheduler`), so
each layer is gathered once for its recomputation and its backward. The config's own
``[activation_checkpointing] modules`` does the same job; with both, a selected layer would be
checkpointed inside the Trainer's checkpoint and recomputed twice in each backward, so the pair is
refused when the trainer is built (`refuse_double_checkpointing`). So is a ``[planner] micro_batch``:
with it the planner sizes activations as if nothing were checkpointed and may select the blocks for
checkpointing itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from zkernel.checkpoint.format import CheckpointError
from zkernel.compat.deepspeed.config import is_deepspeed_config
from zkernel.errors import ConfigError
from zkernel.integrations.transformers.accelerator import bind_engine_accelerator
from zkernel.integrations.transformers.adapters import adapter_alone, is_adapter_model
from zkernel.integrations.transformers.config import (
    check_against_arguments,
    has_lr_schedule,
    read_source,
    refuse_double_checkpointing,
    resolve,
)
from zkernel.integrations.transformers.model import EngineModule
from zkernel.integrations.transformers.optimizer import ConfigScheduleView, EngineOptimizer
from zkernel.integrations.transformers.param_count import engine_counts, non_embedding_count, register_engine
from zkernel.integrations.transformers.pretrained import load_pretrained
from zkernel.kernel.bootstrap import initialize
from zkernel.telemetry.log import get_logger

log = get_logger()

# Where the engine's checkpoint sits inside the Trainer's checkpoint-N directory.
ENGINE_CHECKPOINT = "zkernel"
# The Trainer's file name for its lr scheduler's state (transformers.trainer.SCHEDULER_NAME).
SCHEDULER_FILE = "scheduler.pt"


class ZKernelTrainer(Trainer):
    """``transformers.Trainer`` training through zkernel: ``ZKernelTrainer(model=..., args=TrainingArguments(...),
    zkernel_config=..., ...)``, every other argument as the Trainer takes it.

    ``zkernel_config``: a zkernel config (dict, .toml or .json path) or a DeepSpeed config (dict or .json
    path), its "auto" values and the keys it leaves out filled from ``args``; a value that contradicts
    ``args`` raises `ConfigError` here. ``zkernel_pretrained``: a ``save_pretrained`` directory whose
    weights are loaded into the engine after it is built (for a model built on the meta device).
    """

    def __init__(self, model=None, args=None, *positional: Any, zkernel_config: Any = None,
                 zkernel_pretrained: str | os.PathLike | None = None, **kwargs: Any) -> None:
        if zkernel_config is None:
            raise ConfigError(
                "ZKernelTrainer needs zkernel_config=: a zkernel config (dict, .toml/.json path) or a DeepSpeed "
                "config (dict, .json path); e.g. {\"partitioner\": \"zero3\", \"offload\": {\"optimizer\": \"cpu\"}}"
            )
        raw = read_source(zkernel_config)
        self.zkernel_config = zkernel_config
        self.zkernel_pretrained = zkernel_pretrained
        self._schedule_in_config = has_lr_schedule(raw, is_deepspeed_config(raw))
        self._zkernel_module: EngineModule | None = None
        self._zkernel_steps: int | None = None
        self._zkernel_flops_params: int | None = None  # `floating_point_ops`'s parameter count
        if args is not None:
            _one_device_per_process(args)
        super().__init__(model, args, *positional, **kwargs)
        _one_device_per_process(self.args)
        self._train_batch_size = self.args.train_batch_size
        for flag, name in ((self.args.deepspeed, "deepspeed"), (self.args.fsdp, "fsdp")):
            if flag:
                raise ConfigError(
                    f"TrainingArguments({name}=...) and ZKernelTrainer both partition the model; valid: "
                    f"no {name} argument (a DeepSpeed config goes in zkernel_config=)"
                )
        if self.args.load_best_model_at_end and self.args.save_only_model:
            raise ConfigError(
                "TrainingArguments(load_best_model_at_end=True, save_only_model=True): ZKernelTrainer loads the best "
                f"checkpoint's engine state from checkpoint-N/{ENGINE_CHECKPOINT}/, which save_only_model leaves out "
                "([Note: the best model at the end]); valid: save_only_model=False, or load_best_model_at_end=False"
            )
        check_against_arguments(zkernel_config, self.args, self.args.world_size)
        refuse_double_checkpointing(raw, self.args)

    def train(self, *args: Any, **kwargs: Any):
        """The Trainer's ``train``, its parameter counts taken from the engine while it runs ([Note: counting
        released parameters] in `zkernel.integrations.transformers.param_count`)."""
        with engine_counts():
            return super().train(*args, **kwargs)

    # -- the accelerator and the model's placement ------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, bound to take the engine's backward ([Note: the accelerator])."""
        super().create_accelerator_and_postprocess()
        bind_engine_accelerator(self.accelerator)

    def _move_model_to_device(self, model, device) -> None:
        """Nothing: ``zkernel.initialize`` moves the model (its shards, under zero3) to the engine's device."""

    @property
    def engine(self):
        """The zkernel engine (built by the first ``train``, ``evaluate`` or ``predict``), else None."""
        return None if self._zkernel_module is None else self._zkernel_module.engine

    # -- optimizer and schedule -----------------------------------------------------------------------

    def create_optimizer(self, model=None):
        """The Trainer's optimizer (``optim``, ``learning_rate``, its no-decay groups), held as an
        `EngineOptimizer` view ([Note: who steps]); its settings become zkernel's ``[optimizer]``."""
        if isinstance(self.optimizer, EngineOptimizer):
            return self.optimizer
        built = super().create_optimizer() if model is None else super().create_optimizer(model)
        self.optimizer = EngineOptimizer(built)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's lr scheduler over the `EngineOptimizer`; where the config has its own schedule, a
        view of the engine's rate (`ConfigScheduleView`)."""
        self._zkernel_steps = num_training_steps
        if self.lr_scheduler is None and self._schedule_in_config:
            self.lr_scheduler = ConfigScheduleView(self._engine_rates)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer=optimizer)

    def _engine_rates(self) -> list[float]:
        module = self._zkernel_module
        if module is None:
            return [float(self.args.learning_rate)]
        return list(module.last_lr) or [module.engine.lr]

    # -- the engine ---------------------------------------------------------------------------------

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """The `EngineModule` over the model, built at the first call (``train``, ``evaluate``, ``predict``)."""
        if self._zkernel_module is None:
            self._zkernel_module = self._build_engine()
        return self._zkernel_module

    def _build_engine(self) -> EngineModule:
        model = self.model
        engine_device = "cuda" if torch.cuda.is_available() else "cpu"  # zkernel computes on the GPU when it has one
        if self.args.device.type != engine_device:
            raise ConfigError(
                f"the Trainer runs on {self.args.device} but zkernel computes on {engine_device} (it takes the GPU "
                "whenever CUDA is visible); valid: no use_cpu=True where a GPU is visible, or "
                "CUDA_VISIBLE_DEVICES= to train on the CPU"
            )
        if not isinstance(self.optimizer, EngineOptimizer):
            self.create_optimizer()
        # The step count: create_scheduler's (transformers 4.x calls it first), the state's in train(), the arguments'.
        steps = self._zkernel_steps or self.state.max_steps or max(self.args.max_steps, 0)
        config = resolve(
            self.zkernel_config,
            self.args,
            model=model,
            world_size=self.args.world_size,
            num_training_steps=steps or None,
            trainer_optimizer=self.optimizer.trainer_optimizer,
        )
        on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        init_fn = getattr(model, "_init_weights", None) if on_meta else None
        engine = initialize(model, config, init_fn=init_fn)
        module = EngineModule(engine, rate_source=None if self._schedule_in_config else self.optimizer)
        register_engine(engine)
        self.accelerator.zkernel_model = module
        log.info(
            "zkernel.trainer.engine",
            partitioner=config.partitioner,
            precision=config.precision,
            optimizer=config.optimizer.name,
            offload_optimizer=config.offload.optimizer,
            offload_params=config.offload.params,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            gradient_clipping=config.gradient_clipping,
            schedule="config" if self._schedule_in_config else "trainer",
            built_on_meta=on_meta,
        )
        if self.zkernel_pretrained is not None:
            load_pretrained(engine, self.zkernel_pretrained)
        return module

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's estimate for one micro-batch's forward and backward, 6 x input tokens x the model's
        parameters outside its embeddings, counted whole ([Note: counting released parameters]); the
        Trainer's ``training_step`` loop adds it to ``total_flos``."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if self._zkernel_module is None or main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._zkernel_flops_params is None:  # the shapes never change: counted once, not per micro-batch
            self._zkernel_flops_params = non_embedding_count(self._zkernel_module.engine)
        return 6 * inputs[main_input].numel() * self._zkernel_flops_params

    # -- saving and resuming ----------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a directory ``from_pretrained`` loads (collective once the engine exists: call on every rank):
        the engine's consolidated weights through ``save_pretrained`` on the main process; for a PEFT model
        the adapter, as the plain Trainer writes it ([Note: an adapter over a frozen base])."""
        if self._zkernel_module is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        # An adapter's save keeps its own tensors only: the frozen base is not gathered ([Note: an adapter
        # over a frozen base]).
        engine = self._zkernel_module.engine
        state_dict = engine.state_dict(rank0_only=True, exclude_frozen_parameters=adapter_alone(self.model, engine))
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint in ``output_dir/zkernel`` (every rank writes its shards; a PEFT model's
        frozen base left out, [Note: an adapter over a frozen base]) and the Trainer's scheduler state beside
        it; the Trainer saves its own state and RNG states around this call."""
        if self._zkernel_module is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self._zkernel_module.engine.save_checkpoint(
            Path(output_dir) / ENGINE_CHECKPOINT, exclude_frozen_parameters=is_adapter_model(self.model)
        )
        if self.args.should_save and not isinstance(self.lr_scheduler, ConfigScheduleView):
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_FILE)
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Nothing for a ZKernelTrainer checkpoint: its weights come back with the engine's state, once the
        engine exists (`_load_optimizer_and_scheduler`). Any other checkpoint cannot resume one."""
        if (Path(resume_from_checkpoint) / ENGINE_CHECKPOINT).is_dir():
            return None
        raise ConfigError(
            f"resume_from_checkpoint={str(resume_from_checkpoint)!r} holds no {ENGINE_CHECKPOINT}/ directory: it was "
            "not written by ZKernelTrainer, so its optimizer state cannot be restored; valid: a checkpoint-N "
            "directory a ZKernelTrainer saved, or (to start from another run's weights) a model loaded with "
            "from_pretrained and no resume_from_checkpoint"
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The engine's weights, optimizer state, counters and RNG states from ``checkpoint/zkernel``
        (collective), and the Trainer's scheduler from ``checkpoint/scheduler.pt``."""
        if checkpoint is None:
            return
        self._load_from_checkpoint(checkpoint)  # the same check, for a resume that skipped it
        self._load_engine_state(checkpoint, "resume_from_checkpoint")

    def _load_best_model(self) -> None:
        """The engine's state at ``state.best_model_checkpoint``, as DeepSpeed's engine loads its own there
        ([Note: the best model at the end]); the Trainer's ``train`` calls it on every rank when it ends with
        ``load_best_model_at_end``. Collective."""
        if self._zkernel_module is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        log.info("zkernel.trainer.best_model", checkpoint=str(best), metric=self.args.metric_for_best_model,
                 score=self.state.best_metric)
        self._load_engine_state(best, "load_best_model_at_end")
        return None

    def _load_engine_state(self, checkpoint: str, purpose: str) -> None:
        """Load ``checkpoint/zkernel`` into the engine (collective) and ``checkpoint/scheduler.pt`` into the
        Trainer's scheduler; a checkpoint whose engine directory holds none raises `CheckpointError` on every
        rank (the engine then unchanged). ``purpose``: the argument that asked, for the message."""
        directory = Path(checkpoint) / ENGINE_CHECKPOINT
        if self._zkernel_module.engine.load_checkpoint(directory) is None:  # None on every rank alike
            raise CheckpointError(
                f"{purpose}: {directory} holds no engine checkpoint (no 'latest' file: it was deleted or never "
                f"written), so the engine cannot take {checkpoint}'s state and would keep its own; valid: a "
                f"checkpoint-N directory a ZKernelTrainer saved, with its {ENGINE_CHECKPOINT}/ directory whole"
            )
        scheduler_file = Path(checkpoint) / SCHEDULER_FILE
        if not isinstance(self.lr_scheduler, ConfigScheduleView) and scheduler_file.is_file():
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
            # A torch scheduler sets its groups' rates when it steps, not when it loads; a plain Trainer
            # gets them back from optimizer.pt. The next step's rates are the scheduler's last ones.
            for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                group["lr"] = lr


def _one_device_per_process(args) -> None:
    """Make the Trainer drive one device per process, as it does under DeepSpeed.

    [Note: one device per process] A single process that sees several GPUs (``python train.py`` on a
    two-GPU machine, no launcher) makes the plain Trainer count them all (``args.n_gpu``): it wraps the
    model in ``nn.DataParallel``, multiplies the batch by the count and scales the loss by it, expecting
    DataParallel to average it back. The engine computes on its own device only, so the loss and its
    gradient came out that many times too large (seen on two GPUs as twice the loss and grad norm).
    DeepSpeed's Trainer path pins the count to one; so does this.
    """
    if args.n_gpu > 1:  # (reading it sets the devices up first, which sets the count)
        args._n_gpu = 1
