"""The Trainer's precision, accumulation and clipping as config; the precision plugin the strategy keeps;
the names registered in Lightning's StrategyRegistry."""

from __future__ import annotations

import json

import pytest

from zkernel.errors import ConfigError
from zkernel.spec.config import Config

pl = pytest.importorskip("pytorch_lightning")

from zkernel.integrations.lightning import ZKernelPrecision, ZKernelStrategy, settings  # noqa: E402


@pytest.mark.parametrize(
    "flag, precision",
    [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("16-mixed", "fp16")],
)
def test_precision_flags_map(flag, precision):
    assert settings.precision_of(flag) == precision
    strategy = ZKernelStrategy()
    strategy.precision_plugin = pl.plugins.precision.MixedPrecision(flag, "cpu") if "mixed" in flag else (
        pl.plugins.precision.HalfPrecision(flag) if flag.endswith("-true") and flag != "32-true"
        else pl.plugins.precision.Precision()
    )
    assert isinstance(strategy.precision_plugin, ZKernelPrecision)
    assert strategy.precision_plugin.zkernel_precision == precision


def test_other_precisions_are_errors_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"precision='64-true'.*'32-true', '32', 'bf16-mixed'"):
        settings.precision_of("64-true")
    with pytest.raises(ConfigError, match="precision plugin DoublePrecision"):
        ZKernelStrategy().precision_plugin = pl.plugins.precision.DoublePrecision()


def test_clipping_by_value_is_an_error():
    assert settings.clipping_of(None, None) == 0.0
    assert settings.clipping_of(0.5, "norm") == 0.5
    with pytest.raises(ConfigError, match="gradient_clip_algorithm='value'.*use gradient_clip_algorithm='norm'"):
        settings.clipping_of(0.5, "value")


def test_the_trainer_settings_fill_the_config_and_a_contradiction_names_both():
    config = settings.with_trainer_settings(
        Config(partitioner="zero3"), precision="bf16", accumulation=4, clipping=1.0
    )
    assert (config.partitioner, config.precision, config.gradient_accumulation_steps, config.gradient_clipping) == (
        "zero3", "bf16", 4, 1.0
    )
    same = Config(gradient_accumulation_steps=4)
    assert settings.with_trainer_settings(same, precision="fp32", accumulation=4, clipping=0.0) == same
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps = 8 contradicts .*accumulate_grad_batches"):
        settings.with_trainer_settings(Config(gradient_accumulation_steps=8), precision="fp32", accumulation=4,
                                       clipping=0.0)
    with pytest.raises(ConfigError, match=r"precision = 'bf16' contradicts the Trainer's Trainer\(precision=...\)"):
        settings.with_trainer_settings(Config(precision="bf16"), precision="fp32", accumulation=1, clipping=0.0)


def test_a_deepspeed_config_leaves_clipping_to_the_trainer(tmp_path):
    deepspeed = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(deepspeed))
    for source in (deepspeed, str(path)):
        strategy = ZKernelStrategy(config=source)
        assert strategy.config.partitioner == "zero3" and strategy.config.offload.optimizer == "cpu"
        config = settings.with_trainer_settings(strategy.config, precision="fp32", accumulation=2, clipping=0.0)
        assert config.gradient_clipping == 0.0 and config.gradient_accumulation_steps == 2
    with pytest.raises(ConfigError, match=r"gradient_clipping = 0.5 contradicts"):
        settings.with_trainer_settings(ZKernelStrategy(config={**deepspeed, "gradient_clipping": 0.5}).config,
                                       precision="fp32", accumulation=1, clipping=1.0)


def test_names_are_registered_with_their_configs():
    registry = pl.strategies.StrategyRegistry
    want = {
        "zkernel": ("zero3", "none", "none"),
        "zkernel_stage_1": ("zero1", "none", "none"),
        "zkernel_stage_2": ("zero2", "none", "none"),
        "zkernel_stage_2_offload": ("zero2", "cpu", "none"),
        "zkernel_stage_3": ("zero3", "none", "none"),
        "zkernel_stage_3_offload": ("zero3", "cpu", "cpu"),
        "zkernel_stage_3_offload_nvme": ("zero3", "nvme", "nvme"),
    }
    for name, (partitioner, optimizer, params) in want.items():
        strategy = registry.get(name)
        assert isinstance(strategy, ZKernelStrategy), name
        config = strategy.config
        assert (config.partitioner, config.offload.optimizer, config.offload.params) == (partitioner, optimizer, params)
    nvme = ZKernelStrategy(config=settings.PRESETS["zkernel_stage_3_offload_nvme"][1], nvme_path="/scratch/nvme")
    assert str(nvme.config.offload.nvme_path) == "/scratch/nvme"


def test_a_bad_config_is_an_error_at_construction():
    with pytest.raises(ConfigError, match="partitioner"):
        ZKernelStrategy(config={"partitioner": "zero4"})
