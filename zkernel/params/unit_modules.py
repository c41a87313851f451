"""Which modules are zero3's units: the ``units`` policy, modules compiled in place, leaf modules.

Shared by the zero3 partitioner (`plugins/partitioners/_flat.module_units`) and
the estimator, so both count the same units.

[Note: leaf modules] zero3 gathers a unit around its module's forward, a
collective every rank must issue. A module only some ranks run (an expert
kept in a ``ModuleDict`` or a ``ModuleList`` and skipped when no token of this
rank chose it) cannot be a unit of its own: the ranks would issue different
gathers. ``leaf_modules`` (DeepSpeed's ``set_z3_leaf_modules``) names modules,
by class name or by a pattern of their names, that are each one unit with
their whole subtree (the root too: then the whole model is one unit), as
FSDP2's users wrap the mixture-of-experts layer: the
layer runs on every rank, and an expert a rank did not use gets no gradient
there, which the reduction order handles (see [Note: reduction order] in
`zkernel.kernel.reduction_order`).

[Note: expert layers] Hugging Face's mixture-of-experts layers keep their
experts in a ``ModuleList`` or ``ModuleDict`` called ``experts`` (Switch
Transformers, NLLB-MoE, DeepSeek; DeepSpeed's MoE calls it
``deepspeed_experts``) and run only the experts this rank's tokens chose. With
one unit per module every such model stopped at its first step with
`RankDivergenceError` unless the user named the layer in ``leaf_modules``, as
DeepSpeed's users must call ``set_z3_leaf_modules``. So by default
(``leaf_experts``) a module that holds such a container of two or more
experts is a leaf module: the layer, which every rank runs, is one unit with
its experts. Experts that always all run lose nothing but the finer
granularity; ``leaf_experts = false`` gives it back.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from zkernel.platform.compiled import with_compiled_units
from zkernel.params.module_select import select_modules

UNIT_POLICIES = ("modules", "blocks")
EXPERT_CONTAINERS = "*experts"  # fnmatch pattern of the attribute names of expert containers


def expert_layers(root: nn.Module) -> list[nn.Module]:
    """Modules holding a ``ModuleList``/``ModuleDict`` of two or more experts (see [Note: expert layers])."""
    return [
        m
        for m in root.modules()
        if any(
            isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) >= 2 and fnmatch.fnmatchcase(name, EXPERT_CONTAINERS)
            for name, child in m.named_children()
        )
    ]


def unit_module_ids(
    root: nn.Module, policy: str = "modules", leaf_modules: tuple[str, ...] = (), leaf_experts: bool = True
) -> set[int]:
    """Ids of the modules that are units under ``policy`` (see `module_units`), with modules compiled
    in place, those ``leaf_modules`` selects and (``leaf_experts``) mixture-of-experts layers each made
    one unit of its whole subtree."""
    if policy == "modules":
        unit_ids = {id(m) for m in root.modules()}
    else:
        unit_ids = {id(root)}
        for m in root.modules():
            if isinstance(m, (nn.ModuleList, nn.Sequential)):
                unit_ids.update(id(child) for child in m.children())
    unit_ids = with_compiled_units(root, unit_ids)
    # The root too, when named (its class): the whole model is then one unit, gathered around its forward.
    leaves = [m for _, m in select_modules(root, leaf_modules, "partitioner_options.leaf_modules")]
    if leaf_experts:
        leaves += [m for m in expert_layers(root) if m is not root]
    if not leaves:
        return unit_ids
    inside = {id(d) for m in leaves for d in m.modules() if d is not m}
    return (unit_ids | {id(m) for m in leaves}) - inside
