"""Learning-rate schedules: DeepSpeed's five, step for step, through training, skips and checkpoints.

The expected rates are worked out by hand from DeepSpeed's definitions
(`deepspeed.runtime.lr_schedules`), position by position: the step after ``n``
applied steps uses position ``n - 1`` ([Note: DeepSpeed's iteration]).
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses
from tests.support.scenarios import _train_steps
from zkernel.spec import hookimpl
from zkernel.spec.config import ConfigError
from zkernel.spec.lr_schedule import LRSchedule

BETAS = (0.9, 0.999)
COS_PI_4 = (1 + math.cos(math.pi / 4)) / 2  # 0.8536
COS_3PI_4 = (1 + math.cos(3 * math.pi / 4)) / 2  # 0.1464

# name -> (optimizer lr, lr_schedule section, [(lr, betas) of step 1, 2, ...]).
CASES = {
    "warmup linear": (
        1.1,
        {"name": "warmup", "warmup_min_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"},
        [(lr, BETAS) for lr in (0.1, 0.1, 0.35, 0.6, 0.85, 1.1, 1.1)],
    ),
    "warmup log": (
        1.0,
        {"name": "warmup", "warmup_num_steps": 4},
        [(lr, BETAS) for lr in (0.0, 0.0, 0.5, math.log(3) / math.log(4), 1.0, 1.0)],
    ),
    "warmup_decay": (
        1.0,
        {"name": "warmup_decay", "warmup_num_steps": 2, "warmup_type": "linear", "total_num_steps": 6},
        [(lr, BETAS) for lr in (0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0)],
    ),
    "warmup_cosine": (
        2.0,
        {
            "name": "warmup_cosine",
            "warmup_num_steps": 2,
            "warmup_type": "linear",
            "warmup_min_ratio": 0.5,
            "cos_min_ratio": 0.0,
            "total_num_steps": 6,
        },
        [(2.0 * r, BETAS) for r in (0.0, 0.5, 0.75, COS_PI_4, 0.5, COS_3PI_4, 0.0)],
    ),
    "one_cycle": (
        1.0,
        {
            "name": "one_cycle",
            "cycle_min_lr": 0.1,
            "cycle_max_lr": 0.5,
            "cycle_first_step_size": 2,
            "decay_step_size": 2,
            "decay_lr_rate": 1.0,
        },
        [
            (0.1, (0.8, 0.99)),  # position -1: what DeepSpeed's constructor sets
            (0.3, (0.85, 0.99)),
            (0.5, (0.8, 0.99)),  # the peak: highest rate, lowest beta1
            (0.3, (0.85, 0.99)),
            (0.1, (0.9, 0.99)),
            (0.1 / 1.5, (0.9, 0.99)),  # half a decay interval after the cycle
            (0.1 / 2.0, (0.9, 0.99)),
        ],
    ),
    "lr_range_test": (
        1.0,
        {"name": "lr_range_test", "lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2},
        [(lr, BETAS) for lr in (0.01, 0.01, 0.015, 0.02, 0.025)],
    ),
    "lr_range_test staircase": (
        1.0,
        {"name": "lr_range_test", "lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2, "lr_range_test_staircase": True},
        [(lr, BETAS) for lr in (0.01, 0.01, 0.01, 0.02, 0.02)],
    ),
}


def _config(case: str, scale: float = 1.0, **extra) -> dict:
    """The case's config, every rate in it times ``scale`` (each schedule's rates are linear in them)."""
    lr, schedule, _ = CASES[case]
    schedule = {k: v * scale if k.endswith("_lr") else v for k, v in schedule.items()}
    return {"optimizer": {"lr": lr * scale}, "lr_schedule": schedule, **extra}


def _assert_hyper(seen, expected, label):
    assert len(seen) == len(expected)
    for i, ((lr, betas), (want_lr, want_betas)) in enumerate(zip(seen, expected)):
        assert lr == pytest.approx(want_lr, rel=1e-12, abs=1e-15), f"{label}: step {i + 1} lr"
        assert tuple(betas) == pytest.approx(want_betas, rel=1e-12), f"{label}: step {i + 1} betas"


def _run(engine, steps, seed=5, poison_step=None):
    """Train ``steps`` steps on one rank; the hyperparameters each step used."""
    seen = []
    for i, step in enumerate(batches(seed, steps, 1, 1, 2)):
        seen.append((engine.lr, engine.pipeline.hyper.betas))
        tokens, targets = step[0][0]
        loss = engine(tokens, targets)
        engine.backward(loss * float("inf") if i == poison_step else loss)
        engine.step()
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_rates_are_deepspeeds_step_for_step(case):
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), _config(case))
    _assert_hyper(_run(engine, len(CASES[case][2])), CASES[case][2], case)
    engine.close()


def _scheduled_training(config: dict, steps: int) -> dict:
    torch.manual_seed(7)
    engine = zkernel.initialize(TrickyNet(), config)
    losses = _train_steps(engine, steps, 2, 2, 7)
    return {"losses": losses, "early_steps": engine.pipeline.early_steps, "rollbacks": engine.pipeline.rollbacks}


@pytest.mark.parametrize(
    ("case", "placement"),
    [
        ("warmup_cosine", {"partitioner": "zero2", "gradient_clipping": 0.5}),
        # Host steps start during backward, with the hyperparameters set after the step before (a
        # group whose own gradient would be clipped waits for the end of backward: no clipping here).
        (
            "one_cycle",
            {
                "partitioner": "zero3",
                "gradient_clipping": 1e6,
                "offload": {"optimizer": "cpu", "params": "cpu", "optimizer_options": {"speculate": "always"}},
                "optimizer": {"name": "cpu_adam"},
            },
        ),
    ],
)
def test_scheduled_training_matches_torch_on_two_ranks(case, placement):
    scale = 0.02  # rates of 1e-3 to 1e-2, where rounding differences do not grow into the losses
    lr, _, expected = CASES[case]
    expected = [(rate * scale, betas) for rate, betas in expected]
    config = _config(case, scale, gradient_accumulation_steps=2, **placement)
    config["optimizer"] = {**config["optimizer"], **placement.get("optimizer", {}), "weight_decay": 0.1}
    results = run_ranks(2, _scheduled_training, config, len(expected))
    torch.manual_seed(7)
    want = reference_losses(
        TrickyNet(), batches(8, len(expected), 2, 2, 2), lr * scale, 0.1, placement["gradient_clipping"], schedule=expected
    )
    for result in results:
        for i, (a, b) in enumerate(zip(result["losses"], want)):
            assert a == pytest.approx(b, rel=1e-5), f"{case}: step {i}"
    assert want[-1] < want[0]
    if "offload" in placement:
        assert results[0]["early_steps"] > 0, "the host tier stepped groups during backward"


def test_a_skipped_step_does_not_advance_the_schedule():
    torch.manual_seed(0)
    config = _config("warmup linear", precision="fp16", initial_loss_scale=1024.0)
    engine = zkernel.initialize(TrickyNet(), config)
    seen = _run(engine, 6, poison_step=2)
    assert engine.skipped_steps == 1
    lrs = [lr for lr, _ in CASES["warmup linear"][2]]
    _assert_hyper(seen, [(lr, BETAS) for lr in lrs[:3] + lrs[2:5]], "fp16 overflow at step 3")


def test_a_resumed_run_continues_the_schedule(tmp_path):
    torch.manual_seed(0)
    steps = len(CASES["warmup_decay"][2])
    engine = zkernel.initialize(TrickyNet(), _config("warmup_decay", partitioner="zero2"))
    _run(engine, 3)
    engine.lr = 123.0  # a rate the loop set by hand is not what resumes a schedule
    engine.save_checkpoint(tmp_path)
    engine.close()
    torch.manual_seed(1)
    resumed = zkernel.initialize(TrickyNet(), _config("warmup_decay", partitioner="zero3"))
    assert resumed.lr == 0.0
    resumed.load_checkpoint(tmp_path)
    _assert_hyper(_run(resumed, steps - 3), CASES["warmup_decay"][2][3:], "resumed at step 4")
    resumed.close()


def test_without_a_schedule_the_loop_sets_the_rate():
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), {"optimizer": {"lr": 0.01}})
    _run(engine, 1)
    engine.lr = 0.02
    _run(engine, 2)
    assert engine.lr == 0.02


class _Halving(LRSchedule):
    def __init__(self, context) -> None:
        self.every = context.options.every if context.options is not None else 1

    def hyper(self, applied_steps, base):
        return attrs.evolve(base, lr=base.lr * 0.5 ** (applied_steps // self.every))


@attrs.frozen(kw_only=True)
class _HalvingOptions:
    every: int = 1


class _HalvingPlugin:
    @hookimpl
    def zkernel_register_lr_schedules(self, registry):
        registry.add("halving", _Halving, options_cls=_HalvingOptions)


def test_a_third_party_schedule_plugs_in_by_name():
    torch.manual_seed(0)
    config = {"optimizer": {"lr": 0.8}, "lr_schedule": {"name": "halving", "every": 2}}
    engine = zkernel.initialize(TrickyNet(), config, plugins=[_HalvingPlugin()])
    _assert_hyper(_run(engine, 5), [(lr, BETAS) for lr in (0.8, 0.8, 0.4, 0.4, 0.2)], "halving")


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ({"name": "cosine"}, "lr_schedule.name 'cosine' is not installed; installed: lr_range_test, none, one_cycle, warmup"),
        ({"name": "warmup", "warmup_steps": 10}, "unknown config key lr_schedule.warmup_steps; valid: name, warmup_min_lr"),
        ({"name": "warmup", "warmup_type": "cosine"}, "lr_schedule.warmup_type 'cosine' is not valid; valid: log, linear"),
        ({"name": "warmup", "warmup_num_steps": -1}, "lr_schedule.warmup_num_steps -1 is not valid; valid: an integer >= 0"),
        ({"name": "warmup_decay"}, "warmup_decay needs total_num_steps"),
        ({"name": "warmup_cosine", "total_num_steps": 2, "warmup_num_steps": 0}, "leaves the cosine no steps"),
        ({"name": "one_cycle", "cycle_max_lr": 0.1}, "one_cycle needs cycle_min_lr"),
        ({"name": "one_cycle", "cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_max_mom": 1.0}, "cycle_max_mom 1.0 is Adam's beta1"),
        ({"name": "none", "warmup_num_steps": 10}, "unknown config key lr_schedule.warmup_num_steps; valid: name (the selected"),
    ],
)
def test_bad_schedules_are_errors_naming_the_key(schedule, message):
    with pytest.raises(ConfigError) as info:
        zkernel.initialize(TrickyNet(), {"lr_schedule": schedule})
    assert message in str(info.value)
