"""A family is declared once (`zkernel.spec.registry.Family`), and its components own their rules.

[Note: declaring a family] and [Note: capabilities] in `zkernel.spec.registry`,
[Note: family sections] in `zkernel.spec.sections`.
"""

from __future__ import annotations

import attrs
import pytest

from zkernel.kernel.config_source import load_config
from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager, resolve_components
from zkernel.spec import PARAMS_ON_TIER, ConfigError, hookimpl
from zkernel.spec.config import AUTO_KEYS, Config, config_from_dict, section_keys
from zkernel.spec.registry import Family


def test_config_sections_and_their_keys_come_from_the_family_declarations():
    declared = {f.section: f.schema for f in Family if f.section}
    assert set(declared) == {"offload", "optimizer", "tiling", "activation_checkpointing", "lr_schedule", "planner"}
    fields = {a.name: a for a in attrs.fields(Config)}
    defaults = Config()
    for section, schema in declared.items():
        assert section in fields
        assert type(getattr(defaults, section)) is schema
        assert section_keys(section) == tuple(a.name for a in attrs.fields(schema) if a.name != "options")
    assert AUTO_KEYS == tuple(s.key for f in Family for s in f.slots if s.auto)
    # Each section is built from its declaration: an unknown key of a section without options is
    # an error listing that section's keys; one with options takes it as the component's.
    with pytest.raises(ConfigError, match="unknown config key offload.tape; valid: optimizer, params, nvme_path"):
        config_from_dict({"offload": {"tape": 1}})
    assert config_from_dict({"tiling": {"along": "input"}}).tiling.options == {"along": "input"}


class _Mine:
    """A third party's partitioner that holds parameters on a tier, and a tier with a check."""

    @hookimpl
    def zkernel_register_partitioners(self, registry):
        registry.add("mine", object, capabilities=(PARAMS_ON_TIER,))
        registry.add("whole", object)

    @hookimpl
    def zkernel_register_offload_tiers(self, registry):
        def check(config, slot):
            if config.seed is None:
                raise ConfigError(f"{slot.key} 'seeded' needs seed")

        registry.add("seeded", object, check=check)


def _resolve(raw):
    config = load_config(raw)
    return resolve_components(collect_components(get_plugin_manager([_Mine()], config=config)), config)


def test_a_third_party_partitioner_declares_it_holds_parameters_on_a_tier():
    selection = _resolve({"partitioner": "mine", "offload": {"params": "cpu"}})
    assert selection["offload.params"].component.name == "cpu"
    with pytest.raises(ConfigError) as info:
        _resolve({"partitioner": "whole", "offload": {"params": "cpu"}})
    assert str(info.value) == (
        "offload.params 'cpu' needs partitioner 'mine' or 'zero3' (parameters are whole on every rank with "
        "'whole'); valid: offload.params = 'none' (or 'auto'), or partitioner = 'mine' or 'zero3' (or 'auto')"
    )


def test_a_component_checks_the_config_it_runs_under():
    with pytest.raises(ConfigError, match="offload.optimizer 'seeded' needs seed"):
        _resolve({"offload": {"optimizer": "seeded"}})
    assert _resolve({"seed": 1, "offload": {"optimizer": "seeded"}})["offload.optimizer"].component.name == "seeded"
    # The builtin nvme tier's rule is its own check, no longer the config's.
    assert load_config({"offload": {"optimizer": "nvme"}}).offload.optimizer == "nvme"
    with pytest.raises(ConfigError, match="offload.nvme_path is required when offload.optimizer or offload.params is 'nvme'"):
        _resolve({"offload": {"optimizer": "nvme"}})


def test_the_estimator_resolves_options_through_the_registry():
    from torch import nn

    from zkernel.kernel.sizing import Estimator

    config = load_config({"partitioner": "zero1", "partitioner_options": {"bucket_size": 1024}})
    registry = collect_components(get_plugin_manager(config=config))
    sizing = Estimator(nn.Module(), "cpu", get_plugin_manager(config=config))
    assert sizing.partitioner_options(config) == registry.select(config, "partitioner").options
    with pytest.raises(ConfigError, match="partitioner_options.bucket_size 'big' is not valid"):
        sizing.partitioner_options(attrs.evolve(config, partitioner_options={"bucket_size": "big"}))
