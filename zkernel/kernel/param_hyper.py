"""Parameters with hyperparameters of their own (``[optimizer] param_groups`` and ``no_weight_decay``).

[Note: per-parameter hyperparameters] Training recipes step some parameters
differently from the rest: no weight decay on biases and normalisation gains
(Hugging Face's Trainer, nanoGPT), a smaller learning rate for embeddings or
lower layers (layer-wise decay when fine-tuning). A DeepSpeed or FSDP user
gives the optimizer parameter groups for that. Here one optimizer steps flat
shards of many parameters, so the groups become per-parameter overrides:

* each ``[[optimizer.param_groups]]`` entry names parameters by fnmatch
  patterns, matched against every name a parameter has in the user's model
  and against the class name of each module owning it directly, before any
  transform renames or splits it; a parameter takes the first entry it
  matches (its ``lr_scale`` times the step's learning rate, and its
  ``weight_decay``, ``betas`` and ``eps`` where the entry sets them, the
  step's where not), and ``no_weight_decay`` is one more entry, last, that
  sets a weight decay of 0 and nothing else;
* after partitioning each group records its parameters' overrides by
  position (`ParamGroup.param_hyper`; the pieces of a tiled parameter through
  `zkernel.params.param_map`), and an optimizer that declares ``per_param_hyper``
  steps them with theirs (and undoes such a step with them): one kernel call
  per run of the shard with one set of hyperparameters, as for step counts
  ([Note: per-parameter steps] in the Adam plugins' ``_adam_state``).

The betas an entry sets hold for all of training, while ``lr_scale`` scales
whatever rate the schedule sets. DeepSpeed's OneCycle (``one_cycle`` with
``cycle_momentum``) sets every parameter group's betas at each step, which
would overwrite a group's own there, so that schedule refuses entries that set
``betas`` at `zkernel.initialize` (``zkernel_plugins.lr_schedules.cyclic``)
rather than let one of the two settings lose silently; an entry's ``eps`` is
fine with it.

Patterns that match no parameter at all are an error; a pattern that matches
nothing while others match is named in one WARNING, so one recipe serves
several architectures (``"*RMSNorm"`` on GPT-2).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from zkernel.errors import ConfigError
from zkernel.spec.sections import OptimizerConfig, ParamGroupConfig
from zkernel.spec.groups import ParamGroup, ParamHyper
from zkernel.telemetry.log import get_logger
from zkernel.params.param_map import ParamMap

log = get_logger()


def _hyper(group: ParamGroupConfig) -> ParamHyper:
    """What one ``[[optimizer.param_groups]]`` entry sets, for `_entries` (None where it leaves the step's)."""
    return ParamHyper(
        lr_scale=float(group.lr_scale),
        weight_decay=group.weight_decay,
        betas=group.betas,
        eps=None if group.eps is None else float(group.eps),
    )


def _entries(optimizer: OptimizerConfig) -> list[tuple[tuple[str, ...], ParamHyper]]:
    entries = [(g.params, _hyper(g)) for g in optimizer.param_groups]
    if optimizer.no_weight_decay:
        entries.append((optimizer.no_weight_decay, ParamHyper(weight_decay=0.0)))
    return entries


def param_overrides(model: nn.Module, optimizer: OptimizerConfig) -> dict[str, ParamHyper]:
    """Every name (tied parameters have several) of the parameters the config gives their own
    hyperparameters, with them (see [Note: per-parameter hyperparameters])."""
    entries = _entries(optimizer)
    if not entries:
        return {}
    owners: dict[int, list[tuple[str, str]]] = {}  # id(param) -> [(name, owning class)]
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            owners.setdefault(id(param), []).append((name, type(module).__name__))
    patterns = [p for names, _ in entries for p in names]
    matched: set[str] = set()
    overrides: dict[str, ParamHyper] = {}
    for aliases in owners.values():
        hits = {p for p in patterns for name, cls in aliases if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(cls, p)}
        matched |= hits
        first = next((hyper for names, hyper in entries if hits.intersection(names)), None)
        if first is not None and first != ParamHyper():
            overrides.update((name, first) for name, _ in aliases)
    if not matched:
        classes = sorted({cls for aliases in owners.values() for _, cls in aliases})
        raise ConfigError(
            f"optimizer.param_groups and no_weight_decay patterns {patterns!r} match no parameter; valid: "
            f"fnmatch patterns of parameter names (\"*.bias\") or class names of the modules owning "
            f"parameters ({', '.join(classes)})"
        )
    unmatched = [p for p in dict.fromkeys(patterns) if p not in matched]
    if unmatched:
        log.warning(
            "zkernel.optimizer.patterns_unmatched",
            patterns=unmatched,
            overridden_parameters=sum(1 for aliases in owners.values() if aliases[0][0] in overrides),
        )
    return overrides


def mark_overrides(model: nn.Module, groups: Iterable[ParamGroup], overrides: dict[str, ParamHyper]) -> None:
    """Set each group's `ParamGroup.param_hyper` from what `param_overrides` gave, by the user's names."""
    if not overrides:
        return
    param_map = ParamMap.of(model)
    for group in groups:
        group.param_hyper = {
            i: overrides[user]
            for i, held in enumerate(group.param_names)
            if (user := param_map.user_name(held)[0]) in overrides
        }
