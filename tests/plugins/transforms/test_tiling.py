"""Memory-centric tiling: tiled layers compute what nn.Linear does; under zero3 each tile is gathered alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zkernel
from tests.support.models import TrickyNet
from tests.support.transform_scenarios import GatheredBytes
from zkernel.params.param_map import ParamMap, Piece
from zkernel_plugins.tiling._tiled_linear import TiledLinear

REL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize(("rows", "cols"), [(4, 1), (3, 1), (1, 3), (3, 2)])
def test_tiled_linear_forward_and_gradients_equal_linear(rows, cols):
    torch.manual_seed(0)
    linear = nn.Linear(50, 37)  # sizes that do not divide by the tile counts
    reference = nn.Linear(50, 37)
    reference.load_state_dict(linear.state_dict())
    tiled = TiledLinear.from_linear(linear, rows, cols)
    assert len(tiled.tiles) == rows * cols
    x = torch.randn(6, 5, 50, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = tiled(x), reference(x_ref)
    assert _rel(y, y_ref) <= REL
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    grads = ParamMap.of(tiled).assemble({n: p.grad for n, p in tiled.named_parameters()})
    assert set(grads) == {"weight", "bias"}
    assert _rel(grads["weight"], reference.weight.grad) <= REL
    assert _rel(grads["bias"], reference.bias.grad) <= REL
    assert _rel(x.grad, x_ref.grad) <= REL
    # The user sees the untiled layer: attributes, state_dict, load_state_dict.
    assert torch.equal(tiled.weight, reference.weight) and torch.equal(tiled.bias, reference.bias)
    state = tiled.state_dict()
    assert list(state) == ["weight", "bias"] and torch.equal(state["weight"], reference.weight.detach())
    fresh = TiledLinear(50, 37, bias=True, rows=rows, cols=cols)
    fresh.load_state_dict(reference.state_dict())
    assert torch.equal(fresh(x_ref), tiled(x_ref))


def test_param_map_names_pieces_both_ways():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    model[0] = TiledLinear.from_linear(model[0], rows=2, cols=1)
    pm = ParamMap.of(model)
    assert pm.pieces("0.weight") == (
        Piece("0.tiles.0.weight", (slice(0, 3), slice(0, 4))),
        Piece("0.tiles.1.weight", (slice(3, 6), slice(0, 4))),
    )
    assert pm.user_name("0.tiles.1.bias") == ("0.bias", (slice(3, 6),))
    assert pm.pieces("other") == (Piece("other", ()),)
    assert pm.user_names(n for n, _ in model.named_parameters()) == ["0.weight", "0.bias"]
    whole = {"0.weight": torch.arange(24.0).view(6, 4), "0.bias": torch.arange(6.0)}
    held = pm.split(whole)
    assert sorted(held) == ["0.tiles.0.bias", "0.tiles.0.weight", "0.tiles.1.bias", "0.tiles.1.weight"]
    assert torch.equal(pm.assemble(held)["0.weight"], whole["0.weight"])
    with pytest.raises(ValueError, match=r"shape \(2, 2\), expected \(6, 4\)"):
        pm.split({"0.weight": torch.zeros(2, 2)})


class Wide(nn.Module):
    """One Linear much larger than the rest of the model."""

    def __init__(self, width: int = 48, out: int = 480) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.big = nn.Linear(width, out)
        self.head = nn.Linear(out, 1)

    def forward(self, x):
        return (self.head(torch.tanh(self.big(torch.tanh(self.inp(x))))) - 1).pow(2).mean()


def _zero3(tiles: int | None, **extra) -> dict:
    cfg = {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}, "prefetch_bytes": 0,
           "optimizer": {"lr": 1e-2}, **extra}
    if tiles:
        cfg["tiling"] = {"modules": ["big"], "tiles": tiles}
    return cfg


def _train_wide(config: dict, steps: int = 3, budget: int | None = None) -> tuple[list[float], int, nn.Module]:
    torch.manual_seed(0)
    model = Wide()
    engine = zkernel.initialize(model, config)
    meter = GatheredBytes(engine, budget)
    engine.plugin_manager.register(meter)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses, meter.peak, model


def test_zero3_gathers_one_tile_at_a_time():
    big_bytes = (48 * 480 + 480) * 4
    untiled, peak_1, _ = _train_wide(_zero3(None))
    peaks = {}
    for tiles in (2, 4, 8):
        losses, peaks[tiles], model = _train_wide(_zero3(tiles))
        # Training amplifies the arithmetic's different order; per step the layers agree to 1e-6.
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, untiled)), (tiles, losses, untiled)
        assert isinstance(model.big, nn.Linear), "close puts the original layer back"
    # The big layer dominates what is gathered at once; a tile is 1/tiles of it.
    assert peak_1 >= big_bytes
    for tiles, peak in peaks.items():
        assert peak <= big_bytes / tiles + 2048, (tiles, peak, big_bytes)
    assert peaks[2] > peaks[4] > peaks[8]


def test_layer_too_large_to_gather_whole_trains_with_tiles():
    budget = (48 * 480 + 480) * 4 // 3  # a third of the layer may be gathered at once
    with pytest.raises(MemoryError, match="over the budget"):
        _train_wide(_zero3(None), budget=budget)
    losses, peak, _ = _train_wide(_zero3(4), steps=6, budget=budget)
    assert peak <= budget and losses[-1] < losses[0]


def test_meta_device_model_materialises_tile_by_tile():
    with torch.device("meta"):
        model = Wide()
    engine = zkernel.initialize(model, _zero3(4))
    assert [type(t).__name__ for t in model.big.tiles] == ["LinearTile"] * 4
    losses = []
    for _ in range(4):
        loss = engine(torch.randn(16, 8, generator=torch.Generator().manual_seed(2)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with engine.gathered_parameters():
        weight = model.big.weight.detach().clone()
        state = model.state_dict()
    assert weight.shape == (480, 48) and state["big.weight"].shape == (480, 48) and "big.tiles.0.weight" not in state
    assert weight.abs().max() <= 1 / 48**0.5 + 4 * 1e-2  # nn.Linear's init bound, plus a few Adam steps
    assert losses[-1] < losses[0]
    engine.close()  # the original layer was built on meta: it gets the trained values all the same
    assert isinstance(model.big, nn.Linear) and not model.big.weight.is_meta
    assert torch.equal(model.big.weight.detach(), weight)


class Narrow(nn.Module):
    """A wide-input Linear (like a GPT MLP's ``out``) between two small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 480)
        self.big = nn.Linear(480, 40)
        self.head = nn.Linear(40, 1)

    def forward(self, x):
        return (self.head(torch.tanh(self.big(torch.tanh(self.inp(x))))) - 1).pow(2).mean()


@pytest.mark.parametrize(("split", "rows", "cols"), [("auto", 1, 4), ("output", 4, 1), ("input", 1, 4)])
def test_split_auto_cuts_along_the_larger_side_and_trains_alike(split, rows, cols):
    def train(tiling: dict | None) -> tuple[list[float], nn.Module, list]:
        torch.manual_seed(0)
        model = Narrow()
        engine = zkernel.initialize(model, _zero3(None, **({"tiling": tiling} if tiling else {})))
        shape = [len(model.big.row_bounds), len(model.big.col_bounds)] if tiling else None
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        return losses, model, shape

    untiled, reference, _ = train(None)
    losses, model, shape = train({"modules": ["big"], "tiles": 4, "split": split})
    assert shape == [rows, cols]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, untiled)), (losses, untiled)
    assert _rel(model.big.weight, reference.big.weight) <= 1e-5


def test_split_auto_cuts_a_wide_output_layer_along_its_outputs():
    wide = Wide()
    engine = zkernel.initialize(wide, {"tiling": {"modules": ["big"], "tiles": 4}})
    assert (len(wide.big.row_bounds), len(wide.big.col_bounds)) == (4, 1)
    engine.close()


def test_tiling_selection_by_size_and_clear_errors():
    torch.manual_seed(0)
    model = Wide()
    engine = zkernel.initialize(model, {"tiling": {"min_numel": 48 * 480, "tiles": 3}})
    assert isinstance(model.big, TiledLinear) and isinstance(model.inp, nn.Linear) and isinstance(model.head, nn.Linear)
    engine.close()

    tied = TrickyNet()
    tied.out = nn.Linear(13, 29)
    tied.out.weight = tied.embed.weight
    cases = [
        ({"tiling": {"modules": ["bigg"]}}, ["tiling.modules pattern 'bigg' matches no nn.Linear", "big, head"], Wide()),
        ({"tiling": {"modules": ["out"]}}, ["selects 'out'", "shares its weight with embed.weight (tied)"], tied),
        ({"tiling": {"modules": ["big"], "split": "diagonal"}}, ["tiling", "split"], Wide()),
        ({"tiling": {"modules": ["big"], "tile": 2}}, ["unknown config key tiling.tile", "modules, min_numel, tiles", "split"], Wide()),
        ({"tiling": {"tiles": 0}}, ["tiling.tiles must be an integer >= 1"], Wide()),
        ({"tiling": {"name": "grid"}}, ["tiling.name 'grid' is not installed; installed: linear"], Wide()),
    ]
    for raw, fragments, target in cases:
        with pytest.raises(zkernel.ConfigError) as info:
            zkernel.initialize(target, raw)
        for fragment in fragments:
            assert fragment in str(info.value), (raw, str(info.value))
    # A layer tied to another is skipped, not an error, when only its size selects it.
    engine = zkernel.initialize(tied, {"tiling": {"min_numel": 1}})
    assert isinstance(tied.out, nn.Linear) and isinstance(tied.block[0], TiledLinear)
    engine.close()


@pytest.mark.parametrize("partitioner", ["zero3", "zero2"])
def test_tiled_models_save_load_and_give_the_users_state_dict(tmp_path, partitioner):
    """`Engine.state_dict` of a tiled model is the untiled model's (under zero3 it raised on the released
    tiles), and so is what `zkernel.consolidate` makes of its checkpoint; the checkpoint keeps each tile
    and resumes training as if uninterrupted."""
    import zkernel

    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        plain = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        config = {"partitioner": partitioner, "precision": "fp32", "optimizer": {"lr": 1e-2},
                  "partitioner_options": {"persistence_threshold": 0} if partitioner == "zero3" else {},
                  "tiling": {"min_numel": 512, "tiles": 2}}  # fmt: skip
        return zkernel.initialize(model, config), plain

    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=g) for _ in range(4)]

    def step(e, x):
        loss = e(x).pow(2).mean()
        e.backward(loss)
        e.step()
        return loss.item()

    first, plain = engine()
    for x in data[:2]:
        step(first, x)
    state = first.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == plain
    with first.gathered_parameters():
        for name, value in first.module.state_dict().items():
            assert torch.equal(state[name], value.cpu()), name
    first.save_checkpoint(tmp_path / "ckpt")
    full = zkernel.consolidate(tmp_path / "ckpt")  # the untiled model's, as the engine's state dict
    assert list(full) == list(state) and all(torch.equal(full[k], state[k]) for k in state)
    from safetensors.torch import load_file

    from zkernel.checkpoint.consolidate import consolidate_to_file

    written = load_file(consolidate_to_file(tmp_path / "ckpt", tmp_path / "model.safetensors"))
    assert written.keys() == state.keys() and all(torch.equal(written[k], state[k]) for k in state)
    expected = [step(first, x) for x in data[2:]]
    first.close()
    second, _ = engine()
    second.load_checkpoint(tmp_path / "ckpt")
    assert [step(second, x) for x in data[2:]] == expected
    second.close()
