"""The generated references (docs/gen_reference.py): the configuration reference covers every key and says
what each means; the hook contract lists every hook spec."""

from __future__ import annotations

import importlib.util

import attrs
import pytest

from tests.support.paths import REPO


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schemas():
    from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager
    from zkernel.spec.config import CoreConfig
    from zkernel.spec.registry import Family
    from zkernel.spec.sections import ParamGroupConfig

    yield CoreConfig
    yield ParamGroupConfig
    for family in Family:
        if family.schema is not None:
            yield family.schema
    registry = collect_components(get_plugin_manager(autoload=False))
    for family in Family:
        for component in registry.components(family):
            for slot in family.slots:
                if component.options_for(slot) is not None:
                    yield component.options_for(slot)


def test_every_config_key_has_a_meaning(gen):
    """A field without the comment above it (STYLE.md's attrs convention) would be a blank row."""
    missing = [
        f"{cls.__module__}.{cls.__qualname__}.{field.name}"
        for cls in _schemas()
        for field in attrs.fields(cls)
        if field.name != "options" and not gen.field_comments(cls).get(field.name)
    ]
    assert not missing, "config fields without a comment saying what they mean: " + ", ".join(missing)


def test_the_reference_lists_every_key_and_builtin(gen):
    text = gen.config_reference()
    for cls in _schemas():
        for field in attrs.fields(cls):
            if field.name != "options":
                assert f"`{field.name}`" in text, f"{cls.__qualname__}.{field.name} missing from the reference"
    for heading in ("partitioner `zero3`", "offload tier `nvme`", "optimizer `cpu_adam`", "lr schedule `one_cycle`"):
        assert heading in text


def test_a_field_comment_is_read_from_the_class_and_its_bases(gen):
    @attrs.frozen
    class Base:
        # The base's meaning.
        inherited: int = 1

    @attrs.frozen
    class Options(Base):
        # Two lines
        # of meaning.
        own: str = "x"
        bare: int = 0

    comments = gen.field_comments(Options)
    assert comments == {"inherited": "The base's meaning.", "own": "Two lines of meaning.", "bare": ""}


def test_the_hook_contract_lists_every_hook_spec_under_a_phase(gen):
    from zkernel.spec import hookspecs

    specs = [name for name in vars(hookspecs) if name.startswith("zkernel_")]
    text = gen.hook_contract()
    assert text.startswith("## "), "the first hook sits under a phase banner"
    for name in specs:
        assert f"### `{name}`" in text and f"::: zkernel.spec.hookspecs.{name}" in text, name
    assert text.count("### ") == len(specs)
    assert "*first non-None result wins*" in text.split("### `zkernel_step_optimizer`")[1].split("###")[0]
