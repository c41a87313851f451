"""What the default planner knows of activations: the estimator's formula, for a model it recognises.

The formula (`zkernel.spec.model_shape.estimate_activations`) needs a GPT- or
Llama-like decoder's numbers and a micro-batch. When the model was given by
its numbers they are exact; for a module they are read from its structure
(`infer_shape`): the largest ``nn.Embedding`` gives the vocabulary and
hidden size, the ``nn.ModuleList``/``nn.Sequential`` of same-class children
holding the most parameters gives the blocks, a block's ``nn.LayerNorm``
(else RMSNorm: Llama) its style, the widest ``nn.Linear`` back to the hidden
size the MLP width, and a narrower key/value projection grouped-query
attention. A model this does not recognise (no ``nn.Embedding``, blocks of
other layer types) gets no activation estimate, and the plan says so.
"""

from __future__ import annotations

import math

import attrs
from torch import nn

from zkernel.spec import TransformerShape, estimate_activations
from zkernel.spec.model_shape import DTYPE_BYTES as _DTYPE_BYTES


@attrs.frozen(kw_only=True)
class Activations:
    """Bytes one rank's forward saves for backward (ESTIMATE), per way of running the blocks."""

    full: int  # no checkpointing
    checkpointed: int  # every block checkpointed: each keeps its input, one block is recomputed at a time
    block_inputs: int  # of `checkpointed`, the blocks' inputs (what activation offload moves to host memory)
    block_class: str  # class name of the blocks (for activation_checkpointing.modules)
    source: str  # how the numbers were found, for the plan's notes


def infer_shape(module: nn.Module, sequence: int | None) -> tuple[TransformerShape | None, str, str]:
    """(shape or None, block class name, what was recognised or why not)."""
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None, "", "the model has no nn.Embedding"
    token = max(embeddings, key=lambda e: e.num_embeddings)
    hidden = token.embedding_dim
    lists = [
        m
        for m in module.modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0 and len({type(c) for c in m}) == 1
    ]
    lists = [m for m in lists if any(True for _ in m.parameters())]
    if not lists:
        return None, "", "the model has no nn.ModuleList/nn.Sequential of blocks"
    blocks = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    block = blocks[0]
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return None, "", f"its blocks ({type(block).__name__}) hold no nn.Linear"
    style = "gpt" if any(isinstance(m, nn.LayerNorm) for m in block.modules()) else "llama"
    widths = [lin.in_features for lin in linears if lin.out_features == hidden and lin.in_features != hidden]
    intermediate = max(widths) if widths else None
    heads, kv_heads = 1, None
    if style == "llama":
        narrower = [lin.out_features for lin in linears if lin.in_features == hidden and lin.out_features < hidden]
        if narrower:
            kv = max(narrower)
            head_dim = math.gcd(hidden, kv)
            if (hidden // head_dim) % (kv // head_dim) == 0:
                heads, kv_heads = hidden // head_dim, kv // head_dim
    if sequence is None:
        positions = [e for e in embeddings if e is not token and e.embedding_dim == hidden]
        if not positions:
            return None, "", "the sequence length is unknown (give [planner] sequence)"
        sequence = positions[0].num_embeddings
    shape = TransformerShape(
        layers=len(blocks),
        hidden=hidden,
        heads=heads,
        vocab=token.num_embeddings,
        sequence=sequence,
        style=style,
        kv_heads=kv_heads,
        intermediate=intermediate,
    )
    what = (
        f"recognised as a {style}-like decoder: {len(blocks)} x {type(block).__name__}, hidden {hidden}, "
        f"MLP {shape.mlp_width}, vocabulary {token.num_embeddings}, sequence {sequence}"
    )
    return shape, type(block).__name__, what


def activations_of(request, micro_batch: int | None) -> tuple[Activations | None, str]:
    """The activation estimate for ``request`` at ``micro_batch`` sequences per rank, or None and why not."""
    if micro_batch is None:
        return None, "activations not planned (model states only): give [planner] micro_batch (and sequence)"
    config = request.config
    if request.shape is not None:
        shape, block_class, what = request.shape, "_Block", "the transformer's numbers"
        if config.planner.sequence is not None:
            shape = attrs.evolve(shape, sequence=config.planner.sequence)
    else:
        shape, block_class, what = infer_shape(request.model, config.planner.sequence)
        if shape is None:
            return None, f"activations not planned (model states only): {what}"
    tiled = config.planner.tiled_loss
    full = estimate_activations(shape, micro_batch, precision=config.precision, tiled_loss=tiled)["total"]
    checkpointed = estimate_activations(
        shape, micro_batch, precision=config.precision, checkpointing=True, tiled_loss=tiled
    )["total"]
    inputs = shape.layers * micro_batch * shape.sequence * shape.hidden * _DTYPE_BYTES[config.precision]
    loss = ", the loss tiled" if tiled else ""
    source = f"activations ESTIMATED for micro-batch {micro_batch} x sequence {shape.sequence}{loss} from {what}"
    return Activations(full=full, checkpointed=checkpointed, block_inputs=inputs, block_class=block_class, source=source), source
