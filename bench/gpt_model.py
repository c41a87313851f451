"""The anchors' GPT: plain torch, pre-LayerNorm, fused qkv, SDPA causal, tanh-GELU MLP 4x, tied embeddings."""

from __future__ import annotations


import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

PRESETS = {
    "tiny": dict(dim=256, layers=4, heads=4),
    "350m": dict(dim=1024, layers=24, heads=16),
    "1.3b": dict(dim=2048, layers=24, heads=16),
    "6.7b": dict(dim=4096, layers=32, heads=32),
    "13b": dict(dim=5120, layers=40, heads=40),
    "20b": dict(dim=6144, layers=44, heads=48),
}
VOCAB = 50304


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, seq: int = 1024) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.checkpoint = False  # plain torch: recompute every block in backward
        self.tiled_loss = False  # head and loss through zkernel.tiled_cross_entropy: no whole logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        if self.tiled_loss:
            import zkernel

            return zkernel.tiled_cross_entropy(self.ln_f(x), self.wte.weight, targets)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def zkernel_train_step(engine, micro_batches):
    """One optimizer step of a zkernel engine on next-token micro-batches; returns the last one's loss."""
    for idx in micro_batches:  # step() counts micro-batches: it applies the optimizer at the last
        loss = engine(idx, torch.roll(idx, -1, 1))
        engine.backward(loss)
        engine.step()
    return loss


def learnable_sequences(batch: int, seq: int, vocab: int, device, generator) -> torch.Tensor:
    """Token sequences a model can learn from context: each counts up from a random start by a
    random stride (mod ``vocab``), so after two tokens the rest follow; the loss falls from
    ln(vocab) as the model learns it, where uniform random tokens would leave it flat."""
    start = torch.randint(0, vocab, (batch, 1), device=device, generator=generator)
    stride = torch.randint(1, 64, (batch, 1), device=device, generator=generator)
    return (start + stride * torch.arange(seq, device=device)) % vocab


def gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation of one module's own parameters (normal, std 0.02; zero biases): a
    loss near ln(vocab) at the start, where the modules' defaults (unit-variance tied embeddings)
    start it in the thousands. Usable as `zkernel.initialize`'s ``init_fn`` and with ``model.apply``."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def flops_per_token(model: GPT, seq: int) -> float:
    n = sum(p.numel() for p in model.parameters())
    layers = len(model.blocks)
    dim = model.wte.embedding_dim
    return 6 * n + 12 * layers * dim * seq


def param_count(preset: str) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(**PRESETS[preset]).parameters())


