"""The output head and its cross-entropy, tile by tile: the logits are never whole.

    loss = zkernel.tiled_cross_entropy(hidden, head.weight, targets)
    # equals F.cross_entropy(F.linear(hidden, head.weight).float().flatten(0, -2), targets.flatten())

[Note: tiled loss] A language model's logits are the largest activation it
makes: GPT-2's vocabulary of 50,304 over 16 x 1024 tokens is 1.6 GB in bf16,
3.3 GB again as the fp32 the loss is taken in, and as much once more for its
gradient in backward, more than every checkpointed block together. Here the
rows go through the head and the loss a tile at a time, and each tile's
gradients are taken while its logits are at hand: the softmax minus the
one-hot target, times the head's weight for the hidden rows' gradient, and
the tile's contribution to the weight's (and bias's) gradient, summed in
fp32 (on CUDA by the matmul itself). Under autocast the head is cast to
autocast's dtype once, not once per tile. Backward then only scales what
forward kept by the loss's incoming gradient (the loss is linear in it), so
the logits are never recomputed and the matmuls are those of the untiled
head: no extra FLOPs, and at most one tile of logits (``tile_bytes`` of
fp32, 512 MiB by default) in memory. What forward keeps for backward is the
hidden rows' gradient and the head's, the size of the head's inputs and
weight. (Liger-Kernel's fused linear cross-entropy and DeepSpeed's ALST also
tile the logits.)

It is a function the user calls where the model computes its loss, not a
plugin: the loss is the user's code, and no config can reach into it. Under
zkernel's ZeRO-3 the weight can be a parameter read outside its module's
forward, as a tied embedding is: the engine's guard gathers it like any such
read, and its gradient reaches it through autograd as usual. The gradients
are taken only when autograd wants them (``torch.no_grad()``, evaluation: the
loss alone). Double backward is not supported.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["tiled_cross_entropy"]

TILE_BYTES = 512 * 2**20
REDUCTIONS = ("mean", "sum")


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    tiles: int | None = None,
    tile_bytes: int = TILE_BYTES,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` over the last dimension,
    without the logits whole (see [Note: tiled loss]).

    ``hidden``: ``(..., features)``; ``weight``: ``(classes, features)``; ``bias``: ``(classes,)``
    or None; ``target``: integer class indices of shape ``hidden.shape[:-1]``, rows equal to
    ``ignore_index`` left out. ``reduction``: "mean" (over the rows not ignored) or "sum".
    ``tiles``: how many tiles the rows are cut into; by default as many as keep one tile's fp32
    logits under ``tile_bytes``. Runs under autocast as ``F.linear`` does; returns a 0-dim fp32
    tensor.
    """
    _check(hidden, weight, target, bias, ignore_index, reduction, tiles, tile_bytes)
    rows = math.prod(hidden.shape[:-1])
    classes = weight.shape[0]
    if tiles is None:
        tiles = -(-rows * classes * 4 // tile_bytes)
    tiles = max(1, min(tiles, rows))
    return _TiledCrossEntropy.apply(
        hidden, weight, bias, target, ignore_index, reduction == "mean", tiles
    )


def _check(hidden, weight, target, bias, ignore_index, reduction, tiles, tile_bytes) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"tiled_cross_entropy: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"tiled_cross_entropy: hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"tiled_cross_entropy: hidden (..., features) and weight (classes, features) do not match: "
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"tiled_cross_entropy: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"tiled_cross_entropy: target must hold integer class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"tiled_cross_entropy: target must have hidden's shape without its last dimension, "
            f"{tuple(hidden.shape[:-1])}, got {tuple(target.shape)}"
        )
    if tiles is not None and (not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1):
        raise ValueError(f"tiled_cross_entropy: tiles must be a positive int or None, got {tiles!r}")
    if not isinstance(tile_bytes, int) or tile_bytes < 1:
        raise ValueError(f"tiled_cross_entropy: tile_bytes must be a positive int, got {tile_bytes!r}")
    if target.device.type == "cpu" and target.numel():
        # On a device an index out of range fails inside the kernel, as it does in F.cross_entropy.
        bad = (target != ignore_index) & ((target < 0) | (target >= weight.shape[0]))
        if bool(bad.any()):
            raise IndexError(
                f"tiled_cross_entropy: target holds {int(target[bad][0])}, outside the classes "
                f"[0, {weight.shape[0]}) and not ignore_index ({ignore_index})"
            )


# A matmul that sums its bf16/fp16 product straight into an fp32 tensor (CUDA): one pass, and
# the weight's gradient keeps fp32 precision across tiles.
_ADDMM_INTO_FP32 = hasattr(torch.ops.aten.addmm, "dtype_out")


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """The dtype F.linear would compute in: autocast's, else the inputs' own (which must agree)."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1:
        raise TypeError(
            f"tiled_cross_entropy: hidden, weight and bias must share a dtype outside autocast, got "
            f"{', '.join(sorted(str(d) for d in dtypes))}"
        )
    return weight.dtype


def _add_product(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``into += a @ b`` with ``into`` fp32, the product summed in fp32."""
    if a.dtype == into.dtype:
        into.addmm_(a, b)
    elif _ADDMM_INTO_FP32 and into.is_cuda:
        torch.addmm(into, a, b, out_dtype=into.dtype, out=into)
    else:
        into += a @ b


class _TiledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, mean, tiles):
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grads = want_hidden or want_weight or want_bias
        dtype = _compute_dtype(hidden, weight, bias)
        flat = hidden.reshape(-1, hidden.shape[-1])
        labels = target.reshape(-1).long()
        valid = labels != ignore_index
        count = valid.sum()
        # Each valid row's share of the loss's gradient: 1/count for a mean (0 rows: no gradient).
        share = 1.0 / count.clamp(min=1).float() if mean else torch.ones((), device=flat.device)
        grad_hidden = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        step = max(1, -(-flat.shape[0] // tiles))  # an empty batch: no tile, a mean of NaN as in torch
        # The head in autocast's dtype, cast once (autocast would cast it again for every tile).
        with torch.autocast(flat.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for start in range(0, flat.shape[0], step):
                rows = slice(start, start + step)
                h, keep = flat[rows].to(dtype), valid[rows]
                safe = labels[rows].where(keep, 0).unsqueeze(1)
                logp = torch.log_softmax(F.linear(h, w, b), dim=1, dtype=torch.float32)
                total -= torch.where(keep, logp.gather(1, safe).squeeze(1), 0.0).sum()
                if not grads:
                    continue
                p = logp.exp_()  # softmax
                p.scatter_add_(1, safe, -keep.unsqueeze(1).float())  # minus the one-hot target
                # The gradient the head's matmuls see in the untiled graph, in their dtype.
                g = torch.mul(p, (keep.float() * share).unsqueeze(1), out=torch.empty(p.shape, dtype=dtype, device=p.device))
                del p, logp
                if want_hidden:
                    grad_hidden[rows] = g @ w
                if want_weight:
                    _add_product(grad_weight, g.t(), h)
                if want_bias:
                    grad_bias += g.sum(0, dtype=torch.float32)
        ctx.set_materialize_grads(False)
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if want_bias:
            grad_bias = grad_bias.to(bias.dtype)
        ctx.shape = hidden.shape
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return total / count if mean else total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        if grad_loss is None:
            return None, None, None, None, None, None, None
        scaled = [None if g is None else g * grad_loss for g in (grad_hidden, grad_weight, grad_bias)]
        if scaled[0] is not None:
            scaled[0] = scaled[0].reshape(ctx.shape)
        return (*scaled, None, None, None, None)
