"""The contract between zkernel's kernel and its plugins: read this package first.

- `hookspecs`: every hook the kernel fires, who calls it, when, and how results combine.
- `groups`: parameter groups (the unit of fetch, release and step) and the values crossing hooks.
- `tiers`: the interface of a tier that holds a role's buffers (GPU, pinned CPU, NVMe, ...).
- `lr_schedule`, `planner`: the interfaces of learning-rate schedules and placement planners.
- `registry`: the families of selectable components and how config selects them.
- `config`: the core config schema; `options`: how a component declares its own options.
- `runtime`: the context a selected component is built with.
- `model_shape`: a model by its transformer numbers, and the activations such a model saves.
- `sizing`: how partitioners, tiers and optimizers answer for their bytes before training.

A plugin imports this package (and `zkernel.platform`, `zkernel.telemetry`,
`zkernel.params` for the services they offer), never the kernel: everything a
plugin may use from the contract is re-exported here.
"""

# Public name -> the module that defines it. Loaded on first use, so that `import zkernel` (which
# reads `zkernel.spec.config`) does not import torch.
_EXPORTS = {
    "ConfigError": "zkernel.errors",
    "AUTO": "zkernel.spec.config",
    "Config": "zkernel.spec.config",
    "config_value": "zkernel.spec.config",
    "str_tuple": "zkernel.spec.config",
    "Fragment": "zkernel.spec.groups",
    "OptimizerDeclaration": "zkernel.spec.groups",
    "ParamGroup": "zkernel.spec.groups",
    "ParamHyper": "zkernel.spec.groups",
    "Phase": "zkernel.spec.groups",
    "ReducedGradient": "zkernel.spec.groups",
    "ShardLayout": "zkernel.spec.groups",
    "StateSpec": "zkernel.spec.groups",
    "StepOptions": "zkernel.spec.groups",
    "hookimpl": "zkernel.spec.hookspecs",
    "hookspec": "zkernel.spec.hookspecs",
    "LRSchedule": "zkernel.spec.lr_schedule",
    "OptionValidator": "zkernel.spec.options",
    "boolean": "zkernel.spec.options",
    "build_options": "zkernel.spec.options",
    "choice": "zkernel.spec.options",
    "integer": "zkernel.spec.options",
    "number": "zkernel.spec.options",
    "Capacities": "zkernel.spec.planner",
    "PlacementError": "zkernel.spec.planner",
    "Plan": "zkernel.spec.planner",
    "Planner": "zkernel.spec.planner",
    "PlanRequest": "zkernel.spec.planner",
    "Component": "zkernel.spec.registry",
    "ComponentRegistry": "zkernel.spec.registry",
    "Family": "zkernel.spec.registry",
    "MATERIALIZES_META": "zkernel.spec.registry",
    "Need": "zkernel.spec.registry",
    "ON_COMPUTE_DEVICE": "zkernel.spec.registry",
    "PARAMS_ON_TIER": "zkernel.spec.registry",
    "PER_PARAM_HYPER": "zkernel.spec.registry",
    "Selected": "zkernel.spec.registry",
    "Slot": "zkernel.spec.registry",
    "RuntimeContext": "zkernel.spec.runtime",
    "TransformerShape": "zkernel.spec.model_shape",
    "estimate_activations": "zkernel.spec.model_shape",
    "Buffer": "zkernel.spec.sizing",
    "DEVICE": "zkernel.spec.sizing",
    "PartitionSizing": "zkernel.spec.sizing",
    "Placement": "zkernel.spec.sizing",
    "Role": "zkernel.spec.sizing",
    "SizedGroup": "zkernel.spec.sizing",
    "SizingService": "zkernel.spec.sizing",
    "Spill": "zkernel.spec.sizing",
    "SpillCount": "zkernel.spec.sizing",
    "TierSizing": "zkernel.spec.sizing",
    "master_bytes": "zkernel.spec.sizing",
    "master_kept_split": "zkernel.spec.sizing",
    "totals": "zkernel.spec.sizing",
    "HOST_MARGIN": "zkernel.spec.tiers",
    "Capacity": "zkernel.spec.tiers",
    "OptimizerTier": "zkernel.spec.tiers",
    "ParamsTier": "zkernel.spec.tiers",
    "PlacementInfo": "zkernel.spec.tiers",
    "Resource": "zkernel.spec.tiers",
    "ShardState": "zkernel.spec.tiers",
    "StoredBytes": "zkernel.spec.tiers",
    "WholeParams": "zkernel.spec.tiers",
}

__all__ = [
    "AUTO",
    "DEVICE",
    "HOST_MARGIN",
    "MATERIALIZES_META",
    "ON_COMPUTE_DEVICE",
    "PARAMS_ON_TIER",
    "PER_PARAM_HYPER",
    "Buffer",
    "Capacities",
    "Capacity",
    "Component",
    "ComponentRegistry",
    "Config",
    "ConfigError",
    "Family",
    "Fragment",
    "LRSchedule",
    "Need",
    "OptimizerDeclaration",
    "OptimizerTier",
    "OptionValidator",
    "ParamGroup",
    "ParamHyper",
    "ParamsTier",
    "PartitionSizing",
    "Phase",
    "Placement",
    "PlacementError",
    "PlacementInfo",
    "Plan",
    "PlanRequest",
    "Planner",
    "ReducedGradient",
    "Resource",
    "Role",
    "RuntimeContext",
    "Selected",
    "ShardLayout",
    "ShardState",
    "SizedGroup",
    "SizingService",
    "Spill",
    "SpillCount",
    "StateSpec",
    "StepOptions",
    "Slot",
    "StoredBytes",
    "TierSizing",
    "TransformerShape",
    "WholeParams",
    "boolean",
    "build_options",
    "choice",
    "config_value",
    "estimate_activations",
    "hookimpl",
    "hookspec",
    "integer",
    "master_bytes",
    "master_kept_split",
    "number",
    "str_tuple",
    "totals",
]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zkernel.spec' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
