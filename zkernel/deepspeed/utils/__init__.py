"""DeepSpeed's ``deepspeed.utils`` over zkernel: a parameter's full fp32 master, optimizer state and
gradient (`tensor_fragment`), and the offline checkpoint converter (`zero_to_fp32`).

    from zkernel.deepspeed.utils import safe_get_full_grad, safe_get_full_fp32_param
    engine.backward(loss)
    for name, p in engine.module.named_parameters():
        grad = safe_get_full_grad(p)                   # collective: every rank, same order
    engine.step()
    exp_avg = safe_get_full_optimizer_state(p, "exp_avg")

    python -m zkernel.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR

The parameters are the model's own (``engine.module.named_parameters()``) of an engine
`zkernel.deepspeed.initialize` built, under any partitioner and offload tier.
"""

from __future__ import annotations

from zkernel.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]
