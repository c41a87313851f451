"""`zkernel.platform.adam_math.adam_rollback` against torch.optim.Adam/AdamW as the oracle.

torch steps, the rollback undoes the step, and the state must equal what was
saved before it. torch's kernels (for-loop, foreach, fused) round differently
from one another and from the rollback's foreach ops, so the bound is wider
than the native kernel's (tests/kernel/test_adam_rollback.py): ULPS = 6 units of
2^-23 times the largest magnitude each inverted expression involves (the same
scales as there). The worst elements measured on CPU (torch 2.13): 1.0 ulp for
the for-loop and foreach steps, 2.4 (p) and 1.3 (v) after the fused one.
"""

from __future__ import annotations

import pytest
import torch

from zkernel.platform import native
from zkernel.platform.adam_math import adam_rollback, check_rollback_possible

ULPS = 6.0
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [(257, 3), (1000,), (), (5, 7, 11)]  # odd sizes and a 0-dim parameter


def _assert_within_ulps(name: str, got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    err = (got - want).abs().float()
    scale = scale.float()
    bound = ULPS * 2.0**-23 * scale
    worst = (err / scale.clamp_min(torch.finfo(torch.float32).tiny)).max().item() / 2.0**-23
    assert bool((err <= bound).all()), f"{name}: worst element is {worst:.2f} ulps of its scale (allowed {ULPS})"


def _optimizer(params, adamw: bool, impl: str) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    flags = {"for_loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    return cls(params, **HYPER, **flags)


def _train(params, opt, gen, steps: int) -> None:
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device)
        opt.step()


def _check_restored(before, after, restored, grads, adamw: bool) -> None:
    beta1, beta2 = HYPER["betas"]
    for (p0, m0, v0), (p1, m1, v1), (p, m, v), g in zip(before, after, restored, grads):
        g_mag = g.abs() + (0 if adamw else HYPER["weight_decay"] * p0.abs())
        _assert_within_ulps("param", p, p0, torch.maximum(p0.abs(), p1.abs()))
        m_scale = torch.maximum(torch.maximum(m0.abs(), m1.abs()), (1 - beta1) * g_mag) / beta1
        v_scale = torch.maximum(torch.maximum(v0, v1), (1 - beta2) * g_mag**2) / beta2
        _assert_within_ulps("exp_avg", m, m0, m_scale)
        _assert_within_ulps("exp_avg_sq", v, v0, v_scale)
        assert bool((v >= 0).all())


def _snapshot(params, opt):
    return [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for p in params]


def _run_round_trip(device: str, adamw: bool, impl: str, history: int) -> None:
    gen = torch.Generator().manual_seed(history + 3)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in SHAPES]
    opt = _optimizer(params, adamw, impl)
    _train(params, opt, gen, history)
    if history == 0:  # torch creates the state lazily: the pre-step state is zeros
        before = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    else:
        before = _snapshot(params, opt)
    _train(params, opt, gen, 1)
    after = _snapshot(params, opt)
    grads = [p.grad.clone() for p in params]
    step = int(opt.state[params[0]]["step"].item())
    assert step == history + 1
    adam_rollback(
        [p.detach() for p in params],
        [p.grad for p in params],
        [opt.state[p]["exp_avg"] for p in params],
        [opt.state[p]["exp_avg_sq"] for p in params],
        step=step,
        adamw=adamw,
        **HYPER,
    )
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads)), "the gradient is read, never written"
    restored = _snapshot(params, opt)
    _check_restored(before, after, restored, grads, adamw)
    if history == 0 and adamw:  # from zeros: exact zeros back (Adam's L2 term depends on the restored p)
        assert all(not m.any() and not v.any() for _, m, v in restored)


@pytest.mark.parametrize("history", [0, 30], ids=["first_step", "history30"])
@pytest.mark.parametrize("impl", ["for_loop", "foreach", "fused"])
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam_L2"])
def test_rollback_undoes_a_torch_step(adamw, impl, history):
    _run_round_trip("cpu", adamw, impl, history)


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam_L2"])
def test_rollback_undoes_a_torch_step_on_cuda(adamw, impl):
    _run_round_trip("cuda", adamw, impl, history=30)


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam_L2"])
def test_rollback_then_redo_equals_the_direct_step(adamw):
    """The speculative pattern with torch's optimizer: step, undo, clip the gradient, step again."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(300, 7), (33,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, twin_opt = _optimizer(params, adamw, "foreach"), _optimizer(twins, adamw, "foreach")
    for _ in range(50):
        for p, t in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            t.grad = p.grad.clone()
        opt.step()
        twin_opt.step()
    for p, t in zip(params, twins):
        p.grad = torch.randn(p.shape, generator=gen) * 10
        t.grad = p.grad.clone()
    opt.step()  # speculative, with the unclipped gradient
    step = int(opt.state[params[0]]["step"].item())
    adam_rollback(
        [p.detach() for p in params], [p.grad for p in params],
        [opt.state[p]["exp_avg"] for p in params], [opt.state[p]["exp_avg_sq"] for p in params],
        step=step, adamw=adamw, **HYPER,
    )
    for p in params:
        opt.state[p]["step"] -= 1
        p.grad.mul_(0.05)  # the clip coefficient, known now
    opt.step()
    for t in twins:
        t.grad.mul_(0.05)
    twin_opt.step()  # the direct step
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-6, atol=1e-6 * t.abs().max().item())
        for key in ("exp_avg", "exp_avg_sq"):
            want = twin_opt.state[t][key]
            torch.testing.assert_close(opt.state[p][key], want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_bf16_gradient_is_widened_and_grad_scale_applied():
    """A bf16 gradient with a scale, stepped by the native kernel (torch's math, checked in
    test_native_adam.py) from a state of our choosing, undone in torch."""
    gen = torch.Generator().manual_seed(2)
    p0, m0, v0 = torch.randn(999, generator=gen), torch.randn(999, generator=gen) * 0.1, torch.rand(999, generator=gen)
    g = torch.randn(999, generator=gen).to(torch.bfloat16)
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    native.adam_step(p, g, m, v, step=4, grad_scale=0.25, **HYPER)
    after = (p.clone(), m.clone(), v.clone())
    adam_rollback(p, g, m, v, step=4, grad_scale=0.25, **HYPER)
    _check_restored([(p0, m0, v0)], [after], [(p, m, v)], [g.float() * 0.25], adamw=True)


def test_errors():
    t = torch.zeros(4)
    kw = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="beta1=0.0"):
        adam_rollback(t, t, t, t, **{**kw, "betas": (0.0, 0.9)})
    with pytest.raises(ValueError, match="beta2=0.0"):
        adam_rollback(t, t, t, t, **{**kw, "betas": (0.9, 0.0)})
    with pytest.raises(ValueError, match="1 - lr \\* weight_decay is 0"):
        check_rollback_possible(lr=0.1, betas=(0.9, 0.99), weight_decay=10.0, adamw=True)
    check_rollback_possible(lr=0.1, betas=(0.9, 0.99), weight_decay=10.0, adamw=False)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam_rollback(t, t, t, t, **{**kw, "step": 0})
    with pytest.raises(ValueError, match="as many tensors each, got 2, 1, 1 and 1"):
        adam_rollback([t, t], [t], [t], [t], **kw)
    with pytest.raises(ValueError, match=r"exp_avg\[0\] has shape \(3,\)"):
        adam_rollback(t, t, torch.zeros(3), t, **kw)
    with pytest.raises(TypeError, match="floating point"):
        adam_rollback(torch.zeros(4, dtype=torch.int64), t, t, t, **kw)
