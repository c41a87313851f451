"""Bad config is a clear error naming the key and what is valid."""

from __future__ import annotations

import json

import pytest
import torch

import zkernel
from zkernel.spec.config import Config, ConfigError
from zkernel.kernel.config_source import load_config


def tiny():
    return torch.nn.Linear(3, 2)


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        ({"partitioner": "zero4"}, ["partitioner 'zero4' is not installed", "installed: none, zero1, zero2, zero3"]),
        ({"optimizer": {"name": "lamb"}}, ["optimizer.name 'lamb' is not installed", "adamw", "cpu_adam"]),
        ({"offload": {"optimizer": "tape"}}, ["offload.optimizer 'tape' is not installed", "installed: cpu, none"]),
        ({"partitionr": "zero1"}, ["unknown config key 'partitionr'", "partitioner", "precision"]),
        ({"optimizer": {"lrr": 1.0}}, ["optimizer.lrr", "lr, betas, eps, weight_decay", "implementation", "decoupled_weight_decay"]),
        ({"partitioner": "zero1", "partitioner_options": {"bucket": 3}}, ["partitioner_options.bucket", "bucket_size"]),
        ({"precision": "fp8"}, ["precision 'fp8' is not valid", "fp32, bf16, fp16"]),
        ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps must be an integer >= 1"]),
        ({"gradient_accumulation_steps": "2"}, ["gradient_accumulation_steps must be an integer >= 1"]),
        ({"gradient_clipping": -1}, ["gradient_clipping must be a number >= 0"]),
        ({"optimizer": {"betas": [0.9]}}, ["optimizer.betas must be two numbers in [0, 1)"]),
        ({"optimizer": {"lr": "fast"}}, ["optimizer.lr must be a number >= 0"]),
        ({"optimizer": "adamw"}, ["optimizer must be a table"]),
        ({"offload": {"params": "cpu"}}, ["offload.params 'cpu' needs partitioner 'zero3'"]),
        ({"partitioner": "zero3", "offload": {"optimizer": "nvme"}}, ["offload.nvme_path is required"]),
        ({"plugins": "mypkg"}, ["plugins must be a list of strings"]),
        ({"timeline": "yes"}, ["timeline must be true or false, got 'yes'"]),
        ({"planner": {"tiled_loss": 1}}, ["planner.tiled_loss must be true or false, got 1"]),
        ({"plugins": ["no_such_module_zk"]}, ["plugin 'no_such_module_zk' from config key `plugins` cannot be imported"]),
    ],
)
def test_bad_config_names_key_and_valid_choices(raw, fragments):
    with pytest.raises(ConfigError) as info:
        zkernel.initialize(tiny(), raw)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


def test_config_from_json_and_toml(tmp_path):
    raw = {"partitioner": "zero2", "precision": "bf16", "optimizer": {"lr": 0.5, "betas": [0.8, 0.9]}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    (tmp_path / "c.toml").write_text(
        'partitioner = "zero2"\nprecision = "bf16"\n[optimizer]\nlr = 0.5\nbetas = [0.8, 0.9]\n'
    )
    from_json = load_config(tmp_path / "c.json")
    from_toml = load_config(str(tmp_path / "c.toml"))
    assert from_json == from_toml
    assert from_json.optimizer.betas == (0.8, 0.9)
    assert load_config(from_json) is from_json
    with pytest.raises(ConfigError, match="must end in .json or .toml"):
        load_config(_write(tmp_path / "c.yaml"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def _write(path):
    path.write_text("x")
    return path


def test_config_object_is_accepted_and_frozen():
    cfg = Config(partitioner="zero1")
    engine = zkernel.initialize(tiny(), cfg)
    assert engine.config is cfg
    with pytest.raises(AttributeError):
        cfg.partitioner = "zero2"


def test_non_scalar_loss_is_rejected():
    engine = zkernel.initialize(tiny(), {})
    out = engine(torch.randn(4, 3))
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(out)
