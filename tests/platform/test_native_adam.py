"""The native CPU Adam kernel against torch.optim.Adam/AdamW as the oracle.

torch's own CPU sqrt is not correctly rounded (about 1 element in 5 is off by
one ulp on an AVX-512 build) while the kernel's is, so the comparison is to
relative 1e-6, not bitwise; the kernel's SIMD paths are compared bitwise with
each other.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.simd import simd_path, simd_paths  # noqa: F401 (simd_path: a fixture)
from zkernel.platform import native

N = 50_017  # odd: exercises the SIMD tails




def _assert_close_1e6(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Relative 1e-6 per element, plus 1e-6 of the tensor's scale for values that
    # cross zero (an ulp of drift is unbounded relative to a value near 0).
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


@pytest.mark.parametrize("simd_path", simd_paths(), indirect=True)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_100_steps_match_torch(simd_path, adamw):
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(N, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = cls([ref], **hyper, foreach=False)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    for step in range(1, 101):
        g = torch.randn(N, generator=gen)
        ref.grad = g.clone()
        opt.step()
        native.adam_step(p, g, m, v, step=step, adamw=adamw, **hyper)
    state = opt.state[ref]
    _assert_close_1e6(p, ref.detach())
    _assert_close_1e6(m, state["exp_avg"])
    _assert_close_1e6(v, state["exp_avg_sq"])
    assert not torch.equal(p, p0)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_bf16_grads_scale_and_copy_out(out_dtype):
    """The offload step: bf16 grad * grad_scale, AdamW, params rounded out in the same pass."""
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(N, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt = torch.optim.AdamW([ref], **hyper, foreach=False)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    out = torch.empty(N, dtype=out_dtype)
    for step in range(1, 31):
        g16 = (torch.randn(N, generator=gen) * 1024).to(torch.bfloat16)
        scale = 1.0 / (1024 * (1 + step % 3))
        ref.grad = g16.float() * scale
        opt.step()
        native.adam_step(p, g16, m, v, step=step, grad_scale=scale, copy_out=out, **hyper)
        assert torch.equal(out, p.to(out_dtype)), "copy-out must be the fp32 result rounded"
    _assert_close_1e6(p, ref.detach())


@pytest.mark.parametrize("beta1", [0.9, 0.3], ids=["lerp_small_weight", "lerp_large_weight"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_simd_paths_are_bitwise_identical(beta1, grad_dtype):
    gen = torch.Generator().manual_seed(3)
    n = 4099
    start = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen)]
    g = torch.randn(n, generator=gen).to(grad_dtype)
    results = {}
    try:
        for path in simd_paths():
            native.set_simd_path(path)
            p, m, v = (t.clone() for t in start)
            out = torch.empty(n + 1, dtype=torch.bfloat16)[1:]  # misaligned: no streaming stores
            native.adam_step(p, g, m, v, step=5, lr=1e-2, betas=(beta1, 0.99), eps=1e-6,
                             weight_decay=0.05, grad_scale=0.5, adamw=False, copy_out=out)
            assert torch.equal(out, p.to(torch.bfloat16))
            results[path] = (p, m, v, out)
    finally:
        native.set_simd_path("auto")
    first = results["scalar"]
    for path, got in results.items():
        for a, b in zip(got, first):
            assert torch.equal(a, b), path


def test_lerp_large_weight_matches_torch():
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(N, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.3, 0.9), foreach=False)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    for step in range(1, 21):
        g = torch.randn(N, generator=gen)
        ref.grad = g
        opt.step()
        native.adam_step(p, g, m, v, step=step, lr=1e-2, betas=(0.3, 0.9), eps=1e-8, weight_decay=1e-2)
    _assert_close_1e6(p, ref.detach())


@pytest.mark.parametrize("simd_path", simd_paths(), indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_edge_cases_match_torch(simd_path, dtype):
    special = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38,
         65504.0, 65520.0, 6e-8, 1e-8, 2.0**-24, 2.0**-25],
        dtype=torch.float32,
    )
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F817FFF, 0x7F7FFFFF, 0x00008000, 0x3F7FFFFF],
                        dtype=torch.int32).view(torch.float32)  # bf16 ties and near-ties
    gen = torch.Generator().manual_seed(5)
    src = torch.cat([special, bits, torch.randn(1000, generator=gen) * 100, torch.randn(1000, generator=gen) * 1e-6])
    dst = torch.empty(src.numel(), dtype=dtype)
    native.convert_f32(src, dst)
    assert torch.equal(dst.view(torch.int16), src.to(dtype).view(torch.int16))
    nan = torch.tensor([float("nan")] * 17)
    out = torch.empty(17, dtype=dtype)
    native.convert_f32(nan, out)
    assert out.float().isnan().all()


def test_thread_count_does_not_change_results():
    gen = torch.Generator().manual_seed(6)
    n = 300_001
    start = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
    g = torch.randn(n, generator=gen)
    results = []
    for threads in (1, None):
        p, m, v = (t.clone() for t in start)
        native.adam_step(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                         threads=threads)
        results.append(p)
    assert torch.equal(results[0], results[1])
    assert native.threads() >= 1


def test_rejects_bad_tensors():
    p, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    kw = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with pytest.raises(TypeError, match="grad must have dtype float32, bfloat16"):
        native.adam_step(p, torch.zeros(8, dtype=torch.float16), m, v, **kw)
    with pytest.raises(ValueError, match="exp_avg has 7 elements, expected 8"):
        native.adam_step(p, torch.zeros(8), torch.zeros(7), v, **kw)
    with pytest.raises(ValueError, match="param must be contiguous"):
        native.adam_step(torch.zeros(16)[::2], torch.zeros(8), m, v, **kw)
    with pytest.raises(ValueError, match="step must be >= 1"):
        native.adam_step(p, torch.zeros(8), m, v, **{**kw, "step": 0})
    with pytest.raises(ValueError, match="does not support|unknown SIMD path"):
        native.set_simd_path("avx1024")


def test_missing_extension_names_the_build_step(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "zkernel._native", None)
    monkeypatch.setattr(native, "_module", None)
    with pytest.raises(native.NativeExtensionError, match=r"pip install -e \."):
        native.simd_path()
    assert not native.available()


def test_resizing_the_pool_right_after_it_starts_does_not_hang():
    """A worker that had not yet read the pool's generation slept through stop() and was joined forever."""
    import subprocess
    import sys

    code = "from zkernel.platform import native\nnative.set_threads(1)\nnative.set_threads(3)\nnative.set_threads(2)\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)  # hung every time before the fix


def test_stale_extension_names_the_rebuild(monkeypatch):
    import sys
    import types

    stale = types.ModuleType("zkernel._native")
    stale.abi_version = lambda: native.ABI_VERSION - 1
    monkeypatch.setitem(sys.modules, "zkernel._native", stale)
    monkeypatch.setattr(native, "_module", None)
    with pytest.raises(native.NativeExtensionError, match="out of date .*rebuild it"):
        native.simd_path()


def test_ranks_sharing_a_host_split_its_cores(monkeypatch):
    import os

    from zkernel.platform import native

    monkeypatch.delenv("ZKERNEL_NATIVE_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    before = native.threads()
    try:
        native.share_cores(2)
        assert native.threads() == max(1, cores // 2)
        native.share_cores(cores * 4)
        assert native.threads() == 1
        native.set_threads(before)
        monkeypatch.setenv("ZKERNEL_NATIVE_THREADS", "3")
        native.share_cores(2)  # the user's setting wins
        assert native.threads() == before
    finally:
        native.set_threads(before)
