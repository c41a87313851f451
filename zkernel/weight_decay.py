"""Which parameters weight decay leaves alone (``[optimizer] no_weight_decay``).

[Note: parameters without weight decay] Training recipes decay the weight
matrices and not the biases and normalisation gains (Hugging Face's Trainer
and nanoGPT build two optimizer parameter groups for that; a DeepSpeed or
FSDP user passes them to the optimizer). Here one optimizer steps flat shards
of many parameters, so the exemption is per parameter: each pattern of
``no_weight_decay`` is matched (fnmatch) against every name a parameter has in
the user's model and against the class name of each module owning it
directly, before any transform renames or splits it. After partitioning
each group records the positions of its exempt parameters
(`ParamGroup.decay_exempt`, the pieces of a tiled parameter included through
`zkernel.param_map`), and an optimizer that declares ``exempts_decay`` steps
them with a weight decay of 0 (one kernel call per run of the shard, as for
step counts: [Note: per-parameter steps] in the Adam plugins' ``_adam_state``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn

from zkernel.config import ConfigError
from zkernel.groups import ParamGroup
from zkernel.log import get_logger
from zkernel.param_map import ParamMap

log = get_logger()


def exempt_names(model: nn.Module, patterns: Sequence[str]) -> frozenset[str]:
    """Every name (tied parameters have several) of the parameters ``patterns`` exempt from decay.

    Raises `ConfigError`, listing the classes owning parameters, when no
    pattern matches any parameter; a pattern that matches nothing while others
    do (a recipe written for several architectures: ``"*RMSNorm"`` on GPT-2) is
    named in one WARNING event, ``zkernel.optimizer.no_weight_decay_unmatched``.
    """
    if not patterns:
        return frozenset()
    owners: dict[int, list[tuple[str, str]]] = {}  # id(param) -> [(name, owning class)]
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            owners.setdefault(id(param), []).append((name, type(module).__name__))
    matched: set[str] = set()
    exempt: set[str] = set()
    count = 0
    for aliases in owners.values():
        hits = {p for p in patterns for name, cls in aliases if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(cls, p)}
        if hits:
            matched |= hits
            exempt.update(name for name, _ in aliases)
            count += 1
    unmatched = [p for p in patterns if p not in matched]
    if not matched:
        classes = sorted({cls for aliases in owners.values() for _, cls in aliases})
        raise ConfigError(
            f"optimizer.no_weight_decay {list(patterns)!r} matches no parameter; valid: fnmatch patterns "
            f"of parameter names (\"*.bias\") or class names of the modules owning parameters ({', '.join(classes)})"
        )
    if unmatched:
        log.warning("zkernel.optimizer.no_weight_decay_unmatched", patterns=unmatched, exempt_parameters=count)
    return frozenset(exempt)


def mark_exempt(model: nn.Module, groups: Iterable[ParamGroup], exempt: frozenset[str]) -> None:
    """Set each group's `ParamGroup.decay_exempt` from the user names ``exempt_names`` gave."""
    if not exempt:
        return
    param_map = ParamMap.of(model)
    for group in groups:
        group.decay_exempt = frozenset(
            i for i, held in enumerate(group.param_names) if param_map.user_name(held)[0] in exempt
        )
