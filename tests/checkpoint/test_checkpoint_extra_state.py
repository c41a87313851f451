"""Modules' extra state (``get_extra_state``) in checkpoints: saved by rank 0, loaded everywhere, refused safely."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils._pytree import tree_map

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import VOCAB, batches
from zkernel.checkpoint import CheckpointError, consolidate_to_file


class Recipe:
    """A class a checkpoint's extra state may hold that ``weights_only`` loading does not know."""

    def __init__(self, margin: float) -> None:
        self.margin = margin


class Counting(nn.Linear):
    """Counts the rows it saw and keeps their running maximum: state that is neither a parameter nor
    a buffer (as an FP8 layer's scaling history is)."""

    def __init__(self, dim: int, recipe: bool = False) -> None:
        super().__init__(dim, dim)
        self.rows = 0
        self.history = torch.zeros(4)
        self.recipe = Recipe(0.5) if recipe else None

    def forward(self, x):
        self.rows += x.shape[0] * x.shape[1]
        self.history = torch.cat([self.history[1:].to(x.device), x.detach().abs().amax().reshape(1)])
        return super().forward(x)

    def get_extra_state(self):
        state = {"rows": self.rows, "history": self.history.clone()}
        if self.recipe is not None:
            state["recipe"] = self.recipe
        return state

    def set_extra_state(self, state) -> None:
        self.rows, self.history = state["rows"], state["history"].clone()
        self.recipe = state.get("recipe")


class Scaled(nn.Module):
    """Extra state that is one tensor (which a safetensors file can hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(3)

    def forward(self, x):
        self.scale = self.scale.to(x.device) * 1.5
        return x

    def get_extra_state(self):
        return self.scale.clone()

    def set_extra_state(self, state) -> None:
        self.scale = state.clone()


class Net(nn.Module):
    def __init__(self, dim: int = 12, recipe: bool = False, tensor_only: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.body = nn.Sequential(Counting(dim, recipe) if not tensor_only else nn.Linear(dim, dim), Scaled())
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens, targets):
        return F.cross_entropy(self.head(torch.tanh(self.body(self.embed(tokens)))).reshape(-1, VOCAB), targets.reshape(-1))


def _config(partitioner: str) -> dict:
    options = {"persistence_threshold": 0} if partitioner == "zero3" else {"bucket_size": 200}
    return {"partitioner": partitioner, "partitioner_options": options, "optimizer": {"name": "adamw", "lr": 1e-2}}


def _train(engine, steps: int, rank: int = 0, world: int = 1) -> None:
    for step in batches(5, steps, 1, world, 2):
        tokens, targets = step[0][rank]
        engine.backward(engine(tokens, targets))
        engine.step()


def _extras(model: nn.Module) -> dict:
    """Each module's extra state under its state-dict key (``state_dict()`` cannot read released zero3 parameters)."""
    return {
        f"{name}._extra_state" if name else "_extra_state": m.get_extra_state()
        for name, m in model.named_modules()
        if type(m).get_extra_state is not nn.Module.get_extra_state
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):  # on a GPU run, each rank's own device
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, Recipe):
        return isinstance(b, Recipe) and a.margin == b.margin
    return a == b


def test_extra_state_comes_back_under_another_partitioner_and_consolidates(tmp_path):
    torch.manual_seed(0)
    engine = zkernel.initialize(Net(), _config("zero2"))
    _train(engine, 3)
    saved = _extras(engine.module)
    assert saved["body.0._extra_state"]["rows"] == 3 * 2 * 6 and saved["body.1._extra_state"][0] == 1.5**3
    engine.save_checkpoint(tmp_path)
    state = engine.state_dict()
    engine.close()

    torch.manual_seed(1)
    resumed = zkernel.initialize(Net(), _config("zero3"))
    assert resumed.module.body[0].rows == 0
    resumed.load_checkpoint(tmp_path)
    assert _same(_extras(resumed.module), saved)
    assert _same({k: v for k, v in resumed.state_dict().items() if k.endswith("_extra_state")}, saved)
    resumed.close()

    consolidated = zkernel.consolidate(tmp_path)
    assert consolidated.keys() == state.keys()
    assert _same({k: consolidated[k] for k in saved}, saved)
    plain = Net()
    plain.load_state_dict(consolidated)  # strict: every key, the extra state through set_extra_state
    assert plain.body[0].rows == saved["body.0._extra_state"]["rows"]
    with pytest.raises(CheckpointError, match=r"'body.0._extra_state'\] is not a tensor, and a safetensors file"):
        consolidate_to_file(tmp_path, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_tensor_extra_state_consolidates_to_safetensors(tmp_path):
    engine = zkernel.initialize(Net(tensor_only=True), _config("zero1"))
    _train(engine, 2)
    engine.save_checkpoint(tmp_path)
    engine.close()
    out = consolidate_to_file(tmp_path, tmp_path / "full.safetensors")
    tensors = load_file(out)
    torch.testing.assert_close(tensors["body.1._extra_state"], torch.full((3,), 1.5**2))
    Net(tensor_only=True).load_state_dict(tensors)


def test_a_class_weights_only_loading_does_not_know_is_refused_and_the_engine_is_unchanged(tmp_path):
    torch.manual_seed(0)
    engine = zkernel.initialize(Net(recipe=True), _config("zero2"))
    _train(engine, 2)
    engine.save_checkpoint(tmp_path)
    engine.close()

    torch.manual_seed(1)
    fresh = zkernel.initialize(Net(), _config("zero2"))
    before = fresh.state_dict()
    with pytest.raises(CheckpointError, match=r"extra state 'body.0._extra_state'.*add_safe_globals.*The engine was not changed"):
        fresh.load_checkpoint(tmp_path)
    after = fresh.state_dict()
    assert all(_same(before[k], after[k]) for k in before)
    with torch.serialization.safe_globals([Recipe]):
        fresh.load_checkpoint(tmp_path)
    assert fresh.module.body[0].recipe.margin == 0.5 and fresh.module.body[0].rows == 2 * 2 * 6
    fresh.close()


def test_extra_state_the_model_keeps_but_the_checkpoint_lacks_is_named(tmp_path):
    engine = zkernel.initialize(Net(tensor_only=True), _config("zero2"))
    engine.save_checkpoint(tmp_path)
    engine.close()
    fresh = zkernel.initialize(Net(), _config("zero2"))
    with pytest.raises(CheckpointError, match=r"extra state \(get_extra_state\) missing from the checkpoint: \['body.0._extra_state'\]"):
        fresh.load_checkpoint(tmp_path)
    fresh.close()


def _two_ranks(directory: str) -> dict:
    """Two ranks train and save under zero3; two fresh ones load under zero2 (every rank reads rank 0's)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    engine = zkernel.initialize(Net(), _config("zero3"))
    _train(engine, 2, rank, world)
    saved = _extras(engine.module)
    engine.save_checkpoint(directory)
    state = engine.state_dict()
    engine.close()
    torch.manual_seed(1)
    resumed = zkernel.initialize(Net(), _config("zero2"))
    resumed.load_checkpoint(directory)
    resumed.close()
    # The same weights and extra state from rank 0's dict alone (FSDP's broadcast_from_rank0).
    torch.manual_seed(2)
    broadcast = zkernel.initialize(Net(), _config("zero3"))
    broadcast.load_state_dict(state if rank == 0 else {}, broadcast_from_rank0=True)
    on_cpu = partial(tree_map, lambda v: v.cpu() if isinstance(v, torch.Tensor) else v)
    out = {"saved": on_cpu(saved), "loaded": on_cpu(_extras(resumed.module)), "broadcast": on_cpu(_extras(broadcast.module)),
           "state": on_cpu(state), "broadcast_state": on_cpu(broadcast.state_dict())}  # fmt: skip
    broadcast.close()
    return out


def test_rank_zero_saves_the_extra_state_and_every_rank_loads_it(tmp_path):
    runs = run_ranks(2, _two_ranks, str(tmp_path))
    for run in runs:  # each rank counted its own rows; rank 0's values are the checkpoint's
        assert _same(run["loaded"], runs[0]["saved"])
        assert _same(run["broadcast"], runs[0]["saved"]) and _same(run["broadcast_state"], runs[0]["state"])
    assert runs[0]["saved"]["body.0._extra_state"]["rows"] == 2 * 2 * 6
