"""``[optimizer] param_groups`` and ``no_weight_decay``: parameters stepped as torch parameter groups would step them."""

from __future__ import annotations

import re

import pytest
import torch
from structlog.testing import capture_logs

import zkernel
from tests.harness import run_ranks
from tests.models import TrickyNet, batches, reference_losses
from tests.scenarios import train
from zkernel import hookimpl
from zkernel.config import ConfigError

STEPS, ACCUM, MICRO, SEED = 6, 2, 3, 99
LR, WD, CLIP = 2e-2, 0.5, 0.5  # a weight decay large enough to move every decayed weight visibly
# The biases by name, the LayerNorm's weight and bias by its class, the 0-dim gain by its own name.
PATTERNS = ["*.bias", "LayerNorm", "gain"]
# The embedding (tied to the head) at half the rate; the block's second layer at twice the rate with
# a weight decay of its own, its bias included: a parameter takes the first entry that names it.
PARAM_GROUPS = [{"params": ["embed.*"], "lr_scale": 0.5}, {"params": ["block.2.*"], "lr_scale": 2.0, "weight_decay": 0.05}]
# The same as torch parameter groups (names, lr scale, weight decay), before the default group.
TORCH_GROUPS = [
    ({"embed.weight"}, 0.5, WD),
    ({"block.2.weight", "block.2.bias"}, 2.0, 0.05),
    ({"block.0.bias", "frozen_proj.bias", "norm.weight", "norm.bias", "gain"}, 1.0, 0.0),
]


def _optimizer(**extra) -> dict:
    return {"lr": LR, "weight_decay": WD, "no_weight_decay": PATTERNS, "param_groups": PARAM_GROUPS, **extra}


CONFIGS = {
    "zero1": {"partitioner": "zero1", "partitioner_options": {"bucket_size": 200}},
    "zero2": {"partitioner": "zero2", "partitioner_options": {"bucket_size": 200}},
    # Units split between the ranks: a rank's shard holds exempt and decayed parameters side by side.
    "zero3": {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}},
    "zero3 tiled": {
        "partitioner": "zero3",
        "partitioner_options": {"persistence_threshold": 0},
        "tiling": {"modules": ["block.0"], "tiles": 3},
    },
    "zero3 cpu offload": {
        "partitioner": "zero3",
        "partitioner_options": {"persistence_threshold": 0},
        "offload": {"optimizer": "cpu", "params": "cpu"},
        "optimizer": _optimizer(name="cpu_adam"),
    },
}


def _config(name: str) -> dict:
    config = {"gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP, **CONFIGS[name]}
    config.setdefault("optimizer", _optimizer())
    return config


def _reference(world: int, groups=TORCH_GROUPS) -> list[float]:
    torch.manual_seed(SEED)
    return reference_losses(TrickyNet(), batches(SEED + 1, STEPS, ACCUM, world, MICRO), LR, WD, CLIP, groups=groups)


def _assert_close(losses, expected, label):
    for i, (a, b) in enumerate(zip(losses, expected, strict=True)):
        assert a == pytest.approx(b, rel=1e-5), f"{label}: step {i}"


def test_parameter_groups_train_like_torch_parameter_groups_on_two_ranks(tmp_path):
    names = [*CONFIGS, "zero2 nvme"]
    nvme = {"partitioner": "zero2", "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path)}, "optimizer": _optimizer(name="cpu_adam")}
    results = run_ranks(2, _train_many, [_config(n) for n in CONFIGS] + [{**_config("zero2"), **nvme}])
    want = _reference(2)
    one_group = _reference(2, groups=())
    assert max(abs(a - b) / b for a, b in zip(want, one_group)) > 1e-3, "the groups change training"
    for rank_results in results:
        for name, losses in zip(names, rank_results, strict=True):
            _assert_close(losses, want, name)


def _train_many(configs):
    return [train(c, STEPS, ACCUM, MICRO, SEED)["losses"] for c in configs]


def test_each_group_knows_its_parameters_hyperparameters_by_the_users_names():
    from zkernel.groups import ParamHyper

    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0},
                                              "tiling": {"modules": ["block.0"], "tiles": 3}, "optimizer": _optimizer()})  # fmt: skip
    own = {name: g.param_hyper[i] for g in engine.groups for i, name in enumerate(g.param_names) if i in g.param_hyper}
    no_decay, block2 = ParamHyper(weight_decay=0.0), ParamHyper(lr_scale=2.0, weight_decay=0.05)
    assert own == {
        "embed.weight": ParamHyper(lr_scale=0.5),
        **{f"block.0.tiles.{i}.bias": no_decay for i in range(3)},  # a tiled bias in every tile
        "block.2.weight": block2,
        "block.2.bias": block2,
        **{name: no_decay for name in ("frozen_proj.bias", "norm.weight", "norm.bias", "gain")},
    }
    engine.close()


@pytest.mark.usefixtures("zkernel_debug_logs")
def test_patterns_that_match_nothing_are_an_error_or_a_warning():
    model = TrickyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError) as info:
        zkernel.initialize(model, {"partitioner": "zero3", "optimizer": _optimizer(no_weight_decay=["*RMSNorm", "*.b"], param_groups=[])})
    assert "optimizer.param_groups and no_weight_decay patterns ['*RMSNorm', '*.b'] match no parameter" in str(info.value)
    assert "(Embedding, LayerNorm, Linear, TrickyNet)" in str(info.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the model is left as it was"
    # A recipe written for several architectures: what this model lacks is named, the rest applies.
    with capture_logs() as logs:
        engine = zkernel.initialize(model, {"optimizer": _optimizer(no_weight_decay=["*.bias", "*RMSNorm"], param_groups=[])})
    (warning,) = [e for e in logs if e["event"] == "zkernel.optimizer.patterns_unmatched"]
    assert warning["patterns"] == ["*RMSNorm"] and warning["overridden_parameters"] == 4
    engine.close()
    with pytest.raises(ConfigError, match="optimizer.no_weight_decay must be"):
        zkernel.initialize(TrickyNet(), {"optimizer": {"no_weight_decay": "bias"}})


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ({"params": ["*.bias"]}, "optimizer.param_groups must be a list of tables"),
        ([{"lr_scale": 2.0}], "optimizer.param_groups entries need params"),
        ([{"params": ["*.bias"], "lr": 0.1}], "unknown config key optimizer.param_groups.lr; valid: params, lr_scale, weight_decay"),
        ([{"params": ["*.bias"], "lr_scale": -1}], "optimizer.param_groups.lr_scale must be a number >= 0"),
        ([{"params": "*.bias"}], "optimizer.param_groups.params must be a list of strings"),
        ([{"params": []}], "optimizer.param_groups.params must name at least one pattern"),
    ],
)
def test_bad_parameter_groups_are_errors_naming_the_key(groups, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        zkernel.initialize(TrickyNet(), {"optimizer": {"param_groups": groups}})


class _PlainSGD:
    """A third-party optimizer that declares nothing, so it cannot step parameters with their own hyperparameters."""

    @hookimpl
    def zkernel_register_optimizers(self, registry):
        registry.add("plain_sgd", lambda context: self)

    @hookimpl
    def zkernel_step_optimizer(self, group, options):
        group.master.add_(group.grad, alpha=-options.lr)
        return True


def test_an_optimizer_without_per_parameter_hyperparameters_is_refused():
    config = {"optimizer": {"name": "plain_sgd", "param_groups": [{"params": ["*.bias"], "lr_scale": 0.1}]}}
    with pytest.raises(ConfigError, match="optimizer 'plain_sgd' does not declare it"):
        zkernel.initialize(TrickyNet(), config, plugins=[_PlainSGD()])
    zkernel.initialize(TrickyNet(), {"optimizer": {"name": "plain_sgd"}}, plugins=[_PlainSGD()]).close()
