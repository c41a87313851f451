"""The Triton kernels of `zkernel.platform.split_master_triton` ([Note: the codec in Triton] there).

Imported by `split_master_triton` on the first split or join of a CUDA tensor (this module imports
Triton), never when `zkernel` is imported. ``split_kernel`` and ``join_kernel`` are launched over
``ceil(numel / BLOCK)`` programs; ``split_rows`` and ``join_rows`` are one block's work, masked or not.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_rows(master_ptr, low_ptr, ties_ptr, rows, numel, MASKED: tl.constexpr):
    offsets = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    if MASKED:
        mask = offsets < numel
        bits = tl.load(master_ptr + offsets, mask=mask, other=0)
        tl.store(low_ptr + offsets, bits.to(tl.int16), mask=mask)
    else:
        bits = tl.load(master_ptr + offsets)
        tl.store(low_ptr + offsets, bits.to(tl.int16))
    tie = ((bits & 0x1FFFF) == 0x8000).to(tl.int32)
    packed = tl.sum(tie << tl.arange(0, 8)[None, :], axis=1).to(tl.uint8)
    if MASKED:
        tl.store(ties_ptr + rows, packed, mask=rows * 8 < numel)
    else:
        tl.store(ties_ptr + rows, packed)


@triton.jit
def split_kernel(master_ptr, low_ptr, ties_ptr, numel, BLOCK: tl.constexpr):
    # master_ptr: the master's bits as int32.
    block = tl.program_id(0).to(tl.int64)
    rows = block * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    if (block + 1) * BLOCK <= numel:  # a whole block: loads and stores without masks, in vectors
        split_rows(master_ptr, low_ptr, ties_ptr, rows, numel, MASKED=False)
    else:
        split_rows(master_ptr, low_ptr, ties_ptr, rows, numel, MASKED=True)


@triton.jit
def join_rows(high_ptr, low_ptr, ties_ptr, out_ptr, rows, numel, MASKED: tl.constexpr):
    offsets = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    if MASKED:
        mask = offsets < numel
        lows = tl.load(low_ptr + offsets, mask=mask, other=0)
        tie_byte = tl.load(ties_ptr + rows, mask=rows * 8 < numel, other=0)
        high = tl.load(high_ptr + offsets, mask=mask, other=0)
    else:
        lows = tl.load(low_ptr + offsets)
        tie_byte = tl.load(ties_ptr + rows)
        high = tl.load(high_ptr + offsets)
    lows = lows.to(tl.int32) & 0xFFFF
    kept = (tie_byte.to(tl.int32)[:, None] >> tl.arange(0, 8)[None, :]) & 1
    carry = (lows > 0x8000) | ((lows == 0x8000) & (kept == 0))
    bits = ((high.to(tl.int32) - carry.to(tl.int32)) << 16) | lows
    if MASKED:
        tl.store(out_ptr + offsets, bits, mask=mask)
    else:
        tl.store(out_ptr + offsets, bits)


@triton.jit
def join_kernel(high_ptr, low_ptr, ties_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    # high_ptr: the parameter's bits as int16; out_ptr: the master's bits as int32.
    block = tl.program_id(0).to(tl.int64)
    rows = block * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    if (block + 1) * BLOCK <= numel:
        join_rows(high_ptr, low_ptr, ties_ptr, out_ptr, rows, numel, MASKED=False)
    else:
        join_rows(high_ptr, low_ptr, ties_ptr, out_ptr, rows, numel, MASKED=True)
