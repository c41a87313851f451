"""Optimizer offload (tier ``cpu``) for every partitioner and both Adams, against single-process torch."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.scenarios import train, train_many
from tests.test_partitioners import ACCUM, MICRO, SEED, STEPS, assert_matches, config, reference

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
    configs = [offload_config(s, o) for s in STAGES for o in OPTIMIZERS]
    results = run_ranks(world, train_many, configs, STEPS, ACCUM, MICRO, SEED)
    expected = reference(world)
    for rank_results in results:
        for cfg, result in zip(configs, rank_results):
            assert_matches(result["losses"], expected, f"{cfg['partitioner']} {cfg['optimizer']['name']} world {world}")
