"""zkernel behind the Hugging Face ``transformers.Trainer``: `ZKernelTrainer`.

Importing this package imports transformers (``pip install "zkernel[transformers]"``); ``import zkernel``
never does. Modules: `trainer` (the Trainer subclass), `config` (the Trainer's arguments in the engine's
config), `optimizer` (the Trainer's optimizer and scheduler over the engine's), `accelerator` (the
engine's backward behind the Trainer's accelerator), `model` (the engine as the module the Trainer
drives), `pretrained` (a ``save_pretrained`` directory loaded into a partitioned model), `param_count`
(the Trainer's parameter count from the engine's whole shapes), `adapters` (PEFT models: what
is saved of an adapter over a frozen base).
"""

from zkernel.integrations.transformers.trainer import ZKernelTrainer

__all__ = ["ZKernelTrainer"]
