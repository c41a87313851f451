"""Host buffers for offload tiers: page-locked where CUDA can use it, exactly sized, counted.

Large, long-lived buffers (masters, optimizer state, landing buffers) come
from `zkernel.platform.aio.aligned_empty`: exact size (torch's caching host allocator
rounds to powers of two), aligned for O_DIRECT, and page-locked with
``cudaHostRegister`` when CUDA is available, so host-device copies of them run
at full speed and asynchronously. Without CUDA they are plain aligned memory.
Short-lived staging buffers use torch's caching pinned allocator instead.
"""

from __future__ import annotations

import torch

from zkernel.platform.aio import aligned_empty


def host_empty(shape: int | tuple[int, ...], dtype: torch.dtype, *, pin: bool | None = None) -> torch.Tensor:
    """An uninitialised host tensor (page-locked when ``pin``, or when None and CUDA is available)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for d in shape:
        numel *= d
    return aligned_empty(numel, dtype, pin=pin).view(shape)


def host_zeros(shape: int | tuple[int, ...], dtype: torch.dtype, *, pin: bool | None = None) -> torch.Tensor:
    return host_empty(shape, dtype, pin=pin).zero_()
