"""One Adam/AdamW update of a flat fp32 shard on the GPU in one Triton kernel, at memory bandwidth.

[Note: Adam at bandwidth] A ZeRO step on the GPU is memory-bound: per element
Adam reads the master, gradient and both moments and writes the master and the
moments back (28 bytes in fp32). torch's path for a zero3 shard is three
kernels: the gradient times the step's coefficient into a temporary (8 bytes
per element), the fused AdamW, and the compute-dtype copy the next gather
reads (6 bytes). Here the three are one pass: the kernel scales the gradient
in registers, updates, and writes the rounded copy beside the master, 30
bytes per element once, close to a copy's bandwidth (`bench/device_adam.py`;
BENCHMARKS.md, "Figures formerly in docstrings").

The arithmetic is torch's fused AdamW's, in fp32, with the bias corrections
computed on the host in double precision as torch does; torch's kernel does
some products in double, so results differ from it by a few roundings (the
test holds the master to 2e-6 relative). The bf16 copy is rounded to nearest,
as ``copy_`` rounds. The step counts stay on the device, where torch keeps
them (so checkpoints and rollback read them as before); the host keeps their
values beside them (`_adam_state.StepCounts`) and reads the device only when
something other than a step changed them (a checkpoint load).
"""

from __future__ import annotations

import math

import torch

BLOCK = 2048

_kernel = None


def available(device: torch.device) -> bool:
    """Whether this kernel can run on ``device`` (CUDA with Triton importable)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def adam_kernel(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, numel,
        lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, grad_scale, found_inf_ptr,
        DECOUPLED: tl.constexpr, HAS_COPY: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr,
    ):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        if HAS_FLAG:  # a set flag masks every load and store: the step changes nothing
            mask = mask & (tl.load(found_inf_ptr) == 0.0)
        param = tl.load(param_ptr + offsets, mask=mask)
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * grad_scale
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
        if DECOUPLED:
            param = param - lr * weight_decay * param
        else:
            grad = grad + weight_decay * param
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - step_size * exp_avg / denom
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        if HAS_COPY:
            tl.store(copy_ptr + offsets, param.to(copy_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    return adam_kernel


def adam_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    adamw: bool = True,
    copy_out: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam (``adamw=False``: L2) or AdamW update of ``master``, ``exp_avg`` and ``exp_avg_sq`` in
    place for step number ``step`` (1-based) from ``grad * grad_scale`` (``grad`` fp32 or lower, read
    only); the rounded result to ``copy_out`` when given. All flat, contiguous and on one CUDA
    device. ``found_inf``: None, or a one-element fp32 tensor on that device; where it is nonzero the
    step writes nothing (`zkernel.spec.groups.StepOptions.found_inf`). The arguments are `zkernel.platform.native.adam_step`'s, the host kernel's."""
    global _kernel
    numel = master.numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("copy_out", copy_out)):
        if t is not None and (t.numel() != numel or not t.is_contiguous() or t.device != master.device):
            raise ValueError(f"adam_step: {name} must be contiguous with {numel} elements on {master.device}, "
                             f"got {tuple(t.shape)} on {t.device}")
    if master.dtype != torch.float32 or exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise ValueError("adam_step: master and moments must be fp32")
    if found_inf is not None and (found_inf.numel() != 1 or found_inf.dtype != torch.float32 or found_inf.device != master.device):
        raise ValueError(f"adam_step: found_inf must be one fp32 element on {master.device}, got "
                         f"{tuple(found_inf.shape)} {found_inf.dtype} on {found_inf.device}")
    if numel == 0:
        return
    if _kernel is None:
        _kernel = _build()
    beta1, beta2 = betas
    with torch.cuda.device(master.device):
        _kernel[(math.ceil(numel / BLOCK),)](
            master, grad, exp_avg, exp_avg_sq, copy_out if copy_out is not None else master, numel,
            lr, beta1, beta2, eps, weight_decay,
            lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step), grad_scale,
            found_inf if found_inf is not None else master,
            DECOUPLED=adamw, HAS_COPY=copy_out is not None, HAS_FLAG=found_inf is not None, BLOCK=BLOCK, num_warps=8,
        )
