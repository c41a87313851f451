"""``[optimizer] param_groups`` and ``no_weight_decay``: parameters stepped as torch parameter groups would step them."""

from __future__ import annotations

import re

import pytest
import torch
from structlog.testing import capture_logs

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses
from tests.support.scenarios import _train_steps
from zkernel.spec import hookimpl
from zkernel.spec.config import ConfigError

STEPS, ACCUM, MICRO, SEED = 6, 2, 3, 99
LR, WD, CLIP = 2e-2, 0.5, 0.5  # a weight decay large enough to move every decayed weight visibly
# The biases by name, the LayerNorm's weight and bias by its class, the 0-dim gain by its own name.
PATTERNS = ["*.bias", "LayerNorm", "gain"]
# The embedding (tied to the head) at half the rate; the block's second layer at twice the rate with
# a weight decay of its own, its bias included: a parameter takes the first entry that names it. The
# block's first weight (tiled in "zero3 tiled") with betas of its own and nothing else; the LayerNorm
# (before no_weight_decay names it) with an epsilon of its own, so it differs from the exempt
# frozen_proj.bias beside it in a shard by that alone. Both far from the step's, to move training.
OWN_BETAS, OWN_EPS = (0.5, 0.9), 1e-2
PARAM_GROUPS = [
    {"params": ["embed.*"], "lr_scale": 0.5},
    {"params": ["block.2.*"], "lr_scale": 2.0, "weight_decay": 0.05},
    {"params": ["block.0.weight"], "betas": list(OWN_BETAS)},
    {"params": ["LayerNorm"], "weight_decay": 0.0, "eps": OWN_EPS},
]
# The same as torch parameter groups (names, lr scale, weight decay, other keys), before the default group.
TORCH_GROUPS = [
    ({"embed.weight"}, 0.5, WD),
    ({"block.2.weight", "block.2.bias"}, 2.0, 0.05),
    ({"block.0.weight"}, 1.0, WD, {"betas": OWN_BETAS}),
    ({"norm.weight", "norm.bias"}, 1.0, 0.0, {"eps": OWN_EPS}),
    ({"block.0.bias", "frozen_proj.bias", "gain"}, 1.0, 0.0),
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
    # Host steps started during backward and rolled back when clipping applies: the native rollback
    # (cpu_adam) and torch's (adamw on the host) undo each run with its own hyperparameters.
    "zero2 cpu offload speculative": {
        "partitioner": "zero2",
        "partitioner_options": {"bucket_size": 200},
        "offload": {"optimizer": "cpu", "optimizer_options": {"speculate": "always"}},
        "optimizer": _optimizer(name="cpu_adam"),
    },
    "zero2 cpu offload speculative adamw": {
        "partitioner": "zero2",
        "partitioner_options": {"bucket_size": 200},
        "offload": {"optimizer": "cpu", "optimizer_options": {"speculate": "always"}},
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


def _without(key: str) -> list:
    """`TORCH_GROUPS` with no group setting its own ``key`` (``betas``, ``eps``): the step's instead."""
    return [(*g[:3], {k: v for k, v in g[3].items() if k != key}) if len(g) > 3 else g for g in TORCH_GROUPS]


def _differs(losses, expected) -> bool:
    return max(abs(a - b) / b for a, b in zip(losses, expected)) > 1e-3


def test_parameter_groups_train_like_torch_parameter_groups_on_two_ranks(tmp_path):
    names = [*CONFIGS, "zero2 nvme"]
    nvme = {"partitioner": "zero2", "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path)}, "optimizer": _optimizer(name="cpu_adam")}
    results = run_ranks(2, _train_many, [_config(n) for n in CONFIGS] + [{**_config("zero2"), **nvme}])
    want = _reference(2)
    assert _differs(want, _reference(2, groups=())), "the groups change training"
    # Stepping a group with the step's betas or eps instead of its own would fail the comparison below.
    assert _differs(want, _reference(2, groups=_without("betas"))), "the group's own betas change training"
    assert _differs(want, _reference(2, groups=_without("eps"))), "the group's own eps changes training"
    for rank_results in results:
        for name, (losses, rollbacks) in zip(names, rank_results, strict=True):
            _assert_close(losses, want, name)
            assert rollbacks > 0 or "speculative" not in name, f"{name}: rolled back no step"


def _train_many(configs):
    return [_train(c) for c in configs]


def _train(config: dict) -> tuple[list[float], int]:
    """This rank's share of training: the global mean losses, and how many steps it rolled back."""
    torch.manual_seed(SEED)
    engine = zkernel.initialize(TrickyNet(), config)
    losses = _train_steps(engine, STEPS, ACCUM, MICRO, SEED)
    rollbacks = engine.pipeline.rollbacks
    engine.close()
    return losses, rollbacks


def test_each_group_knows_its_parameters_hyperparameters_by_the_users_names():
    from zkernel.spec.groups import ParamHyper

    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0},
                                              "tiling": {"modules": ["block.0"], "tiles": 3}, "optimizer": _optimizer()})  # fmt: skip
    own = {name: g.param_hyper[i] for g in engine.groups for i, name in enumerate(g.param_names) if i in g.param_hyper}
    no_decay, block2 = ParamHyper(weight_decay=0.0), ParamHyper(lr_scale=2.0, weight_decay=0.05)
    norm = ParamHyper(weight_decay=0.0, eps=OWN_EPS)
    assert own == {
        "embed.weight": ParamHyper(lr_scale=0.5),
        **{f"block.0.tiles.{i}.weight": ParamHyper(betas=OWN_BETAS) for i in range(3)},  # in every tile
        **{f"block.0.tiles.{i}.bias": no_decay for i in range(3)},  # a tiled bias in every tile
        "block.2.weight": block2,
        "block.2.bias": block2,
        "norm.weight": norm,
        "norm.bias": norm,
        **{name: no_decay for name in ("frozen_proj.bias", "gain")},
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
        ([{"params": ["*.bias"], "lr": 0.1}], "unknown config key optimizer.param_groups.lr; valid: params, lr_scale, weight_decay, betas, eps"),
        ([{"params": ["*.bias"], "lr_scale": -1}], "optimizer.param_groups.lr_scale must be a number >= 0"),
        ([{"params": ["*.bias"], "betas": [0.9, 1.0]}], "optimizer.param_groups.betas must be two numbers in [0, 1), got [0.9, 1.0]"),
        ([{"params": ["*.bias"], "betas": 0.9}], "optimizer.param_groups.betas must be two numbers in [0, 1), got 0.9"),
        ([{"params": ["*.bias"], "betas": [0.9, True]}], "optimizer.param_groups.betas must be two numbers in [0, 1)"),
        ([{"params": ["*.bias"], "eps": -1e-8}], "optimizer.param_groups.eps must be a number >= 0, got -1e-08"),
        ([{"params": ["*.bias"], "eps": "1e-8"}], "optimizer.param_groups.eps must be a number >= 0, got '1e-8'"),
        ([{"params": ["*.bias"], "eps": float("inf")}], "optimizer.param_groups.eps must be finite"),
        ([{"params": "*.bias"}], "optimizer.param_groups.params must be a list of strings"),
        ([{"params": []}], "optimizer.param_groups.params must name at least one pattern"),
    ],
)
def test_bad_parameter_groups_are_errors_naming_the_key(groups, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        zkernel.initialize(TrickyNet(), {"optimizer": {"param_groups": groups}})


ONE_CYCLE = {"name": "one_cycle", "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2}


def test_group_betas_with_one_cycles_momentum_are_an_error_naming_both_keys():
    """one_cycle with cycle_momentum sets every parameter's betas each step: a group's own would be lost."""
    model = TrickyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = [{"params": ["embed.*"], "lr_scale": 0.5}, {"params": ["block.0.weight"], "betas": [0.5, 0.9]}]
    with pytest.raises(ConfigError) as info:
        zkernel.initialize(model, {"optimizer": {"param_groups": groups}, "lr_schedule": ONE_CYCLE})
    message = str(info.value)
    assert "lr_schedule one_cycle with cycle_momentum = true" in message
    assert "optimizer.param_groups entry params = ['block.0.weight'] sets its own betas = [0.5, 0.9]" in message
    assert "set lr_schedule.cycle_momentum = false to keep the group's betas, or drop betas from the entry" in message
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the model is left as it was"
    # Either fix is accepted, and a group's own eps never conflicts.
    fixed = {"optimizer": {"param_groups": groups}, "lr_schedule": {**ONE_CYCLE, "cycle_momentum": False}}
    zkernel.initialize(model, fixed).close()
    eps_only = [{"params": ["block.0.weight"], "eps": 1e-2}]
    zkernel.initialize(model, {"optimizer": {"param_groups": eps_only}, "lr_schedule": ONE_CYCLE}).close()


def _shard(hypers: dict, sizes: list[int]):
    """A group of len(sizes) parameters laid out back to back in one shard, with ``hypers`` by position."""
    from zkernel.spec.groups import Fragment, ParamGroup, ShardLayout

    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    frags = tuple(Fragment(param=i, start=0, numel=n, offset=o) for i, (n, o) in enumerate(zip(sizes, offsets)))
    return ParamGroup(index=0, name="g", params=tuple(torch.nn.Parameter(torch.zeros(n)) for n in sizes),
                      param_names=tuple(f"p{i}" for i in range(len(sizes))), requires_grad=True,
                      master=torch.zeros(sum(sizes)), shard_layout=ShardLayout(numel=sum(sizes), fragments=frags),
                      param_hyper=hypers)  # fmt: skip


def test_runs_split_where_betas_or_eps_differ_and_step_with_their_own():
    from zkernel.spec.groups import ParamHyper, StepOptions
    from zkernel_plugins.optimizers._adam_state import kernel_arguments, rollback_possible, step_runs

    options = StepOptions(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    betas, eps = ParamHyper(betas=(0.5, 0.9)), ParamHyper(eps=1e-2)
    group = _shard({1: betas, 2: betas, 3: eps}, [4, 3, 5, 2, 6])
    runs = step_runs(group, [0] * 5, frozenset())
    assert [(r.start, r.stop, r.hyper) for r in runs] == [(0, 4, None), (4, 12, betas), (12, 14, eps), (14, 20, None)]
    kwargs = [kernel_arguments(r, options, decoupled=True) for r in runs]
    assert [(k["betas"], k["eps"], k["lr"], k["weight_decay"]) for k in kwargs] == [
        ((0.9, 0.999), 1e-8, 0.1, 0.01),
        ((0.5, 0.9), 1e-8, 0.1, 0.01),
        ((0.9, 0.999), 1e-2, 0.1, 0.01),
        ((0.9, 0.999), 1e-8, 0.1, 0.01),
    ]
    # A parameter's own beta1 of 0 overwrites its exp_avg: its group's step cannot be undone.
    assert rollback_possible(group, options, decoupled=True)
    assert not rollback_possible(_shard({1: ParamHyper(betas=(0.0, 0.9))}, [4, 3]), options, decoupled=True)


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
