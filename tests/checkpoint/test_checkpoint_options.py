"""`save_checkpoint`'s ``client_state`` and ``exclude_frozen_parameters``, and `load_checkpoint`'s
``load_module_only`` and ``load_optimizer_states``, as DeepSpeed's checkpoints take them ([Note: client
state] in `zkernel.checkpoint.client_state`, [Note: frozen parameters left out] in
`zkernel.checkpoint.save`)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses
from tests.checkpoint.test_load_state_dict import ACCUM, CLIP, LR, WD, _config  # the same recipe as the weight-loading tests

STEPS, SAVE_AT, MICRO, SEED = 4, 2, 3, 11


CONFIGS = {
    "zero2": _config("zero2"),
    "zero3": _config("zero3"),
    "zero3 params and optimizer on cpu": _config(
        "zero3", offload={"optimizer": "cpu", "params": "cpu"}, optimizer={"name": "cpu_adam", "lr": LR, "weight_decay": WD}
    ),
    "zero3 optimizer on nvme": _config("zero3", offload={"optimizer": "nvme"}),
}


def _job(tasks):
    from tests.support.checkpoint_scenarios import job

    return job(tasks)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    tasks = []
    for i, cfg in enumerate(CONFIGS.values()):
        cfg = copy.deepcopy(cfg)
        if cfg.get("offload", {}).get("optimizer") == "nvme":
            (root / "swap").mkdir()
            cfg["offload"]["nvme_path"] = str(root / "swap")
        tasks.append(("load_options", (cfg, str(root / f"ckpt{i}"), STEPS, SAVE_AT, ACCUM, MICRO, SEED)))
    return run_ranks(2, _job, tasks)


def _from_weights(weights: dict) -> TrickyNet:
    model = TrickyNet()
    model.load_state_dict(weights, strict=True)
    return model


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=list(CONFIGS))
def test_module_only_and_no_optimizer_loads_train_as_torch_from_the_saved_weights(results, index):
    data = batches(SEED + 1, STEPS, ACCUM, 2, MICRO)
    saved = results[0][index]["saved_weights"]
    # Both loads start the optimizer afresh, so both continue as torch's AdamW does from the saved weights.
    expected = reference_losses(_from_weights(saved), data[SAVE_AT:], LR, WD, CLIP)
    for rank in range(2):
        got = results[rank][index]
        for name in ("module_only", "no_optimizer"):
            loaded = got[name]
            assert loaded["tag"] == f"step{SAVE_AT}" and loaded["path"].endswith(f"ckpt{index}{os.sep}step{SAVE_AT}")
            for key, value in saved.items():
                assert torch.equal(loaded["weights"][key], value), (name, key)
            for a, b in zip(loaded["losses"], expected, strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (name, loaded["losses"], expected)
            state = loaded["client_state"]  # rank 0's, on every rank
            assert state["epoch"] == 7 and state["rank"] == 0 and state["nested"] == {"best": 0.5, "names": ["a", "b"]}
            assert torch.equal(state["seen"], torch.arange(3))
        assert got["module_only"]["counters"] == (0, 0)  # a fine-tuning start: the counters stay
        assert got["no_optimizer"]["counters"] == (SAVE_AT, SAVE_AT * ACCUM)  # everything but the optimizer state
        assert got["kept_state"] and got["kept_counters"] == (1, ACCUM) and got["kept_weights_loaded"]


def _trained(config: dict, steps: int = 2):
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), config)
    from tests.support.checkpoint_scenarios import run_steps

    run_steps(engine, batches(3, steps, 1, 1, 4), 1)
    return engine


def test_client_state_round_trips_and_defaults_to_an_empty_dict(tmp_path):
    config = {"partitioner": "zero1", "optimizer": {"lr": 1e-2}}
    engine = _trained(config)
    state = {"epoch": 3, "generator": torch.Generator().manual_seed(5).get_state(), "losses": [1.5, 1.25], "done": None}
    path = engine.save_checkpoint(tmp_path, tag="with", client_state=state)
    engine.save_checkpoint(tmp_path, tag="without")
    engine.close()
    fresh = zkernel.initialize(TrickyNet(), config)
    loaded = fresh.load_checkpoint(tmp_path, tag="with")
    assert loaded.path == path and loaded.tag == "with"
    assert loaded.client_state.keys() == state.keys() and loaded.client_state["losses"] == [1.5, 1.25]
    assert torch.equal(loaded.client_state["generator"], state["generator"]) and loaded.client_state["done"] is None
    load_path, client_state = fresh.load_checkpoint(tmp_path)  # DeepSpeed's unpacking; "latest" is "without"
    assert load_path.name == "without" and client_state == {}
    fresh.close()


class _Unregistered:
    def __init__(self, value: int) -> None:
        self.value = value


def test_a_client_state_that_cannot_be_saved_is_refused_before_anything_is_written(tmp_path):
    engine = _trained({"partitioner": "zero2", "optimizer": {"lr": 1e-2}})
    engine.save_checkpoint(tmp_path, tag="good")
    with pytest.raises(zkernel.CheckpointError, match=r"client_state must be a dict .*not a list"):
        engine.save_checkpoint(tmp_path, tag="bad", client_state=[1, 2])
    with pytest.raises(zkernel.CheckpointError, match=r"client_state given to save_checkpoint cannot be serialised"):
        engine.save_checkpoint(tmp_path, tag="bad", client_state={"fn": lambda x: x})
    assert sorted(os.listdir(tmp_path)) == ["good", "latest", "latest.checksum"]  # no directory of the failed saves left
    assert (tmp_path / "latest").read_text().strip() == "good"
    engine.close()


def test_a_client_state_weights_only_loading_refuses_leaves_the_engine_unchanged(tmp_path):
    config = {"partitioner": "zero3", "optimizer": {"lr": 1e-2}, "partitioner_options": {"persistence_threshold": 0}}
    engine = _trained(config)
    engine.save_checkpoint(tmp_path, client_state={"custom": _Unregistered(4)})
    engine.close()
    torch.manual_seed(9)
    fresh = zkernel.initialize(TrickyNet(), config)
    before = fresh.state_dict()
    with pytest.raises(zkernel.CheckpointError, match=r"client_state .*add_safe_globals.*engine was not changed"):
        fresh.load_checkpoint(tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    with torch.serialization.safe_globals([_Unregistered]):
        assert fresh.load_checkpoint(tmp_path).client_state["custom"].value == 4
    with pytest.raises(zkernel.CheckpointError, match=r"load_module_only must be True or False, not 'yes'"):
        fresh.load_checkpoint(tmp_path, load_module_only="yes")
    fresh.close()


FROZEN_CONFIGS = {
    "zero2": _config("zero2"),
    "zero3": _config("zero3"),
    "zero3 params on cpu, frozen layer tiled": _config(
        "zero3", offload={"params": "cpu"}, tiling={"modules": ["frozen_proj"], "tiles": 2}
    ),
}


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    tasks = [("frozen_left_out", (cfg, str(root / f"ckpt{i}"), STEPS, SAVE_AT, ACCUM, MICRO, SEED))
             for i, cfg in enumerate(FROZEN_CONFIGS.values())]  # fmt: skip
    return root, run_ranks(2, _job, tasks)


@pytest.mark.parametrize("index", range(len(FROZEN_CONFIGS)), ids=list(FROZEN_CONFIGS))
def test_frozen_parameters_left_out_of_a_checkpoint_keep_the_loading_engines_values(frozen, index):
    root, results = frozen
    for rank in range(2):
        got = results[rank][index]
        assert got["stored"] and not any("frozen_proj.weight" in key or "frozen_proj.tiles" in key and "weight" in key
                                         for key in got["stored"]), got["stored"]  # fmt: skip
        for a, b in zip(got["resumed"], got["uninterrupted"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (got["resumed"], got["uninterrupted"])
        loaded = got["other_loaded"]
        assert torch.equal(loaded["frozen_proj.weight"], got["other_frozen"])  # its own base
        assert all(torch.equal(loaded[k], v) for k, v in got["saved"].items() if k != "frozen_proj.weight")
        assert got["error"] and "['frozen_proj.weight'] were frozen and left out" in got["error"] and got["unchanged"]
    stored = [key for rank in range(2) for key in results[rank][index]["stored"]]
    assert any("frozen_proj.bias" in key or "frozen_proj.tiles" in key for key in stored)  # trained: kept
    full = zkernel.consolidate(root / f"ckpt{index}")
    saved = results[0][index]["saved"]
    assert full.keys() == saved.keys() - {"frozen_proj.weight"}
    plain = TrickyNet()
    missing, unexpected = plain.load_state_dict(full, strict=False)
    assert missing == ["frozen_proj.weight"] and unexpected == []
