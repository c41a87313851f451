"""The Triton AdamW kernel of the ``adamw`` optimizer against torch's fused AdamW on the same GPU."""

from __future__ import annotations

import pytest
import torch
from torch.optim import adam as torch_adam
from torch.optim import adamw as torch_adamw

from zkernel_plugins.optimizers import _triton_adam
from zkernel_plugins.optimizers._adam_state import StepCounts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not _triton_adam.available(torch.device("cuda")), reason="needs CUDA and Triton"),
]

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_triton_adam_matches_torch_fused(decoupled, grad_dtype):
    """Three steps with a gradient scale and a bf16 copy: master and moments as torch's fused kernel
    leaves them (to a few roundings: torch does parts of the arithmetic in double), the copy the
    master rounded to nearest, the step count advanced."""
    numel = 1_000_003  # not a multiple of the block: the tail is masked
    gen = torch.Generator(device="cuda").manual_seed(0)
    master = torch.randn(numel, device="cuda", generator=gen)
    ours = [master.clone(), torch.zeros_like(master), torch.zeros_like(master)]
    ref = [master.clone(), torch.zeros_like(master), torch.zeros_like(master)]
    ref_step = torch.zeros((), device="cuda")
    copy = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    step_fn = torch_adamw.adamw if decoupled else torch_adam.adam
    for step in range(1, 4):
        grad = torch.randn(numel, device="cuda", generator=gen).to(grad_dtype)
        _triton_adam.adam_step(*ours[:1], grad, *ours[1:], step=step, grad_scale=0.5, adamw=decoupled, copy_out=copy, **HYPER)
        step_fn(
            [ref[0]], [grad.float() * 0.5], [ref[1]], [ref[2]], [], [ref_step], amsgrad=False,
            beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
            eps=HYPER["eps"], maximize=False, fused=True,
        )
    assert int(ref_step.item()) == 3
    rounded = ours[0].to(torch.bfloat16)
    assert torch.equal(copy, rounded), f"{int((copy != rounded).sum())} of {numel} rounded differently"
    torch.testing.assert_close(ours[0], ref[0], rtol=2e-6, atol=1e-7, msg="master")
    for name, a, b in zip(("exp_avg", "exp_avg_sq"), ours[1:], ref[1:]):  # near zero: absolute
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()), msg=name)


def test_step_counts_follow_changes_made_elsewhere():
    """Per-parameter counts on the device: the host's copy follows its own changes without reading
    the device, and a tensor changed behind its back (a checkpoint load) is re-read."""
    step, counts = torch.zeros(4, device="cuda"), StepCounts()
    counts.add(step, None, 1)
    counts.add(step, frozenset({0, 2, 3}), 1)
    assert counts.read(step) == [2, 1, 2, 2] and step.tolist() == [2, 1, 2, 2]
    counts.add(step, frozenset({2, 3}), -1)  # a rollback
    assert counts.read(step) == [2, 1, 1, 1] == step.tolist()
    step.fill_(41)  # a checkpoint load
    assert counts.read(step) == [41] * 4


def test_adam_step_rejects_mismatched_tensors():
    master = torch.zeros(8, device="cuda")
    with pytest.raises(ValueError, match="grad must be contiguous with 8 elements"):
        _triton_adam.adam_step(master, torch.zeros(7, device="cuda"), master.clone(), master.clone(), step=1, **HYPER)


def test_triton_adam_with_the_found_inf_flag_set_writes_nothing():
    """[Note: a non-finite flag read one step late]: a set flag masks every store (master, moments, the
    copy), decided on the device; a clear flag steps as without one."""
    numel = 5_003
    gen = torch.Generator(device="cuda").manual_seed(1)
    master = torch.randn(numel, device="cuda", generator=gen)
    grad = torch.randn(numel, device="cuda", generator=gen)
    grad[7] = float("nan")
    state = [master.clone(), torch.rand(numel, device="cuda", generator=gen), torch.rand(numel, device="cuda", generator=gen)]
    copy = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")
    before = [t.clone() for t in state]
    flag = torch.ones((), device="cuda")
    _triton_adam.adam_step(*state[:1], grad, *state[1:], step=2, copy_out=copy, found_inf=flag, **HYPER)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), state, before):
        assert torch.equal(a, b), name
    assert not copy.any()
    grad[7] = 0.0
    flag.zero_()
    clean = [t.clone() for t in before]
    _triton_adam.adam_step(*state[:1], grad, *state[1:], step=2, copy_out=copy, found_inf=flag, **HYPER)
    _triton_adam.adam_step(*clean[:1], grad, *clean[1:], step=2, **HYPER)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), state, clean):
        assert torch.equal(a, b), name
