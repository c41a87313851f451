"""A model to measure without allocating it: a module, an import path, or a transformer's numbers.

`as_module` turns any of the forms `zkernel.estimate` and the planner accept
into an ``nn.Module`` whose parameters have their shapes (on the meta device,
nothing allocated): a module as given, an import path ``"pkg.mod:factory"``
called under ``torch.device("meta")``, or a `TransformerShape` (or a dict of
its fields) built as a GPT- or Llama-like decoder. `estimate_activations` is
the rough formula for what such a transformer's forward saves for backward.

It sits in the contract because a planner reads it: `zkernel.spec.planner.PlanRequest.shape`
is a `TransformerShape`, and a planner estimates activations from it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.spec.config import ConfigError
from zkernel.spec.options import choice, integer

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# -- the model: a module, an import path, or numbers --------------------------------


@attrs.frozen(kw_only=True)
class TransformerShape:
    """A GPT- or Llama-like decoder described by its numbers (built on the meta device to be measured).

    ``style="gpt"``: learned position embeddings, LayerNorm, fused qkv and
    4x GELU MLP with biases (the layout of `zkernel.cli.demo.gpt`). ``"llama"``:
    rotary positions (no parameters), RMSNorm, separate q/k/v/o without bias
    (``kv_heads`` for grouped-query attention) and a SwiGLU MLP of width
    ``intermediate`` (default: 8/3 x hidden rounded up to a multiple of 256).
    """

    layers: int = attrs.field(validator=integer(minimum=1))
    hidden: int = attrs.field(validator=integer(minimum=1))
    heads: int = attrs.field(validator=integer(minimum=1))
    vocab: int = attrs.field(validator=integer(minimum=1))
    sequence: int = attrs.field(validator=integer(minimum=1))
    tied_embeddings: bool = True
    style: str = attrs.field(default="gpt", validator=choice("gpt", "llama"))
    kv_heads: int | None = attrs.field(default=None, validator=integer(minimum=1, optional=True))
    intermediate: int | None = attrs.field(default=None, validator=integer(minimum=1, optional=True))

    def __attrs_post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} must be divisible by heads {self.heads}")
        if self.heads % (self.kv_heads or self.heads):
            raise ConfigError(f"heads {self.heads} must be divisible by kv_heads {self.kv_heads}")

    @property
    def mlp_width(self) -> int:
        if self.style == "gpt":
            return self.intermediate or 4 * self.hidden
        return self.intermediate or 256 * math.ceil(8 * self.hidden / 3 / 256)

    def build(self) -> nn.Module:
        """The model on the meta device: shapes and module structure only."""
        with torch.device("meta"):
            return _Decoder(self)


class _Attention(nn.Module):
    def __init__(self, s: TransformerShape) -> None:
        super().__init__()
        h, kv = s.hidden, (s.kv_heads or s.heads) * (s.hidden // s.heads)
        if s.style == "gpt":
            self.qkv = nn.Linear(h, 3 * h)
            self.proj = nn.Linear(h, h)
        else:
            self.q = nn.Linear(h, h, bias=False)
            self.k = nn.Linear(h, kv, bias=False)
            self.v = nn.Linear(h, kv, bias=False)
            self.o = nn.Linear(h, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: TransformerShape) -> None:
        super().__init__()
        h, m = s.hidden, s.mlp_width
        if s.style == "gpt":
            self.fc = nn.Linear(h, m)
            self.proj = nn.Linear(m, h)
        else:
            self.gate = nn.Linear(h, m, bias=False)
            self.up = nn.Linear(h, m, bias=False)
            self.down = nn.Linear(m, h, bias=False)


def _norm(s: TransformerShape) -> nn.Module:
    return nn.LayerNorm(s.hidden) if s.style == "gpt" else nn.RMSNorm(s.hidden)


class _Block(nn.Module):
    def __init__(self, s: TransformerShape) -> None:
        super().__init__()
        self.ln1 = _norm(s)
        self.attn = _Attention(s)
        self.ln2 = _norm(s)
        self.mlp = _MLP(s)


class _Decoder(nn.Module):
    def __init__(self, s: TransformerShape) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.vocab, s.hidden)
        if s.style == "gpt":
            self.wpe = nn.Embedding(s.sequence, s.hidden)
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.ln_f = _norm(s)
        if not s.tied_embeddings:
            self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)


def _import_factory(path: str) -> nn.Module:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"model {path!r} must be an import path 'package.module:factory'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model {path!r} cannot be imported: {exc}") from exc
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model factory {path!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def as_module(model: nn.Module | str | TransformerShape | Mapping[str, Any]) -> nn.Module:
    """The module to read shapes from; nothing is allocated for any of the accepted forms."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, TransformerShape):
        return model.build()
    if isinstance(model, str):
        return _import_factory(model)
    if isinstance(model, Mapping):
        return as_shape(model).build()
    raise ConfigError(
        "model must be a torch.nn.Module, an import path 'pkg.mod:factory', or a TransformerShape "
        f"(or a dict of its fields), got {type(model).__name__}"
    )


def as_shape(raw: Mapping[str, Any]) -> TransformerShape:
    fields = [a.name for a in attrs.fields(TransformerShape)]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown transformer field {unknown[0]!r}; valid: {', '.join(fields)}")
    try:
        return TransformerShape(**raw)
    except TypeError as exc:
        raise ConfigError(f"transformer description: {exc}") from exc
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise ConfigError(f"transformer description: {exc}") from exc
        raise



# -- activations (a formula, not a measurement) --------------------------------------


def estimate_activations(
    shape: TransformerShape | Mapping[str, Any],
    micro_batch: int,
    *,
    precision: str = "bf16",
    checkpointing: bool = False,
    tiled_loss: bool = False,
) -> dict[str, int]:
    """ESTIMATE of the bytes one rank's forward saves for backward, for ``micro_batch`` sequences.

    Counted, in the compute dtype, per block: the inputs each matmul,
    normalisation and activation function saves, and q, k, v and the output of
    a fused (flash / memory-efficient) attention that keeps no sequence x
    sequence matrix (its output is the output projection's input); plus the
    head: the final norm's input and output and the fp32 ``log_softmax`` of
    the logits for the loss. With ``tiled_loss`` (the loss taken by
    `zkernel.tiled_cross_entropy`) the head keeps instead the final norm's
    input, the gradient of its output (the compute dtype) and the head
    weight's fp32 gradient. With ``checkpointing`` every block keeps only its
    input, and one block's activations are recomputed at a time. Not counted:
    the logits themselves (alive only at the end of forward), gradients in
    flight, allocator fragmentation, attention kernels that materialise the
    score matrix (the CPU math path does), dropout masks, rotary tables.
    """
    s = shape if isinstance(shape, TransformerShape) else as_shape(shape)
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ConfigError(f"micro_batch must be an integer >= 1, got {micro_batch!r}")
    c = DTYPE_BYTES[precision]
    tokens = micro_batch * s.sequence
    h, m = s.hidden, s.mlp_width
    if s.style == "gpt":
        # ln1 in and out, q/k/v, attention out (= proj in), ln2 in and out, GELU in and out
        per_token = 2 * h + 3 * h + h + 2 * h + 2 * m
    else:
        kv = (s.kv_heads or s.heads) * (h // s.heads)
        # norm in and out, q and k before and after rotation, v, attention out (= o in),
        # norm in and out, gate out (SiLU in), SiLU out, up out, product (down in)
        per_token = 2 * h + 2 * (h + kv) + kv + h + 2 * h + 4 * m
    block = tokens * per_token * c
    head = tokens * 2 * h * c + s.vocab * h * 4 if tiled_loss else tokens * (2 * h * c + 4 * s.vocab)
    blocks = (s.layers * tokens * h * c + block) if checkpointing else s.layers * block
    return {"blocks": blocks, "head": head, "total": blocks + head}
