"""The Trainer's parameter counts with an engine's whole shapes: `engine_counts`, `register_engine`,
`non_embedding_count`.

[Note: counting released parameters] The Trainer logs "Number of trainable parameters" from
``transformers.trainer_pt_utils.get_model_param_count(model, trainable_only=True)``, a sum of
``p.numel()`` over the wrapped model's parameters. Under zero3 a released parameter is empty
(``numel() == 0``), so the sum misses almost all of the model. transformers corrects it for
DeepSpeed's zero3 inside that function (``ds_numel``, read when its global DeepSpeed config says
zero3); nothing there can be told about zkernel's engine, and the Trainer reaches the function by
its name in ``transformers.trainer``. While a `ZKernelTrainer` trains (`engine_counts`, around
``train``; transformers is not changed outside it), `model_param_count` stands under that name there
and in ``transformers.trainer_pt_utils``: for a model an engine runs (the Trainer's `EngineModule`,
or the model a ZKernelTrainer built its engine from) it answers `Engine.num_parameters`, which
counts the whole shapes the engine was built from, tied parameters once; for any other model it
calls transformers' own function. Outside ``train``, and in a module that imported the function by
value, transformers' own count (0 for released parameters) stays; `Engine.num_parameters` gives
the whole count there. The Trainer's ``total_flos`` (6 x tokens x the parameters outside
embeddings, in ``Trainer.floating_point_ops``, which ZKernelTrainer overrides) takes
`non_embedding_count` for the same reason.
"""

from __future__ import annotations

import contextlib
import weakref

from torch import nn

from zkernel.integrations.transformers.model import EngineModule

# The model each ZKernelTrainer built an engine from -> a weak reference to that engine: the engine holds
# the model, so a strong one would keep both alive for good.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# transformers' own ``get_model_param_count`` while `engine_counts` stands in for it.
_REPLACED: list = []


def register_engine(engine) -> None:
    """Count ``engine.module`` with ``engine``'s whole shapes; called by `ZKernelTrainer` when it builds
    its engine."""
    _ENGINES[engine.module] = weakref.ref(engine)


def model_param_count(model, trainable_only: bool = False) -> int:
    """``get_model_param_count`` as the Trainer calls it: the engine's count (`Engine.num_parameters`) for a
    model an engine runs, transformers' own count for any other ([Note: counting released parameters])."""
    if isinstance(model, EngineModule):
        engine = model.engine
    else:
        engine_ref = _ENGINES.get(model)
        engine = None if engine_ref is None else engine_ref()
    if engine is not None:
        return engine.num_parameters(trainable_only=trainable_only)
    return _REPLACED[0](model, trainable_only=trainable_only)


@contextlib.contextmanager
def engine_counts():
    """While the block runs, `model_param_count` stands under transformers' ``get_model_param_count`` in
    ``transformers.trainer`` and ``transformers.trainer_pt_utils``; their own function is back after it,
    however it ends. Entered by `ZKernelTrainer.train` (nested entries change nothing)."""
    from transformers import trainer, trainer_pt_utils

    if _REPLACED:  # an enclosing block stands in already
        yield
        return
    modules = [m for m in (trainer, trainer_pt_utils) if getattr(m, "get_model_param_count", None) is not None]
    saved = [m.get_model_param_count for m in modules]
    _REPLACED.append(trainer_pt_utils.get_model_param_count)
    try:
        for module in modules:
            module.get_model_param_count = model_param_count
        yield
    finally:
        for module, original in zip(modules, saved):
            module.get_model_param_count = original
        _REPLACED.clear()


def non_embedding_count(engine) -> int:
    """Elements of ``engine``'s model's parameters outside ``nn.Embedding`` weights, whole shapes, tied
    parameters once: ``PreTrainedModel.num_parameters(exclude_embeddings=True)`` of the model before the
    engine partitioned it. Called by `ZKernelTrainer.floating_point_ops` for each micro-batch."""
    model = engine.module
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Embedding)}
    return sum(
        engine.original_tensors.get(name, (p.shape, p.dtype))[0].numel()
        for name, p in model.named_parameters()
        if name not in embeddings
    )
