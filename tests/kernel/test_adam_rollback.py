"""Undoing a CPU Adam step (`zkernel.platform.native.adam_rollback`), as speculative steps need it.

Tolerance of a step-then-rollback round trip: an element may differ from its
pre-step value by at most ``ULPS`` units of 2^-23 times the largest magnitude
the inverted expression involves (2^-23 * |x| bounds one ulp of x):
max(|p_old|, |p_new|) for p; max(|m_old|, |m_new|, (1-beta1)|g|) / beta1 for m;
max(v_old, v_new, (1-beta2) g^2) / beta2 for v, where |g| = |grad * scale|,
plus weight_decay * |p| for Adam's L2 term (its two parts can cancel, their
roundings do not). Each value passes through two or three roundings forward
and as many back, each worth half an ulp of its operands' scale, so a few ulps
is what inverting fp32 math can give ([Note: rollback error] in
native/cpu_adam.cpp). The worst elements measured over these tests are 1.9 ulp
(p), 1.5 (m) and 2.1 (v); ULPS = 4 leaves about 2x. A gradient scale off by
1e-6 in the rollback fails it (9 ulps). Relative to m_old itself the error can
be large where |(1-beta1) g| >> |m_old|: the step rounded those bits away.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.simd import simd_path, simd_paths  # noqa: F401 (simd_path: a fixture)
from zkernel.platform import native

N = 50_017  # odd: exercises the vector tails
ULPS = 4.0
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)




def _assert_within_ulps(name: str, got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    err = (got - want).abs()
    bound = ULPS * 2.0**-23 * scale
    worst = (err / scale.clamp_min(torch.finfo(torch.float32).tiny)).max().item() / 2.0**-23
    assert bool((err <= bound).all()), f"{name}: worst element is {worst:.2f} ulps of its scale (allowed {ULPS})"


def _history(steps: int, adamw: bool, grad_dtype: torch.dtype, seed: int):
    """p, m, v after ``steps`` AdamW/Adam steps on random gradients (a realistic state)."""
    gen = torch.Generator().manual_seed(seed)
    p, m, v = torch.randn(N, generator=gen) * 0.02, torch.zeros(N), torch.zeros(N)
    for step in range(1, steps + 1):
        g = torch.randn(N, generator=gen).to(grad_dtype)
        native.adam_step(p, g, m, v, step=step, adamw=adamw, **HYPER)
    return p, m, v, gen


def _assert_restored(before, after, restored, g: torch.Tensor, grad_scale: float, adamw: bool) -> None:
    (p0, m0, v0), (p1, m1, v1), (p, m, v) = before, after, restored
    beta1, beta2 = HYPER["betas"]
    # The magnitude of the gradient term: with L2 both of its parts, which may cancel.
    gs = g.float().abs() * grad_scale
    if not adamw:
        gs = gs + HYPER["weight_decay"] * p0.abs()
    _assert_within_ulps("param", p, p0, torch.maximum(p0.abs(), p1.abs()))
    _assert_within_ulps(
        "exp_avg", m, m0, torch.maximum(torch.maximum(m0.abs(), m1.abs()), (1 - beta1) * gs) / beta1
    )
    _assert_within_ulps(
        "exp_avg_sq", v, v0, torch.maximum(torch.maximum(v0, v1), (1 - beta2) * gs * gs) / beta2
    )
    assert bool((v >= 0).all())


@pytest.mark.parametrize("simd_path", simd_paths(), indirect=True)
@pytest.mark.parametrize("history", [0, 100], ids=["fresh", "history100"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["f32_grad", "bf16_grad"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_step_then_rollback_restores_the_state(simd_path, history, grad_dtype, adamw):
    p, m, v, gen = _history(history, adamw, grad_dtype, seed=history + 7)
    before = (p.clone(), m.clone(), v.clone())
    g = (torch.randn(N, generator=gen) * 3).to(grad_dtype)
    grad_scale = 0.5
    step = history + 1
    native.adam_step(p, g, m, v, step=step, grad_scale=grad_scale, adamw=adamw, **HYPER)
    after = (p.clone(), m.clone(), v.clone())
    assert not torch.equal(after[0], before[0])
    g_copy = g.clone()
    native.adam_rollback(p, g, m, v, step=step, grad_scale=grad_scale, adamw=adamw, **HYPER)
    assert torch.equal(g, g_copy), "the gradient is read, never written"
    _assert_restored(before, after, (p, m, v), g, grad_scale, adamw)


def _assert_close_1e6(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # As in test_native_adam.py: relative 1e-6, plus 1e-6 of the tensor's scale
    # for elements near zero.
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


@pytest.mark.parametrize("new_scale", [0.3, 0.01], ids=["mild_clip", "strong_clip"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["f32_grad", "bf16_grad"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_rollback_then_redo_equals_the_direct_step(adamw, grad_dtype, new_scale):
    """What a speculative step needs: step at scale 1, undo, redo at the clip coefficient."""
    p, m, v, gen = _history(100, adamw, grad_dtype, seed=11)
    direct = (p.clone(), m.clone(), v.clone())
    g = torch.randn(N, generator=gen).to(grad_dtype)
    step = 101
    native.adam_step(p, g, m, v, step=step, grad_scale=1.0, adamw=adamw, **HYPER)
    native.adam_rollback(p, g, m, v, step=step, grad_scale=1.0, adamw=adamw, **HYPER)
    native.adam_step(p, g, m, v, step=step, grad_scale=new_scale, adamw=adamw, **HYPER)
    native.adam_step(*direct[:1], g, *direct[1:], step=step, grad_scale=new_scale, adamw=adamw, **HYPER)
    _assert_close_1e6(p, direct[0])
    _assert_close_1e6(m, direct[1])
    _assert_close_1e6(v, direct[2])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["f32_grad", "bf16_grad"])
def test_first_step_rollback_restores_exact_zeros(grad_dtype):
    """The first step (clipping is common there) or a never-touched embedding row: state from zeros.

    Any residue would be infinitely wrong relative to 0 and a strongly clipped
    redo would magnify it; the rollback gives back exact zeros, so the redo
    equals the direct step.
    """
    gen = torch.Generator().manual_seed(12)
    p0 = torch.randn(N, generator=gen) * 0.02
    g = (torch.randn(N, generator=gen) * 3).to(grad_dtype)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    native.adam_step(p, g, m, v, step=1, adamw=True, **HYPER)
    native.adam_rollback(p, g, m, v, step=1, adamw=True, **HYPER)
    assert not m.any() and not v.any()
    native.adam_step(p, g, m, v, step=1, grad_scale=1e-3, adamw=True, **HYPER)
    direct = [p0.clone(), torch.zeros(N), torch.zeros(N)]
    native.adam_step(direct[0], g, direct[1], direct[2], step=1, grad_scale=1e-3, adamw=True, **HYPER)
    _assert_close_1e6(p, direct[0])
    _assert_close_1e6(m, direct[1])
    _assert_close_1e6(v, direct[2])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_simd_paths_and_thread_counts_are_bitwise_identical(adamw, grad_dtype):
    gen = torch.Generator().manual_seed(3)
    n = 70_001  # several chunks of the thread pool, and a tail
    start = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen)]
    g = torch.randn(n, generator=gen).to(grad_dtype)
    results = {}
    try:
        for path in simd_paths():
            native.set_simd_path(path)
            for threads in (1, None):
                p, m, v = (t.clone() for t in start)
                native.adam_rollback(p, g, m, v, step=5, grad_scale=0.5, adamw=adamw, threads=threads, **HYPER)
                results[path, threads] = (p, m, v)
    finally:
        native.set_simd_path("auto")
    first = results["scalar", 1]
    for key, got in results.items():
        for a, b in zip(got, first):
            assert torch.equal(a, b), key


def test_zero_weight_decay_and_large_beta1():
    """No decay term at all, and torch's other lerp branch (1 - beta1 >= 0.5)."""
    hyper = dict(lr=1e-2, betas=(0.3, 0.9), eps=1e-6, weight_decay=0.0)
    gen = torch.Generator().manual_seed(5)
    p, m, v = torch.randn(N, generator=gen), torch.zeros(N), torch.zeros(N)
    for step in range(1, 21):
        native.adam_step(p, torch.randn(N, generator=gen), m, v, step=step, **hyper)
    before = (p.clone(), m.clone(), v.clone())
    g = torch.randn(N, generator=gen)
    native.adam_step(p, g, m, v, step=21, **hyper)
    p1, m1, v1 = p.clone(), m.clone(), v.clone()
    native.adam_rollback(p, g, m, v, step=21, **hyper)
    _assert_within_ulps("param", p, before[0], torch.maximum(before[0].abs(), p1.abs()))
    _assert_within_ulps("exp_avg", m, before[1],
                        torch.maximum(torch.maximum(before[1].abs(), m1.abs()), 0.7 * g.abs()) / 0.3)
    _assert_within_ulps("exp_avg_sq", v, before[2], torch.maximum(torch.maximum(before[2], v1), 0.1 * g * g) / 0.9)


def test_steps_that_cannot_be_undone_are_refused():
    p, g, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8)
    kw = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="beta1=0.0: it replaced exp_avg by the gradient"):
        native.adam_rollback(p, g, m, v, **{**kw, "betas": (0.0, 0.999)})
    with pytest.raises(ValueError, match="beta2=0.0: it replaced exp_avg_sq"):
        native.adam_rollback(p, g, m, v, **{**kw, "betas": (0.9, 0.0)})
    with pytest.raises(ValueError, match="1 - lr \\* weight_decay is 0"):
        native.adam_rollback(p, g, m, v, **{**kw, "lr": 0.5, "weight_decay": 2.0})
    # The same lr * weight_decay == 1 is fine for Adam's L2 term, which does not scale p.
    native.adam_rollback(p, g, m, v, **{**kw, "lr": 0.5, "weight_decay": 2.0}, adamw=False)
    with pytest.raises(ValueError, match="step must be >= 1"):
        native.adam_rollback(p, g, m, v, **{**kw, "step": 0})
    with pytest.raises(TypeError, match="grad must have dtype float32, bfloat16"):
        native.adam_rollback(p, g.half(), m, v, **kw)
    with pytest.raises(ValueError, match="exp_avg_sq has 7 elements, expected 8"):
        native.adam_rollback(p, g, m, torch.zeros(7), **kw)
    with pytest.raises(ValueError, match="param must be contiguous"):
        native.adam_rollback(torch.zeros(16)[::2], g, m, v, **kw)
    # The kernel refuses on its own too, whoever calls it.
    with pytest.raises(ValueError, match="beta1 is 0"):
        native.load().adam_rollback(p.data_ptr(), g.data_ptr(), native.load().GradDtype.F32, m.data_ptr(),
                                    v.data_ptr(), 8, lr=1e-3, beta1=0.0, beta2=0.9, eps=1e-8,
                                    weight_decay=0.0, grad_scale=1.0, step=1, adamw=True)
