"""The plain model as a checkpoint sees it: canonical names, state-dict keys, where each value lives.

A parameter tied under several names is stored once, under its first name in
``named_parameters()`` (its canonical name); the state dict's keys, in the
plain model's order, map each key to the canonical parameter or buffer it
shows, so a consolidated state dict has every key ``load_state_dict(strict=True)``
expects, tied ones included.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from zkernel.params.param_map import held_names


PARAM, BUFFER, EXTRA = "param", "buffer", "extra"


@attrs.frozen
class ModelView:
    params: dict[str, nn.Parameter]  # canonical name -> parameter
    names: dict[int, str]  # id(parameter) -> canonical name
    buffers: dict[str, torch.Tensor]  # canonical name -> persistent buffer
    # (state-dict key, PARAM | BUFFER | EXTRA, canonical name or the key itself for EXTRA)
    keys: tuple[tuple[str, str, str], ...]
    extra: dict[str, Any]  # state-dict values that are neither (``get_extra_state``)


def view_of(module: nn.Module) -> ModelView:
    params = dict(module.named_parameters())
    names = {id(p): n for n, p in params.items()}
    buffer_names = {id(b): n for n, b in module.named_buffers()}
    keys, buffers, extra = [], {}, {}
    # keep_vars: the parameter objects themselves, read without any torch operation on them; a
    # transform's pieces under their held names ([Note: composed parameters] in `zkernel.params.param_map`)
    with held_names():
        entries = module.state_dict(keep_vars=True)
    for key, value in entries.items():
        if isinstance(value, torch.Tensor) and id(value) in names:
            keys.append((key, PARAM, names[id(value)]))
        elif isinstance(value, torch.Tensor) and id(value) in buffer_names:
            name = buffer_names[id(value)]
            buffers[name] = value
            keys.append((key, BUFFER, name))
        else:
            extra[key] = value
            keys.append((key, EXTRA, key))
    return ModelView(params=params, names=names, buffers=buffers, keys=tuple(keys), extra=extra)
