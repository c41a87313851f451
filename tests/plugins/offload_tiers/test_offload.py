"""Optimizer offload (tier ``cpu``) for every partitioner and both Adams, against single-process torch."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.scenarios import train, train_many
from tests.plugins.partitioners.test_partitioners import ACCUM, MICRO, SEED, STEPS, assert_matches, config, reference

STAGES = ("zero1", "zero2", "zero3")
OPTIMIZERS = ("cpu_adam", "adamw")


def offload_config(stage: str, optimizer: str, tier: str = "cpu", **tier_options) -> dict:
    cfg = config(stage)
    cfg["optimizer"] = {**cfg["optimizer"], "name": optimizer}
    cfg["offload"] = {"optimizer": tier, "optimizer_options": tier_options}
    return cfg


@pytest.mark.parametrize("stage", ("none", *STAGES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_cpu_tier_single_process_matches_torch(stage, optimizer):
    result = train(offload_config(stage, optimizer), STEPS, ACCUM, MICRO, SEED)
    assert_matches(result["losses"], reference(1), f"{stage} {optimizer} cpu offload, world 1")
    memory = result["memory"]
    assert set(memory["master_weights"]) == {"cpu"} and set(memory["optimizer_state"]) == {"cpu"}


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_tier_multi_rank_matches_torch(world):
    # Both Adams on 2 ranks; on 3 (uneven shards) the native one, whose host path differs most.
    configs = [offload_config(s, o) for s in STAGES for o in (OPTIMIZERS if world == 2 else ("cpu_adam",))]
    results = run_ranks(world, train_many, configs, STEPS, ACCUM, MICRO, SEED)
    expected = reference(world)
    for rank_results in results:
        for cfg, result in zip(configs, rank_results):
            assert_matches(result["losses"], expected, f"{cfg['partitioner']} {cfg['optimizer']['name']} world {world}")


def params_offload_config(optimizer_tier: str, optimizer: str, params_tier: str = "cpu", **extra) -> dict:
    cfg = offload_config("zero3", optimizer, optimizer_tier)
    cfg["offload"]["params"] = params_tier
    cfg["offload"].update(extra)
    return cfg


PARAM_COMBOS = (("none", "adamw"), ("cpu", "cpu_adam"), ("cpu", "adamw"))


@pytest.mark.parametrize(("optimizer_tier", "optimizer"), PARAM_COMBOS)
def test_params_on_host_single_process_matches_torch(optimizer_tier, optimizer):
    result = train(params_offload_config(optimizer_tier, optimizer), STEPS, ACCUM, MICRO, SEED)
    assert_matches(result["losses"], reference(1), f"params cpu, optimizer {optimizer_tier}/{optimizer}, world 1")


def test_params_on_host_multi_rank_matches_torch():
    for world in (2, 3):
        # Every combination on 2 ranks; uneven shards on 3 with both roles on the host.
        configs = [params_offload_config(t, o) for t, o in (PARAM_COMBOS if world == 2 else PARAM_COMBOS[1:2])]
        results = run_ranks(world, train_many, configs, STEPS, ACCUM, MICRO, SEED)
        for rank_results in results:
            for cfg, result in zip(configs, rank_results):
                tier, opt = cfg["offload"]["optimizer"], cfg["optimizer"]["name"]
                assert_matches(result["losses"], reference(world), f"params cpu, {tier}/{opt}, world {world}")


SPECULATION_CASES = {
    # clipping never fires: from the second step every host step starts during backward and stands
    "never_clips": ({"gradient_clipping": 1e6}, "auto"),
    # clipping fires every step: speculative steps are skipped per group, or rolled back and redone
    "always_clips": ({}, "always"),
    # no clipping at all: the coefficient is known up front, every step starts during backward
    "no_clipping": ({"gradient_clipping": 0.0}, "never"),
}


def _speculation_config(stage: str, optimizer: str, case: str) -> dict:
    overrides, policy = SPECULATION_CASES[case]
    cfg = offload_config(stage, optimizer, speculate=policy)
    cfg.update(overrides)
    return cfg


def _reference_for(case: str, world: int) -> list[float]:
    import torch

    from tests.support.models import TrickyNet, batches, reference_losses
    from tests.plugins.partitioners.test_partitioners import CLIP, LR, WD

    overrides, _ = SPECULATION_CASES[case]
    torch.manual_seed(SEED)
    clip = overrides.get("gradient_clipping", CLIP)
    return reference_losses(TrickyNet(), batches(SEED + 1, STEPS, ACCUM, world, MICRO), LR, WD, clip)


@pytest.mark.parametrize("case", SPECULATION_CASES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_early_and_speculative_host_steps_match_torch(case, optimizer):
    from tests.support.scenarios import train_with_pipeline_stats

    result = train_with_pipeline_stats(_speculation_config("zero3", optimizer, case), STEPS, ACCUM, MICRO, SEED)
    assert_matches(result["losses"], _reference_for(case, 1), f"{case} {optimizer}")
    # Every host group's window ended, also where the step taken during backward was not taken.
    assert result["windows_left_open"] == [0] * STEPS, case
    if case == "never_clips":
        assert result["early_steps"] >= (STEPS - 1) * result["groups"] and result["rollbacks"] == 0
    elif case == "no_clipping":
        assert result["early_steps"] == STEPS * result["groups"]
    else:
        assert result["rollbacks"] + result["aborted"] > 0


def test_speculative_steps_on_two_ranks_match_torch():
    configs = [_speculation_config(s, "cpu_adam", c) for s in ("zero2", "zero3") for c in ("never_clips", "always_clips")]
    results = run_ranks(2, train_many, configs, STEPS, ACCUM, MICRO, SEED)
    for rank_results in results:
        for cfg, result in zip(configs, rank_results):
            case = "never_clips" if cfg["gradient_clipping"] == 1e6 else "always_clips"
            assert_matches(result["losses"], _reference_for(case, 2), f"{cfg['partitioner']} {case} world 2")


def test_fp16_overflow_on_one_rank_rolls_back_speculative_steps_everywhere():
    from tests.support.scenarios import fp16_overflow

    extra = {"optimizer": {"name": "cpu_adam", "lr": 1e-3}, "partitioner_options": {"bucket_size": 300},
             "offload": {"optimizer": "cpu", "optimizer_options": {"speculate": "always"}}}
    results = run_ranks(2, fp16_overflow, 1, 2, 4, extra, "embed")
    for r in results:
        assert r["skipped"] == 1 and r["scales"] == [1024.0, 1024.0, 512.0, 512.0]
        # Rank 0's groups stepped during backward before the overflow on rank 1 was known: rolled back.
        assert r["checksums"][2] == pytest.approx(r["checksums"][1], rel=1e-6, abs=1e-6)
        assert r["checksums"][3] != r["checksums"][2]
    assert results[0]["rollbacks"] > 0


def test_a_step_that_cannot_be_undone_is_not_taken_speculatively():
    """A parameter group whose AdamW decay zeroes its weights (rate x decay == 1) cannot be rolled back:
    its groups wait for the coefficient while the others step during backward, and an overflow that
    rolls those back still skips the step cleanly (it raised inside the rollback before)."""
    from tests.support.scenarios import fp16_overflow

    groups = [{"params": ["block.2.*"], "lr_scale": 2.0, "weight_decay": 4.0}]  # 0.125 x 2 x 4 == 1
    extra = {"optimizer": {"name": "cpu_adam", "lr": 0.125, "param_groups": groups}, "partitioner_options": {"bucket_size": 300},
             "offload": {"optimizer": "cpu", "optimizer_options": {"speculate": "always"}}}  # fmt: skip
    r = fp16_overflow(0, 2, 4, extra, "embed")
    assert r["skipped"] == 1 and r["rollbacks"] > 0 and r["early_steps"] > 0
    assert r["checksums"][2] == pytest.approx(r["checksums"][1], rel=1e-6, abs=1e-6)


def test_capacity_shortfall_is_one_error_with_the_numbers(monkeypatch):
    import zkernel
    from tests.support.scenarios import Wide

    monkeypatch.setenv("ZKERNEL_HOST_MEMORY", "64KiB")
    model = Wide(64, 4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(zkernel.ConfigError, match=r"host memory: needs [0-9.]+ [KM]iB \([0-9.]+ [KM]iB per rank\), 57.60 KiB usable") as caught:
        zkernel.initialize(model, offload_config("zero2", "cpu_adam"))
    assert "offload.optimizer = 'nvme'" in str(caught.value)
    # Nothing was placed: the module is whole and free for another engine.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.setenv("ZKERNEL_HOST_MEMORY", "1GiB")
    zkernel.initialize(model, offload_config("zero2", "cpu_adam")).close()


def test_host_memory_override_must_be_a_size(monkeypatch):
    import zkernel
    from tests.support.scenarios import Wide

    monkeypatch.setenv("ZKERNEL_HOST_MEMORY", "plenty")
    with pytest.raises(zkernel.ConfigError, match="ZKERNEL_HOST_MEMORY: 'plenty' is not a size; valid: a number"):
        zkernel.initialize(Wide(8, 1), offload_config("zero1", "cpu_adam"))


@pytest.mark.parametrize("numel", [7, 1 << 20, 3 * (1 << 20) + 5])
def test_bf16_gradients_add_into_fp32_landing_exactly(numel):
    """A later micro-batch's bf16 gradient is widened piece by piece: the same bits as torch's mixed add."""
    from zkernel_plugins.offload_tiers._host_grad import _widening_add

    gen = torch.Generator().manual_seed(numel)
    landing = torch.randn(numel, generator=gen)
    staging = torch.randn(numel, generator=gen).to(torch.bfloat16)
    expected = landing.clone().add_(staging)
    _widening_add(landing, staging)
    assert torch.equal(landing, expected)


@pytest.mark.parametrize("numel", [0, 7, 3 * (1 << 20) + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_squared_norm_is_accurate(numel, dtype):
    """The host's squared norm of a landed gradient (the clip coefficient of accumulated windows)
    agrees with a float64 sum to fp32 rounding, where ``linalg.vector_norm`` was 1% low."""
    from zkernel_plugins.offload_tiers._host_grad import sq_norm

    gen = torch.Generator().manual_seed(numel)
    grad = torch.randn(numel, generator=gen).to(dtype)
    expected = float(grad.double().pow(2).sum())
    assert sq_norm(grad) == pytest.approx(expected, rel=1e-6, abs=0.0)


def test_device_tier_waits_for_the_last_reduction_where_its_gradient_is_read():
    """[Note: the last landing]: the device tier completes landings one behind the newest during
    backward, but leaves the last one's reduction to be waited for by whoever first reads the
    gradient (the global norm or the group's step), not by the end of backward; a reduction whose
    inputs must stay alive, or one added into an earlier gradient, is still waited for at once."""
    from zkernel.spec.groups import ParamGroup, ReducedGradient
    from zkernel_plugins.offload_tiers.device import DeviceOptimizerTier

    class Reduction:  # the interface of a collective's handle the tier uses
        def __init__(self) -> None:
            self.waited = False

        def wait(self) -> None:
            self.waited = True

    class Context:
        compute_dtype = torch.float32

    def group(index):
        return ParamGroup(index=index, name=f"g{index}", params=(), param_names=(), requires_grad=True, master=torch.zeros(3))

    tier = DeviceOptimizerTier(Context())
    first, last, kept = group(0), group(1), group(2)
    reductions = [Reduction() for _ in range(4)]
    tier.land(first, ReducedGradient(torch.ones(3), reductions[0], accumulate=False), final=True)
    tier.land(last, ReducedGradient(torch.ones(3), reductions[1], accumulate=False), final=True)
    assert reductions[0].waited and not reductions[1].waited  # one behind the newest
    tier.flush()
    assert not reductions[1].waited and torch.equal(last.grad, torch.ones(3))
    tier.acquire(last)
    assert reductions[1].waited

    tier.land(last, ReducedGradient(torch.ones(3), reductions[2], accumulate=False), final=True)
    tier.flush()
    tier.grad_sq_norm([first, last])
    assert reductions[2].waited

    tier.land(kept, ReducedGradient(torch.ones(3), reductions[3], accumulate=False, keepalive=torch.ones(6)), final=True)
    tier.flush()
    assert reductions[3].waited
