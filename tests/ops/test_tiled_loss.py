"""zkernel.tiled_cross_entropy: the head and loss tile by tile equal F.linear + F.cross_entropy,
without the logits ever whole. (Under zero3 on 2 ranks: tests/plugins/transforms/test_transforms_two_ranks.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import zkernel
from tests.support.models import VOCAB, TiledLossNet, TrickyNet, batches, reference_losses
from tests.support.scenarios import _train_steps

REL = 1e-6
ROWS, FEATURES, CLASSES = 48, 8, 500


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def _inputs(seed: int = 0, bias: bool = True, shape=(6, 8)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, FEATURES, generator=g, requires_grad=True)
    weight = torch.randn(CLASSES, FEATURES, generator=g, requires_grad=True)
    b = torch.randn(CLASSES, generator=g, requires_grad=True) if bias else None
    target = torch.randint(0, CLASSES, shape, generator=g)
    target.view(-1)[::5] = -100  # rows left out
    return hidden, weight, b, target


def _clone(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def _untiled(hidden, weight, bias, target, reduction="mean"):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tiles", [1, 5, 48, None])
def test_loss_and_gradients_equal_the_untiled_head(reduction, bias, tiles):
    hidden, weight, b, target = _inputs(bias=bias)
    ref = _clone(hidden, weight, b)
    loss = zkernel.tiled_cross_entropy(hidden, weight, target, b, reduction=reduction, tiles=tiles, tile_bytes=4096)
    expected = _untiled(*ref, target, reduction)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert _rel(loss, expected) <= REL
    # The incoming gradient scales what forward took (a loss divided by accumulation steps).
    (loss * 0.375).backward()
    (expected * 0.375).backward()
    for got, want in zip((hidden, weight, b), ref):
        if got is not None:
            assert _rel(got.grad, want.grad) <= REL


def test_only_the_inputs_that_want_a_gradient_get_one_and_no_grad_gives_the_loss_alone():
    hidden, weight, _, target = _inputs(bias=False)
    frozen = weight.detach()
    loss = zkernel.tiled_cross_entropy(hidden, frozen, target, tiles=4)
    loss.backward()
    ref = _clone(hidden)[0]
    _untiled(ref, frozen, None, target).backward()
    assert _rel(hidden.grad, ref.grad) <= REL
    with torch.no_grad():
        value = zkernel.tiled_cross_entropy(hidden, weight, target, tiles=4)
    assert value.grad_fn is None and _rel(value, loss) <= REL


def test_every_row_ignored_or_none_at_all_gives_what_torch_gives():
    hidden, weight, _, target = _inputs(bias=False)
    target.fill_(-100)
    loss = zkernel.tiled_cross_entropy(hidden, weight, target, tiles=3)
    loss.backward()
    assert torch.isnan(loss)
    assert not hidden.grad.any() and not weight.grad.any()
    empty = torch.zeros(0, FEATURES, requires_grad=True)
    for reduction in ("mean", "sum"):
        loss = zkernel.tiled_cross_entropy(empty, weight, torch.zeros(0, dtype=torch.long), reduction=reduction)
        expected = _untiled(empty, weight, None, torch.zeros(0, dtype=torch.long), reduction)
        assert torch.equal(loss, expected) or (loss.isnan() and expected.isnan()), (reduction, loss, expected)
        loss.backward()


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op produced."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_and_saved(fn) -> tuple[int, int]:
    """Run forward and backward of ``fn()``: the largest tensor made, and the elements saved for backward."""
    saved = []
    with _LargestTensor() as probe:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = fn()
        loss.backward()
    return probe.largest, sum(saved)


def test_the_logits_are_never_whole_and_backward_keeps_gradients_not_logits():
    hidden, weight, b, target = _inputs(shape=(ROWS,))
    whole = ROWS * CLASSES
    largest, saved = _largest_and_saved(lambda: _untiled(*_clone(hidden, weight, b), target))
    assert largest >= whole and saved >= whole  # the probe sees what the untiled head makes
    tiles = 8
    largest, saved = _largest_and_saved(lambda: zkernel.tiled_cross_entropy(hidden, weight, target, b, tiles=tiles))
    assert largest <= max(whole // tiles, CLASSES * FEATURES), largest
    assert saved <= ROWS * FEATURES + CLASSES * FEATURES + CLASSES, saved
    # tile_bytes picks the tile count: 4 KiB of fp32 logits is 2 rows of 500 classes.
    largest, _ = _largest_and_saved(lambda: zkernel.tiled_cross_entropy(hidden, weight, target, b, tile_bytes=4096))
    assert largest <= max(2 * CLASSES, CLASSES * FEATURES), largest


def test_under_autocast_it_matches_the_untiled_head_in_bf16():
    hidden, weight, b, target = _inputs()
    ref = _clone(hidden, weight, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = zkernel.tiled_cross_entropy(hidden, weight, target, b, tiles=4)
        expected = _untiled(*ref, target)
    loss.backward()
    expected.backward()
    assert _rel(loss, expected) <= 1e-6  # both take the loss in fp32 of the same bf16 logits
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    # The weight's gradient sums the tiles in fp32 where the untiled head rounds one bf16 matmul.
    for got, want in zip((hidden, weight, b), ref):
        assert _rel(got.grad, want.grad) <= 1e-2


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(reduction="none"), ValueError, "reduction must be one of mean, sum, got 'none'"),
        (dict(tiles=0), ValueError, "tiles must be a positive int or None, got 0"),
        (dict(tile_bytes=0), ValueError, "tile_bytes must be a positive int"),
        (dict(target="float"), TypeError, "target must hold integer class indices, got torch.float32"),
        (dict(target="short"), ValueError, r"target must have hidden's shape without its last dimension, \(6, 8\), got \(6, 7\)"),
        (dict(target="range"), IndexError, rf"target holds {CLASSES}, outside the classes \[0, {CLASSES}\)"),
        (dict(weight="transposed"), ValueError, r"hidden \(6, 8, 8\), weight \(8, 500\)"),
        (dict(bias="short"), ValueError, r"bias must have shape \(500,\), got \(499,\)"),
        (dict(weight="bf16"), TypeError, "must share a dtype outside autocast, got torch.bfloat16, torch.float32"),
    ],
)
def test_bad_input_says_what_is_wrong(change, error, match):
    hidden, weight, b, target = _inputs()
    kwargs = {}
    target = {
        "float": target.float(), "short": target[:, :7], "range": target.clone().fill_(CLASSES),
    }.get(change.pop("target", None), target)
    weight = {"transposed": weight.t(), "bf16": weight.bfloat16(), None: weight}[change.pop("weight", None)]
    b = b[:-1] if change.pop("bias", None) else b
    kwargs.update(change)
    with pytest.raises(error, match=match):
        zkernel.tiled_cross_entropy(hidden, weight, target, b, **kwargs)


def test_a_tied_head_under_zero3_trains_loss_for_loss_like_torch():
    """One process (the two-rank run is in test_transforms_two_ranks): the tied weight is read
    outside its module, gathered by the engine's guard, and gets one gradient."""
    data = batches(8, 4, 2, 1, 4)
    torch.manual_seed(7)
    expected = reference_losses(TrickyNet(), data, 1e-2, 0.0, 1.0)
    torch.manual_seed(7)
    model = TiledLossNet()
    config = {
        "partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0},
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    }
    engine = zkernel.initialize(model, config)
    losses = _train_steps(engine, 4, 2, 4, 7)
    assert [g.name for g in engine.groups if g.index in engine.scheduler.external] == ["embed"]
    engine.close()
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, expected)), (losses, expected)
    assert model.embed.weight.shape == (VOCAB, 13)


@pytest.mark.cuda
def test_on_cuda_the_peak_is_a_tile_of_logits_not_the_whole():
    rows, features, classes = 8192, 1024, 50304  # whole fp32 logits: 1.65 GB
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, features, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(classes, features, device="cuda", generator=g)).bfloat16().requires_grad_()
    target = torch.randint(0, classes, (rows,), device="cuda", generator=g)

    def peak(fn) -> tuple[int, torch.Tensor]:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, loss.detach()

    whole, expected = peak(lambda: _untiled(hidden, weight, None, target))
    grads = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    tile_bytes = 64 * 2**20
    tiled, loss = peak(lambda: zkernel.tiled_cross_entropy(hidden, weight, target, tile_bytes=tile_bytes))
    assert whole >= rows * classes * 4
    # A few tiles' worth of logits, the fp32 sum of the weight's gradient and the gradients themselves.
    bound = 4 * tile_bytes + classes * features * (4 + 2 + 2) + rows * features * 2 * 2
    assert tiled <= bound, (tiled, bound, whole)
    assert _rel(loss, expected) <= 1e-5
    assert _rel(hidden.grad.float(), grads[0].float()) <= 1e-2
    assert _rel(weight.grad.float(), grads[1].float()) <= 1e-2
