"""An fp32 master kept as its bf16 parameter plus a 16-bit low half: the encoding, for any device.

[Note: the master's low half] In a bf16 run every trainable element lives
twice: as the fp32 master the optimizer steps and as the bf16 parameter the
forward reads, which is the master rounded to nearest even. The parameter
already holds the master's upper 16 bits, give or take the rounding's carry,
so a tier may keep, beside it, only the master's lower 16 bits (``low``) and
rebuild the master exactly when the optimizer needs it: 2 bytes a parameter
instead of 4 (18 bytes of model states become 16).

The carry is read from the low half: an element rounds up exactly when its
low half is above 0x8000, or equals it (a tie) and the truncated upper half
is odd. A tie cannot be told apart from the parameter alone: both the even
truncation (kept) and the odd one (rounded up to it) give the same even
parameter and the same low half, so 65,537 masters round to each even bf16
value, one more than 16 bits tell apart. One bit per element (``ties``, set
where a tie was kept, i.e. the truncated upper half is even) settles it:
2.125 bytes an element in all. Decoding:

    carry  = low > 0x8000 or (low == 0x8000 and not tie)
    master = bits((param_bits - carry) << 16 | low)

which gives back every fp32 bit pattern whose rounding is ``param``:
infinities, signed zeros, subnormals (the rounding is the same integer
rounding on bit patterns) and NaN as a NaN. It holds only while ``param`` is
the master rounded to nearest even, so whoever writes the master writes the
parameter too (the step pipeline rounds every update into it; a tier that
stores a master outside a step writes its rounding into the parameter before
anything rebuilds it).

``ties`` is a packed bitmask: element ``i`` is bit ``i % 8`` (least
significant first) of byte ``i // 8``. CPU tensors go through the native
extension (one multi-threaded pass); CUDA tensors, where Triton is
importable, through one Triton kernel each way, again one pass over memory
([Note: the codec in Triton] in `zkernel.platform.split_master_triton`);
others, or CUDA without Triton, through torch operations in chunks, so the
temporaries stay small beside the tensors.
"""

from __future__ import annotations

import torch

from zkernel.platform import split_master_triton

__all__ = ["join_master", "split_master", "tie_bytes"]

_CHUNK = 1 << 24  # elements per chunk of the torch path (a multiple of 8)


def tie_bytes(numel: int) -> int:
    """Bytes of the ``ties`` bitmask of ``numel`` elements."""
    return (numel + 7) // 8


def _check(numel: int, **tensors: tuple[torch.Tensor, tuple[torch.dtype, ...], int]) -> torch.device:
    devices = set()
    for name, (tensor, dtypes, want) in tensors.items():
        if tensor.dtype not in dtypes:
            raise TypeError(f"{name} must be {' or '.join(map(str, dtypes))}, got {tensor.dtype}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(tensor.shape)}")
        if tensor.numel() != want:
            raise ValueError(f"{name} must have {want} elements for a master of {numel}, got {tensor.numel()}")
        devices.add(tensor.device)
    if len(devices) != 1:
        raise ValueError(f"the master's tensors must be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


def split_master(master: torch.Tensor, low: torch.Tensor, ties: torch.Tensor) -> None:
    """Write fp32 ``master``'s low half into ``low`` (int16) and its tie bits into ``ties`` (uint8,
    `tie_bytes` of them); see [Note: the master's low half]."""
    n = master.numel()
    device = _check(
        n, master=(master, (torch.float32,), n), low=(low, (torch.int16,), n), ties=(ties, (torch.uint8,), tie_bytes(n))
    )
    if device.type == "cpu":
        from zkernel.platform import native

        if native.has_split_master():
            native.split_master(master, low, ties)
            return
    elif split_master_triton.available(device):
        split_master_triton.split_master(master, low, ties)
        return
    weights = _bit_weights(device)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        bits = master[start:stop].view(torch.int32)
        low[start:stop].copy_(bits.to(torch.int16))
        tie = (bits & 0x1FFFF) == 0x8000
        ties[start // 8 : tie_bytes(stop)].copy_(_pack(tie, weights))


def join_master(high: torch.Tensor, low: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rebuild the fp32 master from its bf16 rounding ``high`` (the parameter), ``low`` and ``ties``
    into ``out`` (fp32); returns ``out``."""
    n = out.numel()
    device = _check(
        n,
        high=(high, (torch.bfloat16,), n),
        low=(low, (torch.int16,), n),
        ties=(ties, (torch.uint8,), tie_bytes(n)),
        out=(out, (torch.float32,), n),
    )
    if device.type == "cpu":
        from zkernel.platform import native

        if native.has_split_master():
            native.join_master(high, low, ties, out)
            return out
    elif split_master_triton.available(device):
        split_master_triton.join_master(high, low, ties, out)
        return out
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        lows = low[start:stop].to(torch.int32) & 0xFFFF
        kept = ((ties[start // 8 : tie_bytes(stop)].unsqueeze(1) >> shifts) & 1).reshape(-1)[: stop - start].bool()
        carry = (lows > 0x8000) | ((lows == 0x8000) & ~kept)
        upper = high[start:stop].view(torch.int16).to(torch.int32) - carry.to(torch.int32)
        out[start:stop].view(torch.int32).copy_((upper << 16) | lows)
    return out


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=device)


def _pack(bits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A bool tensor packed 8 to a byte, least significant first (the last byte zero-padded)."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)
