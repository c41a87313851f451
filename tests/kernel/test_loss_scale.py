"""fp16 dynamic loss scaling: DeepSpeed's scale trajectory with hysteresis, through the engine and checkpoints."""

from __future__ import annotations

import random

import pytest
import torch

import zkernel
from tests.support.models import TrickyNet, batches
from tests.support.scenarios import fp16_overflow
from zkernel.kernel.loss_scale import DynamicLossScaler, LossScaleError

# (hysteresis, consecutive, overflows by step, scale after each step), worked out by hand from
# DeepSpeed's DynamicLossScaler.update_scale (window 3, initial scale 1024). Three clean steps after an
# overflow do not grow the scale: the fourth would ([Note: when the scale grows]).
TRAJECTORIES = [
    (1, False, [False, True, False, True, True, False, False, False, True], [1024, 512, 512, 256, 128, 128, 128, 128, 64]),
    # The first overflow uses the allowance up; the next ones halve until the scale grows and refills it.
    (2, False, [False, True, False, True, True, False, False, False, True], [1024, 1024, 1024, 512, 256, 256, 256, 256, 128]),
    (2, False, [True, False, False, False, False, True, True], [1024, 1024, 1024, 1024, 2048, 2048, 1024]),
    # A clean step refills it.
    (2, True, [True, False, True, True, False, True], [1024, 1024, 1024, 512, 512, 512]),
    (3, False, [True, True, True, True], [1024, 1024, 512, 256]),
]


@pytest.mark.parametrize(("hysteresis", "consecutive", "overflows", "scales"), TRAJECTORIES)
def test_scales_follow_deepspeeds_hysteresis(hysteresis, consecutive, overflows, scales):
    scaler = DynamicLossScaler(1024.0, 3, hysteresis=hysteresis, consecutive_hysteresis=consecutive)
    seen = []
    for overflow in overflows:
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == scales


class DeepSpeedRule:
    """DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py, 0.19.8), written
    out from its rule: iteration counters, the last overflow's iteration, hysteresis left."""

    def __init__(self, scale, window, min_scale, hysteresis, consecutive, raise_at_min):
        self.scale, self.window, self.min_scale = scale, window, min_scale
        self.delayed_shift = self.left = hysteresis
        self.consecutive, self.raise_at_min = consecutive, raise_at_min
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.left == 1:
                if self.scale == self.min_scale and self.raise_at_min:
                    raise LossScaleError("at the minimum")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive:
                self.left = self.delayed_shift
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive:
                    self.left = self.delayed_shift
                self.scale *= 2
        self.iteration += 1


def _trajectory(scaler, overflows):
    scales = []
    for overflow in overflows:
        try:
            scaler.update(overflow)
        except LossScaleError:
            scales.append("raised")
            break
        scales.append(scaler.scale)
    return scales


@pytest.mark.parametrize("window", [1, 2, 3, 5])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("raise_at_min", [False, True])
def test_scales_equal_deepspeeds_update_scale_step_for_step(window, hysteresis, consecutive, raise_at_min):
    rng = random.Random(window * 100 + hysteresis * 10 + consecutive * 2 + raise_at_min)
    sequences = [
        [False] * (4 * window + 3),  # growth only: the first at the (window + 1)-th clean step, then every window
        [True] + [False] * (3 * window + 2) + [True, True] + [False] * (2 * window + 1),
        *([rng.random() < p for _ in range(60)] for p in (0.1, 0.3, 0.6)),
        [True] * 12 + [False] * (window + 2) + [True] * 4,  # down to the minimum, and on at it
    ]
    for overflows in sequences:
        ours = DynamicLossScaler(
            64.0, window, min_scale=2.0, hysteresis=hysteresis, consecutive_hysteresis=consecutive,
            error_at_min_scale=raise_at_min,
        )
        rule = DeepSpeedRule(64.0, window, 2.0, hysteresis, consecutive, raise_at_min)
        assert _trajectory(ours, overflows) == _trajectory(rule, overflows), overflows
        # Cut anywhere, a checkpoint of the state goes on as the uncut run.
        cut = len(overflows) // 2
        first, resumed = DynamicLossScaler(64.0, window, min_scale=2.0, hysteresis=hysteresis,
                                           consecutive_hysteresis=consecutive), None
        rule = DeepSpeedRule(64.0, window, 2.0, hysteresis, consecutive, False)
        _trajectory(first, overflows[:cut])
        _trajectory(rule, overflows[:cut])
        resumed = DynamicLossScaler(1.0, window, min_scale=2.0, hysteresis=hysteresis, consecutive_hysteresis=consecutive)
        resumed.load_state_dict(first.state_dict())
        assert _trajectory(resumed, overflows[cut:]) == _trajectory(rule, overflows[cut:]), (overflows, cut)


def test_the_engine_grows_the_scale_when_deepspeed_would():
    # window 2: an overflow at step 1, then clean steps 2, 3, 4: DeepSpeed doubles at the third (step 4).
    result = fp16_overflow(0, 1, 6, {"loss_scale_window": 2})
    assert result["skipped"] == 1
    assert result["scales"] == [1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]


def test_the_allowance_left_is_kept_by_a_checkpoint():
    scaler = DynamicLossScaler(1024.0, 3, hysteresis=2)
    scaler.update(True)  # allowance used up
    resumed = DynamicLossScaler(1.0, 3, hysteresis=2)
    resumed.load_state_dict(scaler.state_dict())
    resumed.update(True)
    assert resumed.scale == 512.0, "the resumed scaler halves at once, as the saved one would"
    old = {k: v for k, v in scaler.state_dict().items() if k != "hysteresis_left"}  # a checkpoint from before
    fresh = DynamicLossScaler(1.0, 3, hysteresis=2)
    fresh.load_state_dict(old)
    fresh.update(True)
    assert fresh.scale == 1024.0


def test_an_overflow_within_the_allowance_is_skipped_without_halving_the_scale():
    result = fp16_overflow(0, 1, 4, {"loss_scale_hysteresis": 2})
    assert result["skipped"] == 1 and result["scales"] == [1024.0, 1024.0, 1024.0, 1024.0]
    assert result["checksums"][1] == result["checksums"][0], "the overflowing step changed nothing"
    assert result["checksums"][2] != result["checksums"][1]


def test_the_scale_stops_at_its_minimum_and_an_overflow_there_raises():
    scaler = DynamicLossScaler(8.0, 3, min_scale=2.0, hysteresis=2, error_at_min_scale=True)
    for expected in (8.0, 4.0, 2.0):  # the first overflow uses the allowance up
        scaler.update(True)
        assert scaler.scale == expected
    with pytest.raises(LossScaleError, match="minimum loss scale 2"):
        scaler.update(True)
    quiet = DynamicLossScaler(2.0, 3, min_scale=2.0, error_at_min_scale=False)
    quiet.update(True)
    assert quiet.scale == 2.0
    resumed = DynamicLossScaler(8.0, 3, min_scale=4.0)
    resumed.load_state_dict(quiet.state_dict())
    assert (resumed.scale, resumed.min_scale) == (4.0, 4.0), "the configured minimum holds over a checkpoint's"


def test_an_overflow_at_the_minimum_scale_stops_the_run_after_recording_the_skipped_step(tmp_path):
    torch.manual_seed(0)
    config = {"partitioner": "zero2", "precision": "fp16", "optimizer": {"lr": 1e-3}, "initial_loss_scale": 2.0}
    engine = zkernel.initialize(TrickyNet(), config)
    data = batches(11, 3, 1, 1, 2)
    tokens, targets = data[0][0][0]
    engine.backward(engine(tokens, targets))
    engine.step()
    before = [g.master.clone() for g in engine.trainable_groups]
    tokens, targets = data[1][0][0]
    engine.backward(engine(tokens, targets) * float("inf"))
    engine.step()  # the scale halves to its minimum, 1
    engine.backward(engine(tokens, targets) * float("inf"))
    with pytest.raises(LossScaleError, match="overflowed at the minimum loss scale 1"):
        engine.step()
    assert (engine.global_steps, engine.skipped_steps, engine.loss_scaler.scale) == (3, 2, 1.0)
    for group, master in zip(engine.trainable_groups, before):
        assert torch.equal(group.master, master), "an overflowing step changed nothing"
    engine.save_checkpoint(tmp_path / "ckpt")  # the engine is whole: it saves and trains on
    tokens, targets = data[2][0][0]
    engine.backward(engine(tokens, targets))
    engine.step()
    assert engine.skipped_steps == 2 and engine.global_steps == 4
    engine.close()

    quiet = zkernel.initialize(TrickyNet(), {**config, "initial_loss_scale": 1.0, "loss_scale_error_at_min": False})
    tokens, targets = data[1][0][0]
    quiet.backward(quiet(tokens, targets) * float("inf"))
    quiet.step()
    assert quiet.skipped_steps == 1 and quiet.loss_scaler.scale == 1.0
    quiet.close()
