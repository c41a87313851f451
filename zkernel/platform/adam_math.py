"""Adam/AdamW arithmetic in plain torch, for any device: undoing one step.

`adam_rollback` undoes one step of `torch.optim.Adam` / `torch.optim.AdamW`
(``amsgrad=False``, ``maximize=False``; the for-loop, foreach and fused
implementations alike) in place, on CPU or CUDA tensors. It is the torch
counterpart of `zkernel.platform.native.adam_rollback` (same arguments, less
``threads``) for the ``adamw`` optimizer, whose state may live on the device.
The step runs backwards:

    d = sqrt(v) / sqrt(1 - beta2^step) + eps      (as the step computed it)
    p = p + lr / (1 - beta1^step) * m / d
    p = p / (1 - lr * weight_decay)                AdamW only
    g = grad * grad_scale (+ weight_decay * p)     the L2 term from the restored p
    m = (m - (1 - beta1) * g) / beta1
    v = max(0, (v - (1 - beta2) * g^2) / beta2)

The result is the pre-step state to within a few ulps of the values involved
(see [Note: rollback error] in native/cpu_adam.cpp; torch's kernels round a
little differently from the native one, the bound is the same in kind), and
exact zeros where the step started from zeros and left exactly its own
gradient terms (torch's for-loop and foreach steps do). The caller decrements
its own step counter (``state["step"] -= 1``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["adam_rollback", "check_rollback_possible"]

TensorOrTensors = torch.Tensor | Sequence[torch.Tensor]


def check_rollback_possible(*, lr: float, betas: tuple[float, float], weight_decay: float, adamw: bool) -> None:
    """Raise ValueError if a step with these hyperparameters overwrote state and cannot be undone.

    ``betas[0] == 0`` replaces exp_avg by the gradient, ``betas[1] == 0``
    replaces exp_avg_sq by its square, and AdamW with ``lr * weight_decay == 1``
    zeroes the parameters. Callers check this before stepping speculatively.
    """
    beta1, beta2 = float(betas[0]), float(betas[1])
    if beta1 == 0.0:
        raise ValueError(
            f"cannot roll back a step with beta1={beta1}: it replaced exp_avg by the gradient, "
            "so the old exp_avg is gone (do not step speculatively with beta1 == 0)"
        )
    if beta2 == 0.0:
        raise ValueError(
            f"cannot roll back a step with beta2={beta2}: it replaced exp_avg_sq by the squared gradient, "
            "so the old exp_avg_sq is gone (do not step speculatively with beta2 == 0)"
        )
    if adamw and weight_decay != 0.0 and 1.0 - float(lr) * float(weight_decay) == 0.0:
        raise ValueError(
            f"cannot roll back an AdamW step with lr * weight_decay = {float(lr) * float(weight_decay)}: "
            "its decay factor 1 - lr * weight_decay is 0, so the step zeroed the parameters "
            "(do not step speculatively with lr * weight_decay == 1)"
        )


def _as_list(name: str, value: TensorOrTensors) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    tensors = list(value)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a tensor or a sequence of tensors, got an element of type {type(t).__name__}"
            )
    return tensors


def adam_rollback(
    param: TensorOrTensors,
    grad: TensorOrTensors,
    exp_avg: TensorOrTensors,
    exp_avg_sq: TensorOrTensors,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    adamw: bool = True,
) -> None:
    """Undo one Adam (``adamw=False``: L2) or AdamW step in place.

    ``param``, ``grad``, ``exp_avg``, ``exp_avg_sq``: one tensor each, or
    equal-length sequences of them (one foreach pass over all). The state
    tensors are what the step left; ``grad`` is the gradient it used
    (unchanged since; any floating dtype, widened to the parameter's), and
    ``step`` the count of the step undone. Raises ValueError when the step
    cannot be undone (`check_rollback_possible`) or the tensors do not match.
    """
    params = _as_list("param", param)
    grads = _as_list("grad", grad)
    exp_avgs = _as_list("exp_avg", exp_avg)
    exp_avg_sqs = _as_list("exp_avg_sq", exp_avg_sq)
    lengths = {len(params), len(grads), len(exp_avgs), len(exp_avg_sqs)}
    if len(lengths) != 1:
        raise ValueError(
            "param, grad, exp_avg and exp_avg_sq must have as many tensors each, got "
            f"{len(params)}, {len(grads)}, {len(exp_avgs)} and {len(exp_avg_sqs)}"
        )
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
            if t.shape != p.shape or t.device != p.device:
                raise ValueError(
                    f"{name}[{i}] has shape {tuple(t.shape)} on {t.device}; "
                    f"param[{i}] has shape {tuple(p.shape)} on {p.device}"
                )
        if not p.is_floating_point() or not g.is_floating_point():
            raise TypeError(f"param[{i}] and grad[{i}] must be floating point, got {p.dtype} and {g.dtype}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count of the step being undone), got {step}")
    check_rollback_possible(lr=lr, betas=betas, weight_decay=weight_decay, adamw=adamw)
    if not params:
        return
    beta1, beta2 = float(betas[0]), float(betas[1])
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)

    # The step's denominator and update, recomputed from the state it left.
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)
    del denom
    if adamw and weight_decay != 0.0:
        torch._foreach_div_(params, 1.0 - lr * weight_decay)

    g = [gr.to(dtype=p.dtype) for gr, p in zip(grads, params)]
    g = torch._foreach_mul(g, float(grad_scale))  # a new list: grad is never written
    if not adamw and weight_decay != 0.0:
        torch._foreach_add_(g, params, alpha=weight_decay)
    # State that started from zeros holds exactly the step's own gradient terms:
    # restore exact zeros there (see [Note: rollback error] in native/cpu_adam.cpp).
    m_term = torch._foreach_mul(g, 1.0 - beta1)
    from_zero_m = [torch.eq(m, t) for m, t in zip(exp_avgs, m_term)]
    del m_term
    v_term = torch._foreach_mul(g, 1.0 - beta2)
    torch._foreach_mul_(v_term, g)
    from_zero_v = [torch.eq(v, t) for v, t in zip(exp_avg_sqs, v_term)]
    del v_term
    torch._foreach_add_(exp_avgs, g, alpha=-(1.0 - beta1))
    torch._foreach_div_(exp_avgs, beta1)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=-(1.0 - beta2))
    torch._foreach_div_(exp_avg_sqs, beta2)
    torch._foreach_clamp_min_(exp_avg_sqs, 0.0)
    for m, mask in zip(exp_avgs, from_zero_m):
        m.masked_fill_(mask, 0.0)
    for v, mask in zip(exp_avg_sqs, from_zero_v):
        v.masked_fill_(mask, 0.0)
