"""DeepSpeed's user-facing API over zkernel: a DeepSpeed script runs with only its import changed.

    import zkernel.deepspeed as deepspeed

    deepspeed.init_distributed()
    with deepspeed.zero.Init():                      # built on the meta device; zero3 materialises it
        model = MyModel()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data, config="ds.json")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out, client_state={"epoch": epoch})
    path, client_state = engine.load_checkpoint(out)   # (None, None) where out holds no checkpoint

The config is read by `zkernel.from_deepspeed_config` (what maps and what is refused is
listed in docs/guide/deepspeed.md). A client optimizer is mapped into the
config's ``optimizer`` section where zkernel has its equivalent (``torch.optim.AdamW`` and
``torch.optim.Adam``, with any parameter groups: `zkernel.compat.torch_optim`); anything else is an error that says
what to write instead. The objects returned for the optimizer and the scheduler are views
of the engine (`ClientOptimizer`, `ConfigScheduler`): the engine steps, zeroes gradients and
schedules the learning rate itself.

Beside ``initialize``, scripts reach ``deepspeed.comm`` (`zkernel.deepspeed.comm`: rank,
world size, barrier and the collectives, a group of one in a single process) and
``deepspeed.accelerator.get_accelerator()`` (`zkernel.deepspeed.accelerator`: the device
zkernel computes on); their imports change the same way
(``from zkernel.deepspeed.accelerator import get_accelerator``). ``deepspeed.utils``
(`zkernel.deepspeed.utils`) has the ``safe_get_full_*``/``safe_set_full_*`` accessors of a
parameter's fp32 master, optimizer state and gradient, and ``zero_to_fp32``.
"""

from __future__ import annotations

from zkernel.deepspeed import comm, utils, zero
from zkernel.deepspeed.accelerator import get_accelerator
from zkernel.deepspeed.engine import ClientOptimizer, ConfigScheduler, DeepSpeedEngine
from zkernel.deepspeed.initialize import add_config_arguments, init_distributed, initialize

__all__ = [
    "ClientOptimizer",
    "ConfigScheduler",
    "DeepSpeedEngine",
    "add_config_arguments",
    "comm",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "utils",
    "zero",
]
