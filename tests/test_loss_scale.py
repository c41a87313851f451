"""fp16 dynamic loss scaling: DeepSpeed's scale trajectory with hysteresis, through the engine and checkpoints."""

from __future__ import annotations

import pytest

from tests.scenarios import fp16_overflow
from zkernel.loss_scale import DynamicLossScaler

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
