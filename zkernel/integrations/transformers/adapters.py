"""PEFT adapters (LoRA and the like) under a `ZKernelTrainer`: `is_adapter_model`, `saves_base_weights`,
`adapter_alone`.

[Note: an adapter over a frozen base] ``peft.get_peft_model(model, LoraConfig(...))`` freezes the
model's own parameters (``requires_grad=False``) and adds small trainable ones. The engine partitions
the frozen base like any parameter (under zero3 each rank holds its shard, gathered for each use) and
builds optimizer state for the trainable ones only, so nothing of the base is ever stepped. What
changes for the Trainer is what is written:

* ``save_model`` (and the ``checkpoint-N`` copy of it) writes what ``PeftModel.save_pretrained``
  writes, the adapter (``adapter_model.safetensors``, ``adapter_config.json``), as the plain Trainer
  does. The engine gathers only the trainable parameters for it
  (``Engine.state_dict(exclude_frozen_parameters=True)``), not the base, which may not fit in one
  host's memory; where the adapter's own save may keep base weights too (an adapter on the
  embeddings, a resized vocabulary: `saves_base_weights`) the whole model is gathered, so nothing the
  plain Trainer writes is left out.
* The engine's checkpoint in ``checkpoint-N/zkernel/`` leaves the frozen values out, as the Trainer
  asks of DeepSpeed for a PEFT model (``exclude_frozen_parameters``): a resumed run, or the best
  checkpoint loaded at the end, keeps the base the engine was built with, which must be the same
  pretrained weights (as with DeepSpeed).

peft is optional: without it no model is an adapter model.
"""

from __future__ import annotations

import json
import os

from zkernel.platform.distributed import every_rank

# peft.utils.other.EMBEDDING_LAYER_NAMES: target modules for which peft's save keeps the base
# embedding's weights beside the adapter (``save_embedding_layers="auto"``).
_EMBEDDING_NAMES = ("embed_tokens", "lm_head")
_CONFIG_FILE = "config.json"


def is_adapter_model(model) -> bool:
    """Whether ``model`` is a PEFT model (``PeftModel``, ``PeftMixedModel``); False where peft is not
    installed. Asked by `ZKernelTrainer` when it saves a model or a checkpoint."""
    try:
        from peft import PeftMixedModel, PeftModel
    except ImportError:
        return False
    return isinstance(model, (PeftModel, PeftMixedModel))


def saves_base_weights(model) -> bool:
    """Whether ``model``'s (a PEFT model's) ``save_pretrained`` may keep frozen base weights beside the
    adapter, by peft's ``save_embedding_layers="auto"`` rule: an adapter that targets an embedding layer,
    or a vocabulary resized from the base model's (`_vocabulary_resized`). `ZKernelTrainer.save_model`
    then gathers the whole model, so nothing peft would save is missing."""
    configs = getattr(model, "peft_config", {}) or {}
    for config in configs.values():
        targets = getattr(config, "target_modules", None) or ()
        if isinstance(targets, str):  # a regular expression over module names
            if any(name in targets for name in _EMBEDDING_NAMES):
                return True
        elif any(name in str(target) for target in targets for name in _EMBEDDING_NAMES):
            return True
        if _vocabulary_resized(model, getattr(config, "base_model_name_or_path", None)):
            return True
    return False


def adapter_alone(model, engine) -> bool:
    """Whether `ZKernelTrainer.save_model` gathers ``model``'s trainable parameters alone: a PEFT model whose
    save keeps no base weights (`saves_base_weights`), on every rank (collective where ``engine`` is
    distributed: one rank's answer may differ, its hub cache being its own, and the gather that follows
    must be the same everywhere; any rank's doubt gathers the whole model)."""
    alone = is_adapter_model(model) and not saves_base_weights(model)
    if engine.dist.distributed:
        return every_rank(alone, engine.device)
    return alone


def _vocabulary_resized(model, base: str | None) -> bool:
    """Whether ``model``'s vocabulary differs from that of the base model's ``config.json`` (a directory, or
    a hub id whose file is in the local cache), as peft checks; True where that file cannot be read here
    (peft may read it from the hub), so the whole model is gathered rather than an embedding left out. A
    model built from a config (no ``base_model_name_or_path``) has no base to differ from."""
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not base or not vocab_size:
        return False
    path = os.path.join(base, _CONFIG_FILE)
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return True
        try:
            path = try_to_load_from_cache(base, _CONFIG_FILE)
        except ValueError:  # neither a directory nor a hub id
            return True
        if not isinstance(path, str):
            return True
    try:
        with open(path) as file:
            base_vocab = json.load(file).get("vocab_size")
    except (OSError, ValueError):
        return True
    return base_vocab is not None and base_vocab != vocab_size
