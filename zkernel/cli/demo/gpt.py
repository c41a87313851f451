"""A small GPT in plain torch, buildable on the meta device.

Pre-LayerNorm transformer blocks (fused qkv projection, causal
`F.scaled_dot_product_attention`, tanh-GELU MLP of width 4d), learned position
embeddings and an output head tied to the token embedding.

Every module that owns parameters has a ``reset_parameters()`` that
initialises only its own parameters, so the model can be created under
``torch.device("meta")`` and materialised one module at a time by a
partitioner (zero3 does this; each rank then keeps only its shard). The tied
head is ``F.linear`` over the embedding's weight, so the weight has one owner.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn


@attrs.frozen(kw_only=True)
class GPTConfig:
    vocab_size: int
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")


class Linear(nn.Linear):
    """`nn.Linear` with GPT-2 initialisation: N(0, std) weight, zero bias."""

    def __init__(self, in_features: int, out_features: int, std: float = 0.02, **kwargs) -> None:
        self.std = std
        super().__init__(in_features, out_features, **kwargs)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """`nn.Embedding` initialised N(0, 0.02), as GPT-2 does."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model)
        # Residual projections are scaled down with depth (GPT-2).
        self.proj = Linear(cfg.d_model, cfg.d_model, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = Linear(4 * cfg.d_model, cfg.d_model, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids ``(batch, time)`` -> logits ``(batch, time, vocab)``; with targets, the mean loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def reset_parameters(self) -> None:
        """Re-initialise every submodule (the GPT itself owns no parameters directly)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # head tied to the token embedding
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
