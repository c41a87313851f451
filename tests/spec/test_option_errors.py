"""Every component option error names the key, the value and what is valid, like the top-level keys."""

from __future__ import annotations

import attrs
import pytest
import torch

import zkernel
from zkernel.spec.config import ConfigError
from zkernel.spec.options import build_options, choice, integer, number


def tiny():
    return torch.nn.Linear(3, 2)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"partitioner": "zero3", "partitioner_options": {"units": "block"}},
            "partitioner_options.units 'block' is not valid; valid: modules, blocks",
        ),
        (
            {"optimizer": {"implementation": "fuse"}},
            "optimizer.implementation 'fuse' is not valid; valid: auto, triton, fused, foreach, for_loop",
        ),
        (
            {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": "0"}},
            "partitioner_options.persistence_threshold '0' is not valid; valid: an integer >= 0",
        ),
        (
            {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": -1}},
            "partitioner_options.persistence_threshold -1 is not valid; valid: an integer >= 0",
        ),
        (
            {"partitioner": "zero3", "partitioner_options": {"peer_gathers": "yes"}},
            "partitioner_options.peer_gathers 'yes' is not valid; valid: auto, always, never",
        ),
        (
            {"partitioner": "zero3", "partitioner_options": {"peer_reductions": "always"}},
            "partitioner_options.peer_reductions 'always' is not valid; valid: auto, never",
        ),
        (
            {"partitioner": "zero3", "partitioner_options": {"peer_gathers": "always"}},
            'partitioner_options.peer_gathers = "always", but it needs CUDA devices and NCCL with more than one rank; '
            'use "auto" or "never"',
        ),
        (
            {"partitioner": "zero3", "partitioner_options": {"init_seed": 1.5}},
            "partitioner_options.init_seed 1.5 is not valid; valid: an integer",
        ),
        (
            {"partitioner": "zero2", "partitioner_options": {"bucket_size": 0}},
            "partitioner_options.bucket_size 0 is not valid; valid: an integer >= 1",
        ),
        (
            {"partitioner": "zero1", "partitioner_options": {"bucket_size": True}},
            "partitioner_options.bucket_size True is not valid; valid: an integer >= 1",
        ),
        (
            {"optimizer": {"decoupled_weight_decay": "no"}},
            "optimizer.decoupled_weight_decay 'no' is not valid; valid: true or false",
        ),
        (
            {"optimizer": {"name": "cpu_adam", "threads": 0}},
            "optimizer.threads 0 is not valid; valid: an integer >= 1, or null (left out)",
        ),
    ],
)
def test_builtin_option_errors(raw, message):
    with pytest.raises(ConfigError) as info:
        zkernel.initialize(tiny(), raw)
    assert str(info.value) == message


def test_a_validator_message_that_names_the_key_is_kept():
    @attrs.frozen(kw_only=True)
    class Opts:
        share: float | str = attrs.field(default=0.0, validator=lambda _i, _a, v: _share(v))

    def _share(v):
        if v != "auto" and not (isinstance(v, (int, float)) and 0 <= v <= 1):
            raise ValueError(f"opt.share must be a number in [0, 1] or \"auto\", got {v!r}")

    with pytest.raises(ConfigError) as info:
        build_options("opt", Opts, {"share": 2})
    assert str(info.value) == 'opt.share must be a number in [0, 1] or "auto", got 2'


def test_valid_options_still_build():
    engine = zkernel.initialize(
        tiny(), {"partitioner": "zero3", "partitioner_options": {"units": "blocks", "persistence_threshold": 0, "init_seed": 3}}
    )
    assert engine.config.partitioner_options["units"] == "blocks"
    engine = zkernel.initialize(tiny(), {"optimizer": {"name": "cpu_adam", "threads": None, "decoupled_weight_decay": False}})
    assert engine.config.optimizer.options == {"threads": None, "decoupled_weight_decay": False}


@attrs.frozen(kw_only=True)
class ThirdPartyOptions:
    """A third party's options class, with plain attrs validators and bare annotations."""

    mode: str = attrs.field(default="a", validator=attrs.validators.in_(("a", "b")))
    depth: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    ratio: float = 0.5
    label: str | None = None
    momentum: float = attrs.field(default=0.0, validator=number(minimum=0, above=None))
    low: int = attrs.field(default=0, validator=integer())
    high: int = attrs.field(default=1, validator=integer())
    style: str = attrs.field(default="x", validator=choice("x", "y"))

    def __attrs_post_init__(self):
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "c"}, "opt.mode 'c' is not valid; valid: a, b"),
        ({"depth": "3"}, "opt.depth '3' is not valid; valid: an integer"),
        ({"depth": 0}, "opt.depth 0 is not valid; valid: an integer ('depth' must be > 0: 0)"),
        ({"ratio": "half"}, "opt.ratio 'half' is not valid; valid: a number"),
        ({"ratio": float("nan")}, "opt.ratio nan is not valid; valid: a number"),
        ({"label": 3}, "opt.label 3 is not valid; valid: a string, or null (left out)"),
        ({"momentum": -0.1}, "opt.momentum -0.1 is not valid; valid: a number >= 0"),
        ({"style": "z"}, "opt.style 'z' is not valid; valid: x, y"),
        ({"low": 2, "high": 1}, "opt: low (2) must be below high (1)"),
        ({"depht": 2}, "unknown config key opt.depht; valid: lr, mode, depth, ratio, label, momentum, low, high, style"),
    ],
)
def test_third_party_option_errors_read_the_same(options, message):
    """The checks live in `build_options`, so a plugin's own attrs class gets the same messages."""
    with pytest.raises(ConfigError) as info:
        build_options("opt", ThirdPartyOptions, options, common=("lr",))
    assert str(info.value) == message


def test_third_party_valid_options_pass():
    built = build_options("opt", ThirdPartyOptions, {"mode": "b", "depth": 2, "ratio": 1, "label": None, "low": -1})
    assert built == ThirdPartyOptions(mode="b", depth=2, ratio=1, label=None, low=-1)


def test_direct_construction_names_the_field():
    from zkernel_plugins.partitioners.zero3 import Zero3Options

    with pytest.raises(ConfigError, match="units 'block' is not valid; valid: modules, blocks"):
        Zero3Options(units="block")


@pytest.mark.parametrize(
    ("raw", "family", "hook"),
    [
        ({"offload": {"optimizer": "cpu9"}}, "offload tier", "zkernel_register_offload_tiers"),
        ({"partitioner": "zero4"}, "partitioner", "zkernel_register_partitioners"),
        ({"optimizer": {"name": "lamb"}}, "optimizer", "zkernel_register_optimizers"),
    ],
)
def test_not_installed_lists_names_and_says_how_to_register(raw, family, hook):
    with pytest.raises(ConfigError) as info:
        zkernel.initialize(tiny(), raw)
    message = str(info.value)
    assert "is not installed; installed: " in message
    assert f"No loaded plugin offers the {family}" in message
    assert f"`{hook}(registry)`" in message and "registry.add(" in message
    assert "entry-point group 'zkernel'" in message and "plugins=[module]" in message and "config key `plugins`" in message


def test_not_installed_mentions_blocked_plugins():
    with pytest.raises(ConfigError) as info:
        zkernel.initialize(tiny(), {"partitioner": "zero1", "blocked_plugins": ["partitioner_zero1"]})
    message = str(info.value)
    assert "partitioner 'zero1' is not installed; installed: none, zero2, zero3;" in message
    assert "might offer it: partitioner_zero1" in message
