"""`ZKernelStrategy`: a Lightning strategy that trains the LightningModule through a zkernel engine.

The strategy is Lightning's DDP strategy (launch, process group, ``barrier``,
``broadcast``, ``reduce`` and the distributed sampler are DDP's) with the model,
the optimizer, the backward, the step and the checkpoints handed to
`zkernel.initialize`'s engine, as Lightning's DeepSpeed strategy hands them to
DeepSpeed's:

* ``setup``: the config (the ``config=`` given, with the Trainer's precision,
  accumulation and clipping, [Note: the Trainer's settings win] in
  `zkernel.integrations.lightning.settings`; and the optimizer from
  ``configure_optimizers``, [Note: the torch optimizer is a view] in
  `zkernel.integrations.lightning.optimizer`) initialises the engine over the
  LightningModule; the strategy's ``model`` calls the engine, so
  ``training_step``, ``validation_step``, ``test_step`` and ``predict_step``
  run under it (zero3's gathers included) on every rank.
* ``backward`` and ``optimizer_step``: [Note: accumulation under Lightning].
* checkpoints: ``trainer.save_checkpoint(path)`` writes a zkernel checkpoint
  directory at ``path`` (tag ``checkpoint``, every rank its shards) with
  Lightning's own state (epoch, global step, loops, callbacks, lr schedulers,
  the optimizer's hyperparameters) as its ``client_state``; ``fit(ckpt_path=path)``
  and ``validate``/``test(ckpt_path=path)`` load it after ``setup``
  (``restore_checkpoint_after_setup``). The model's weights are in the
  directory, not in a ``state_dict`` entry: `zkernel.consolidate` gives the full
  state dict, `zkernel.integrations.lightning.convert_checkpoint` one ordinary
  Lightning checkpoint file. ``ckpt_path`` may also name such a file (plain
  DDP's, the converter's): its weights load into the engine, the optimizer's
  moments start fresh ([Note: a checkpoint file or a directory]).
* ``model_sharded_context``: under zero3 modules built in ``configure_model`` are
  built on the meta device and materialised shard by shard by the engine
  (each module's ``reset_parameters()``, then ``init_fn`` where given).

Lightning comes in two packages ([Note: two Lightning packages] in
`zkernel.integrations.lightning._framework`); `build` makes the strategy and its
precision plugin for one of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.checkpoint.format import CheckpointError
from zkernel.errors import ConfigError
from zkernel.integrations.lightning import settings
from zkernel.integrations.lightning.optimizer import OptimizerMap
from zkernel.kernel.bootstrap import initialize
from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager, resolve_components
from zkernel.kernel.torch_optim_sync import TorchOptimizerSync
from zkernel.spec.config import auto_keys
from zkernel.telemetry.log import get_logger

log = get_logger()

# Precision plugins Lightning picks by itself for a strategy it does not know; the strategy takes
# their precision flag and uses its own plugin instead (the engine casts and scales).
_PLAIN_PRECISIONS = ("Precision", "MixedPrecision", "HalfPrecision")


class EngineModule(nn.Module):
    """The strategy's ``model``: calling it runs the engine's forward (Lightning redirects ``forward``
    to ``training_step`` and the others around this call); the LightningModule is its ``module``."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)  # not a submodule: the engine is no nn.Module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


def plain(value: Any) -> Any:
    """``value`` with every mapping a dict and every sequence a list or tuple: what a checkpoint's
    ``client_state`` loads back without pickled classes (Lightning's ``AttributeDict`` hyperparameters)."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, Path):
        return str(value)
    return value


class _Precision:
    """Methods of the precision plugin `build` makes (over the package's ``Precision``)."""

    def __init__(self, precision: Any = "32-true") -> None:
        self.zkernel_precision = settings.precision_of(precision)
        self.precision = str(precision)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The module as it is: the engine keeps parameters in the config's precision."""
        return module

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (``training_step`` and backward), then the ``on_before_optimizer_step`` and
        gradient-clipping hooks; the strategy steps the engine after. Returns the closure's result."""
        return self._wrap_closure(model, optimizer, closure)

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Nothing to do: the engine clips the global norm at the step (``gradient_clipping``)."""


class _Strategy:
    """Methods of the strategy `build` makes (over the package's ``DDPStrategy``); see the module docstring."""

    strategy_name = "zkernel"

    def __init__(
        self,
        config: Any = None,
        *,
        init_fn: Callable[[nn.Module], Any] | None = None,
        nvme_path: str | os.PathLike | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            **kwargs,
        )
        base = settings.load_base_config(config)
        if nvme_path is not None:
            base = attrs.evolve(base, offload=attrs.evolve(base.offload, nvme_path=Path(nvme_path)))
        # Component names and their options are checked now, not when the Trainer gets to setup.
        resolve_components(collect_components(get_plugin_manager(config=base)), base, skip=auto_keys(base))
        self._base_config = base
        self._init_fn = init_fn
        self._engine: Any = None
        self._engine_config: Any = None
        self._sync: TorchOptimizerSync | None = None
        self._accumulation = 1
        self._stepping = False  # inside optimizer_step: the backward in its closure ends a window
        self._backward_pending = False
        self._weights_from_file = False  # load_checkpoint read a file: load_model_state_dict loads its weights

    # -- what the user reads --------------------------------------------------------

    @property
    def engine(self) -> Any:
        """The zkernel engine (`zkernel.kernel.engine.Engine`) after ``setup``; None before."""
        return self._engine

    @property
    def config(self) -> Any:
        """The engine's `zkernel.Config` after ``setup``; before it, the one given (with its defaults)."""
        return self._engine_config if self._engine_config is not None else self._base_config

    # -- precision ------------------------------------------------------------------

    @property
    def precision_plugin(self) -> Any:
        return self._precision_plugin if self._precision_plugin is not None else self._precision_class()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        if plugin is not None and not isinstance(plugin, self._precision_class):
            if type(plugin).__name__ not in _PLAIN_PRECISIONS:
                raise ConfigError(
                    f"ZKernelStrategy does not support the precision plugin {type(plugin).__name__}: the engine "
                    f"computes in the config's precision; use Trainer(precision=...) with one of "
                    f"{', '.join(repr(k) for k in settings.PRECISIONS)}"
                )
            plugin = self._precision_class(plugin.precision)
        self._precision_plugin = plugin

    # -- set-up -----------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: a checkpoint loads into the engine, which ``setup`` makes."""
        return True

    @property
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning decides which batches step ([Note: accumulation under Lightning])."""
        return False

    @contextlib.contextmanager
    def model_sharded_context(self):
        """Under zero3, modules built in ``configure_model`` go on the meta device, for the engine to
        materialise shard by shard at ``setup``; otherwise nothing changes."""
        if self._base_config.partitioner != "zero3":
            yield
            return
        with torch.device("meta"):
            yield

    def setup(self, trainer: Any) -> None:
        """Initialise (or keep) the engine over the LightningModule; called by the Trainer on every rank
        before fit, validate, test or predict runs."""
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == "fit"
        if fitting and not module.automatic_optimization:
            raise ConfigError(
                "ZKernelStrategy supports automatic optimization only (the engine steps once per accumulation "
                "window); set automatic_optimization = True, or train that module with another strategy"
            )
        self._accumulation = int(trainer.accumulate_grad_batches)
        config = settings.with_trainer_settings(
            self._base_config,
            precision=self.precision_plugin.zkernel_precision,
            accumulation=self._accumulation,
            clipping=settings.clipping_of(trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
        )
        mapping = None
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ConfigError(
                    f"ZKernelStrategy trains with one optimizer from configure_optimizers, got {len(self.optimizers)}: "
                    "return one torch.optim.AdamW or torch.optim.Adam (with any parameter groups)"
                )
            mapping = OptimizerMap(self.optimizers[0], module)
            offloaded = config.offload.optimizer != "none"
            config = attrs.evolve(config, optimizer=mapping.section(config.optimizer, offloaded))
            if self.lr_scheduler_configs and config.lr_schedule.name != "none":
                raise ConfigError(
                    f"configure_optimizers returns an lr scheduler and the config has lr_schedule "
                    f"{config.lr_schedule.name!r}: keep one of them"
                )
            if _overrides(module, "configure_gradient_clipping"):
                log.warning(
                    "zkernel.lightning.clipping_hook",
                    note="configure_gradient_clipping is called but clips nothing: the engine clips the global "
                    "norm at the step; use Trainer(gradient_clip_val=...)",
                )
        engine = self._engine
        if engine is not None and not engine.closed and (
            engine.module is not module or (fitting and config != self._engine_config)
        ):
            engine.close()  # its module is whole again; a new engine takes this module with this config
            engine = None
        if engine is None or engine.closed:
            engine = initialize(module, config, init_fn=self._init_fn)
            self._engine, self._engine_config = engine, config
        self.model = EngineModule(engine)
        self._sync = TorchOptimizerSync(mapping, engine, owns_rate=config.lr_schedule.name == "none") if mapping else None
        self.barrier()

    def teardown(self) -> None:
        """Lightning's teardown, except that the module stays where the engine keeps it (the engine stays
        open for ``trainer.save_checkpoint`` and later runs of the same Trainer)."""
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- a training step ------------------------------------------------------------------
    #
    # [Note: accumulation under Lightning] Lightning decides which batch steps the
    # optimizer (accumulate_grad_batches, and the last batch of an epoch, where it
    # steps a shorter window): it calls optimizer_step (whose closure runs the
    # training step and the backward) for those, and the closure alone for the
    # others. The engine counts micro-batches itself (gradient_accumulation_steps),
    # so each backward is told what Lightning decided: outside optimizer_step the
    # micro-batch is counted at once (engine.step() applies nothing mid-window);
    # inside it, the backward is made the window's last (where Lightning ends a
    # window early, the engine's count moves to the boundary) and engine.step()
    # follows the closure. Lightning divides the loss by accumulate_grad_batches
    # before the backward, and engine.backward averages over the window too, so the
    # loss is multiplied back once: the gradients are Lightning's (and DDP's).

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward hooks around `zkernel.kernel.engine.Engine.backward`; returns the loss."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        engine = self._engine
        steps = engine.config.gradient_accumulation_steps
        position = engine.micro_steps % steps
        if self._stepping:
            if self._sync is not None:
                self._sync.sync()
            if position != steps - 1:
                engine.micro_steps += steps - 1 - position
        elif position == steps - 1:
            raise RuntimeError(
                f"Lightning accumulates a batch where the engine's window of {steps} micro-batches ends "
                f"(micro_steps {engine.micro_steps}): the counts disagree (was the engine stepped outside the Trainer?)"
            )
        engine.backward(closure_loss * self._accumulation if self._accumulation != 1 else closure_loss)
        if self._stepping:
            self._backward_pending = True
        else:
            engine.step()  # counts the micro-batch; mid-window it applies nothing
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (training step and backward, the window's last), then the engine's step."""
        model = model or self.lightning_module
        self._stepping, self._backward_pending = True, False
        try:
            result = self.precision_plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        finally:
            self._stepping = False
        if self._backward_pending:
            self._backward_pending = False
            self._engine.step()
            # The torch optimizer never steps (the engine's does); tell its schedulers it did, as
            # torch's own step() wrapper would, so they do not warn of a scheduler stepped first.
            optimizer._opt_called = True
        return result

    # -- checkpoints ------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """{}: the weights are saved by the engine into the checkpoint directory (`save_checkpoint`)."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The torch optimizer's state dict without per-parameter state (torch's layout: each group's
        hyperparameters and parameter numbers, ``state`` empty); called by Lightning when it saves. Its
        moments are the engine's, in the checkpoint directory; a torch optimizer loads this as a fresh one
        ([Note: what the converted file keeps of the optimizer] in `zkernel.integrations.lightning.convert`)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write the engine's checkpoint to the directory ``filepath`` (tag ``checkpoint``) with Lightning's
        state as its client state; collective (``trainer.save_checkpoint`` calls it on every rank)."""
        if storage_options is not None:
            raise TypeError(
                "trainer.save_checkpoint(..., storage_options=...) is not supported by ZKernelStrategy: the engine "
                "writes the checkpoint directory itself"
            )
        if self._engine is None or self._engine.closed:
            raise RuntimeError("ZKernelStrategy.save_checkpoint needs the engine: run fit, validate or test first")
        filepath = self.broadcast(str(filepath))
        client = plain({k: v for k, v in checkpoint.items() if k != "state_dict"})
        self._engine.save_checkpoint(filepath, "checkpoint", client_state=client)

    # [Note: a checkpoint file or a directory] ``ckpt_path`` names either a
    # directory, which only trainer.save_checkpoint under this strategy writes (the
    # engine's shards with Lightning's state), or a file, which is an ordinary
    # Lightning checkpoint (plain DDP's, convert_checkpoint's): the kind of the
    # path says which without doubt, so no flag chooses (DeepSpeedStrategy is told
    # by load_full_weights=True that a path is a file of whole weights). What a
    # file lacks is said instead, in a warning when fitting: the engine takes
    # optimizer moments from its own checkpoints only, so a fit resumed from a file
    # starts the moments and the engine's counters fresh; the weights, loops,
    # schedulers and the optimizer's hyperparameters resume. Rank 0 alone reads the
    # file (through the strategy's checkpoint_io) and broadcasts Lightning's state
    # without the weights and moments; the weights reach the engine in
    # load_model_state_dict, from rank 0's dict (after Lightning's
    # on_load_checkpoint hooks have seen it; the other ranks' ``state_dict`` is
    # empty) with broadcast_from_rank0, so one copy of the file is in memory.

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's state from ``checkpoint_path``, called by the Trainer for ``ckpt_path`` after ``setup``;
        collective. A directory (`save_checkpoint`'s) loads into the engine here (the optimizer's state only
        when fitting); a single Lightning checkpoint file loads its ``state_dict`` in `load_model_state_dict`
        ([Note: a checkpoint file or a directory])."""
        path = Path(self.broadcast(str(checkpoint_path)))
        kind = self.broadcast("directory" if path.is_dir() else "file" if path.is_file() else "missing")
        if kind == "missing":
            raise FileNotFoundError(
                f"{str(path)!r} does not exist: ckpt_path must be a checkpoint directory written by "
                "trainer.save_checkpoint under ZKernelStrategy, or a Lightning checkpoint file"
            )
        fitting = self.lightning_module.trainer.state.fn == "fit"
        if kind == "file":
            return self._load_checkpoint_file(path, weights_only, fitting)
        loaded = self._engine.load_checkpoint(path, load_optimizer_states=fitting)
        if loaded is None:
            raise FileNotFoundError(f"{str(path)!r} holds no committed zkernel checkpoint (no 'latest')")
        return dict(loaded[1])

    def _load_checkpoint_file(self, path: Path, weights_only: bool | None, fitting: bool) -> dict[str, Any]:
        """Lightning's state from the checkpoint file ``path``, read on rank 0; rank 0's keeps its ``state_dict``."""
        loaded: Any = None
        error = None
        if self.is_global_zero:
            try:
                loaded = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            except Exception as exc:  # noqa: BLE001 - every rank raises it below
                error = f"it could not be read: {type(exc).__name__}: {exc}"
            else:
                if not isinstance(loaded, Mapping) or not isinstance(loaded.get("state_dict"), Mapping):
                    error = "it has no 'state_dict' entry (a Lightning checkpoint file has the module's weights there)"
        shared = None
        if error is None and self.is_global_zero:
            shared = {k: v for k, v in loaded.items() if k != "state_dict"}
            if "optimizer_states" in shared:  # the moments are not loaded: not sent to the other ranks
                shared["optimizer_states"] = [
                    {k: v for k, v in state.items() if k != "state"} if isinstance(state, Mapping) else state
                    for state in shared["optimizer_states"]
                ]
        error, shared = self.broadcast((error, shared))
        if error is not None:
            raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint file ZKernelStrategy can load: {error}")
        if fitting and self.is_global_zero:
            log.warning(
                "zkernel.lightning.fresh_optimizer_state",
                path=str(path),
                note="a single checkpoint file holds no engine optimizer state: its weights, loops, schedulers and "
                "the optimizer's hyperparameters resume, the optimizer's moments start fresh; resume from the "
                "checkpoint directory trainer.save_checkpoint wrote to keep them",
            )
        self._weights_from_file = True
        return {**shared, "state_dict": loaded["state_dict"] if self.is_global_zero else {}}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Called by the Trainer after `load_checkpoint`: a checkpoint file's ``state_dict`` (rank 0's) becomes the
        engine's weights on every rank; after a directory, nothing (`load_checkpoint` loaded the weights)."""
        if not self._weights_from_file:
            return
        self._weights_from_file = False
        weights = checkpoint["state_dict"] if self.is_global_zero else {}
        self._engine.load_state_dict(weights, strict=strict, broadcast_from_rank0=True)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Give the torch optimizer back its groups' hyperparameters (the schedulers continue from them);
        the moments came back with the engine's checkpoint."""
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            saved = state.get("param_groups", [])
            if len(saved) != len(optimizer.param_groups):
                raise ValueError(
                    f"the checkpoint's optimizer has {len(saved)} parameter groups, configure_optimizers "
                    f"returned {len(optimizer.param_groups)}"
                )
            for group, values in zip(optimizer.param_groups, saved):
                group.update({k: v for k, v in values.items() if k != "params"})

    # -- registry -----------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"zkernel"`` and the presets (`zkernel.integrations.lightning.settings.PRESETS`)."""
        for name, (description, config) in settings.PRESETS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, config=config)


def _overrides(module: Any, method: str) -> bool:
    mine = getattr(type(module), method, None)
    for base in type(module).__mro__:
        if base.__name__ == "LightningModule" and method in vars(base):
            return mine is not vars(base)[method]
    return False


def build(framework: SimpleNamespace) -> tuple[type, type]:
    """``(ZKernelStrategy, ZKernelPrecision)`` for one Lightning package (`_framework.load`)."""
    precision = type(
        "ZKernelPrecision",
        (_Precision, framework.Precision),
        {"__module__": "zkernel.integrations.lightning", "__doc__": _PRECISION_DOC},
    )
    strategy = type(
        "ZKernelStrategy",
        (_Strategy, framework.DDPStrategy),
        {"__module__": "zkernel.integrations.lightning", "__doc__": _STRATEGY_DOC, "_precision_class": precision},
    )
    return strategy, precision


_STRATEGY_DOC = """A Lightning strategy training the LightningModule through a zkernel engine.

``Trainer(strategy=ZKernelStrategy(config=...))`` or ``Trainer(strategy="zkernel")`` (and the presets
``"zkernel_stage_1"`` ... ``"zkernel_stage_3_offload_nvme"``). ``config``: what `zkernel.initialize` takes
(a dict, a .json/.toml path, a DeepSpeed config, a `zkernel.Config`); the Trainer's ``precision``,
``accumulate_grad_batches`` and ``gradient_clip_val`` and the optimizer and lr scheduler from
``configure_optimizers`` (a torch Adam/AdamW) fill in the rest. ``init_fn``: initialises modules built on
the meta device (``configure_model`` under zero3), as `zkernel.initialize`'s. ``nvme_path``: the NVMe
directory of the offload tiers. The other arguments are DDPStrategy's. ``strategy.engine`` is the engine
after setup. See `zkernel.integrations.lightning.strategy`.
"""

_PRECISION_DOC = """The precision plugin of `ZKernelStrategy`: Lightning's precision flag selects the engine's
``precision``; the engine casts, scales and clips, so this plugin runs Lightning's hooks only."""
