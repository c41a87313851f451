"""The native kernels' SIMD paths this CPU runs, for tests that compare them."""

from __future__ import annotations

import pytest

from zkernel.platform import native


def simd_paths() -> list[str]:
    """Every path up to the best this CPU supports: "scalar", then "avx2", then "avx512"."""
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(native.best_simd_path()) + 1]


@pytest.fixture
def simd_path(request):
    """The native kernels set to the path ``request.param`` for one test, then back to the best."""
    native.set_simd_path(request.param)
    yield request.param
    native.set_simd_path("auto")
