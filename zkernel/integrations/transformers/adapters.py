"""PEFT adapters (LoRA and the like) under a `ZKernelTrainer`: `is_adapter_model`, `saves_base_weights`.

[Note: an adapter over a frozen base] ``peft.get_peft_model(model, LoraConfig(...))`` freezes the
model's own parameters (``requires_grad=False``) and adds small trainable ones. The engine partitions
the frozen base like any parameter (under zero3 each rank holds its shard, gathered for each use) and
builds optimizer state for the trainable ones only, so nothing of the base is ever stepped. What
changes for the Trainer is what is written:

* ``save_model`` (and the ``checkpoint-N`` copy of it) writes what ``PeftModel.save_pretrained``
  writes, the adapter (``adapter_model.safetensors``, ``adapter_config.json``), as the plain Trainer
  does. The engine gathers only the trainable parameters for it
  (``Engine.state_dict(exclude_frozen_parameters=True)``), not the base, which may not fit in one
  host's memory; where the adapter's own save keeps base weights too (`saves_base_weights`) the whole
  model is gathered, so nothing the plain Trainer writes is left out.
* The engine's checkpoint in ``checkpoint-N/zkernel/`` leaves the frozen values out, as the Trainer
  asks of DeepSpeed for a PEFT model (``exclude_frozen_parameters``): a resumed run, or the best
  checkpoint loaded at the end, keeps the base the engine was built with, which must be the same
  pretrained weights (as with DeepSpeed).

peft is optional: without it no model is an adapter model.
"""

from __future__ import annotations

# peft.utils.other.EMBEDDING_LAYER_NAMES: target modules for which peft's save keeps the base
# embedding's weights beside the adapter (``save_embedding_layers="auto"``).
_EMBEDDING_NAMES = ("embed_tokens", "lm_head")


def is_adapter_model(model) -> bool:
    """Whether ``model`` is a PEFT model (``PeftModel``, ``PeftMixedModel``); False where peft is not
    installed. Asked by `ZKernelTrainer` when it saves a model or a checkpoint."""
    try:
        from peft import PeftMixedModel, PeftModel
    except ImportError:
        return False
    return isinstance(model, (PeftModel, PeftMixedModel))


def saves_base_weights(model) -> bool:
    """Whether ``model``'s (a PEFT model's) ``save_pretrained`` keeps frozen base weights beside the
    adapter: an adapter that targets an embedding layer (peft then saves the base embeddings, by its
    ``save_embedding_layers="auto"`` rule). `ZKernelTrainer.save_model` then gathers the whole model."""
    configs = getattr(model, "peft_config", {}) or {}
    for config in configs.values():
        targets = getattr(config, "target_modules", None) or ()
        if isinstance(targets, str):  # a regular expression over module names
            if any(name in targets for name in _EMBEDDING_NAMES):
                return True
        elif any(name in str(target) for target in targets for name in _EMBEDDING_NAMES):
            return True
    return False
