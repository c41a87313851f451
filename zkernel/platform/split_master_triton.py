"""The split master's codec on CUDA: one Triton kernel splits, one joins, each one pass over memory.

[Note: the codec in Triton] `zkernel.platform.split_master` encodes an fp32
master as its bf16 rounding, its low half and one tie bit an element ([Note:
the master's low half]). Both directions are integer arithmetic on bit
patterns, so on the GPU each is one memory-bound kernel: split reads 4 bytes
an element and writes 2 + 1/8, join reads 2 + 2 + 1/8 and writes 4 (the
torch path makes about ten passes over its chunks).

A program handles `BLOCK` elements (a multiple of 8) as ``BLOCK / 8`` rows
of 8: row ``r`` is byte ``r`` of ``ties``, so split packs a row's tie bits
with a sum over the row (bit ``i % 8``, least significant first) and join
unpacks them with a shift, and no program touches another's bytes. A whole
block loads and stores without masks, so in 16-byte vectors; only the last,
partial block is masked, its elements past the end loaded as zero bits, which
are no tie, so the last byte's padding bits are written as zeros. Offsets are
64-bit (a flat share can exceed 2**31 elements). The kernels take the
tensors' own pointers, so views at any storage offset work (a pointer that is
not 16-byte aligned gets a variant without vectors), and they run on the
current stream of the tensors' device.

Under Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before
Triton is imported) the same kernels run on CPU tensors, which is how the
tests check them on a machine without a GPU.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["BLOCK", "NUM_WARPS", "available", "join_master", "split_master"]

BLOCK = 4096  # elements a program splits or joins (a multiple of 8: its tie bytes are its own)
NUM_WARPS = 8


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether these kernels can run on ``device`` (CUDA with Triton importable); asked by
    `zkernel.platform.split_master` on every call, to choose its path."""
    return device.type == "cuda" and _triton_importable()


@functools.cache
def _build():
    from zkernel.platform import _split_master_kernels  # imports Triton, on the first split or join

    return _split_master_kernels.split_kernel, _split_master_kernels.join_kernel


def _launch(kernel, numel: int, device: torch.device, *args: torch.Tensor) -> None:
    if numel == 0:
        return
    grid = ((numel + BLOCK - 1) // BLOCK,)
    if device.type != "cuda":  # Triton's interpreter
        kernel[grid](*args, numel, BLOCK=BLOCK, num_warps=NUM_WARPS)
        return
    with torch.cuda.device(device):
        kernel[grid](*args, numel, BLOCK=BLOCK, num_warps=NUM_WARPS)


def split_master(master: torch.Tensor, low: torch.Tensor, ties: torch.Tensor) -> None:
    """Write fp32 ``master``'s low half into ``low`` (int16) and its packed tie bits into ``ties``
    (uint8, ``(numel + 7) // 8`` of them), queued on the current stream.

    Called by `zkernel.platform.split_master.split_master` for CUDA tensors, which has checked the
    dtypes, lengths, contiguity and device."""
    split_kernel, _ = _build()
    _launch(split_kernel, master.numel(), master.device, master.view(torch.int32), low, ties)


def join_master(high: torch.Tensor, low: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> None:
    """Rebuild fp32 masters into ``out`` from their bf16 rounding ``high``, ``low`` (int16) and
    ``ties`` (uint8, packed), queued on the current stream.

    Called by `zkernel.platform.split_master.join_master` for CUDA tensors, which has checked the
    dtypes, lengths, contiguity and device."""
    _, join_kernel = _build()
    _launch(join_kernel, out.numel(), out.device, high.view(torch.int16), low, ties, out.view(torch.int32))
