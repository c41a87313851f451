"""fp16 dynamic loss scaling: DeepSpeed's scale trajectory with hysteresis, through the engine and checkpoints."""

from __future__ import annotations

import pytest
import torch

import zkernel
from tests.support.models import TrickyNet, batches
from tests.support.scenarios import fp16_overflow
from zkernel.kernel.loss_scale import DynamicLossScaler, LossScaleError

# (hysteresis, consecutive, overflows by step, scale after each step), worked out by hand from
# DeepSpeed's DynamicLossScaler.update_scale (window 3, initial scale 1024).
TRAJECTORIES = [
    (1, False, [False, True, False, True, True, False, False, False, True], [1024, 512, 512, 256, 128, 128, 128, 256, 128]),
    # The first overflow uses the allowance up; the next ones halve until the scale grows and refills it.
    (2, False, [False, True, False, True, True, False, False, False, True], [1024, 1024, 1024, 512, 256, 256, 256, 512, 512]),
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
