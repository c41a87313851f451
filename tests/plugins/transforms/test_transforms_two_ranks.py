"""Tiling and activation checkpointing under zero3 on 2 real gloo ranks, against single-process torch."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses
from tests.support.transform_scenarios import train_tricky_transformed

STEPS, ACCUM, MICRO, SEED = 6, 2, 3, 4321
LR, WD, CLIP = 2e-2, 0.1, 0.5
BASE = {
    "partitioner": "zero3",
    "partitioner_options": {"persistence_threshold": 0},
    "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": CLIP,
    "optimizer": {"lr": LR, "weight_decay": WD},
}
# block (a Sequential) runs twice per forward; frozen_proj has a frozen weight and a trainable bias.
TILED = {"modules": ["block.*", "frozen_proj"], "tiles": 3}
RUNS = {
    "plain": ("tricky", BASE),
    "tiled by output": ("tricky", {**BASE, "tiling": TILED}),
    "tiled by input": ("tricky", {**BASE, "tiling": {**TILED, "split": "input"}}),
    "checkpointed, offloaded": ("tricky", {**BASE, "activation_checkpointing": {"modules": ["block", "frozen_proj"], "offload": "cpu"}}),
    "tiled and checkpointed": ("tricky", {**BASE, "tiling": TILED, "activation_checkpointing": {"modules": ["Sequential"]}}),
    # The tied head and its loss in tiles (zkernel.tiled_cross_entropy), with the blocks
    # checkpointed and offloaded: the reference is TrickyNet's untiled loss all the same.
    "tiled loss": ("tiled loss", {**BASE, "activation_checkpointing": {"modules": ["block"], "offload": "cpu"}}),
}


@pytest.fixture(scope="module")
def two_ranks():
    torch.manual_seed(SEED)
    reference = TrickyNet()
    expected = reference_losses(reference, batches(SEED + 1, STEPS, ACCUM, 2, MICRO), LR, WD, CLIP)
    results = run_ranks(2, train_tricky_transformed, list(RUNS.values()), STEPS, ACCUM, MICRO, SEED)
    return expected, reference, [dict(zip(RUNS, rank)) for rank in results]


def _assert_losses(losses, expected, rel, label):
    assert len(losses) == len(expected) == STEPS
    for i, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= rel * abs(b), f"{label}: step {i}: {a!r} vs {b!r}"


def test_tiled_layers_train_like_untiled_torch(two_ranks):
    expected, reference, ranks = two_ranks
    names = list(reference.state_dict())
    for rank in ranks:
        assert rank["plain"]["world"] == 2
        for label in ("tiled by output", "tiled by input", "tiled and checkpointed"):
            r = rank[label]
            _assert_losses(r["losses"], expected, 1e-5, label)
            assert "block.0.tiles.2.weight" in r["held"] and "block.0.weight" not in r["held"]
            assert r["trace"] > rank["plain"]["trace"], "each tile is a unit of its own"
            # What the user sees is the untiled model, trained like the reference.
            assert list(r["state"]) == names
            for name, value in reference.state_dict().items():
                assert torch.allclose(r["state"][name], value, rtol=1e-4, atol=1e-6), (label, name)
                assert torch.equal(r["restored"][name], r["state"][name]), (label, name)
            assert "TiledLinear" not in r["classes"], "close puts the original layers back"


def test_checkpointed_training_equals_training_without_it(two_ranks):
    expected, _, ranks = two_ranks
    for rank in ranks:
        plain = rank["plain"]
        _assert_losses(plain["losses"], expected, 1e-5, "plain")
        checkpointed = rank["checkpointed, offloaded"]
        _assert_losses(checkpointed["losses"], plain["losses"], 1e-6, "checkpointed, offloaded")
        assert checkpointed["trace"] == plain["trace"], "recomputations stay out of the trace"
        for name, value in plain["state"].items():
            assert torch.allclose(checkpointed["state"][name], value, rtol=1e-6, atol=1e-7), name


def test_tiled_loss_trains_like_the_untiled_head_under_zero3(two_ranks):
    expected, reference, ranks = two_ranks
    for rank in ranks:
        r = rank["tiled loss"]
        _assert_losses(r["losses"], expected, 1e-5, "tiled loss")
        _assert_losses(r["losses"], rank["plain"]["losses"], 1e-6, "tiled loss vs plain")
        assert r["held"] == rank["plain"]["held"], "one tied parameter, as in the plain run"
        for name, value in reference.state_dict().items():
            assert torch.allclose(r["state"][name], value, rtol=1e-4, atol=1e-6), name
