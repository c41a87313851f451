"""The split master's Triton codec ([Note: the codec in Triton] in zkernel/platform/split_master_triton.py).

Without a GPU: the kernels under Triton's interpreter, in a process of their own, byte for byte
against the native codec and the torch path (tests/support/split_master_interpreted.py), and
compiled for a Hopper GPU, whole blocks in vector loads. On a GPU (``cuda``): every fp32 bit pattern
against the native codec, a master of more than 2**31 elements against the torch path, and
`zkernel.platform.split_master` choosing the kernels for CUDA tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support import split_master_interpreted as interpreted
from tests.support.paths import REPO
from zkernel.platform import native
from zkernel.platform import split_master as codec
from zkernel.platform import split_master_triton as triton_codec

pytest.importorskip("triton", reason="Triton is not installed (CI has none): the Triton split-master codec is untested here")
pytestmark = pytest.mark.skipif(not native.has_split_master(), reason="native extension not built (the reference)")


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, str | None]:
    """Every case of tests/support/split_master_interpreted.py, run once in a new interpreter with
    ``TRITON_INTERPRET=1`` (not one forked from the test session's fork server: Triton must not have
    been imported before the variable is set): case name -> None, or how it failed."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    result = subprocess.run(
        [sys.executable, interpreted.__file__], cwd=tmp_path_factory.mktemp("interpreted"), env=env,
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"the interpreted run failed ({result.returncode}):\n{result.stderr[-5000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(interpreted.cases()))
def test_interpreted_kernels_write_the_native_and_torch_paths_bytes(case, interpreted_results):
    assert case in interpreted_results, f"{case} did not run"
    assert interpreted_results[case] is None, interpreted_results[case]


def test_kernels_compile_for_hopper_with_vector_loads():
    """Compiled (no GPU needed) for sm_90 with 16-byte aligned pointers: a whole block's loads and stores
    of ``low`` and the master are 16-byte vectors (the unmasked branch), not one element at a time."""
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:
        pytest.skip(f"this Triton ({triton.__version__}) has no ahead-of-time compile API: {err}")
    from zkernel.platform import _split_master_kernels as kernels

    signatures = {
        kernels.split_kernel: {"master_ptr": "*i32", "low_ptr": "*i16", "ties_ptr": "*u8", "numel": "i64"},
        kernels.join_kernel: {"high_ptr": "*i16", "low_ptr": "*i16", "ties_ptr": "*u8", "out_ptr": "*i32", "numel": "i64"},
    }
    for kernel, signature in signatures.items():
        pointers = [(i,) for i, kind in enumerate(signature.values()) if kind.startswith("*")]
        source = ASTSource(
            fn=kernel,
            signature=signature | {"BLOCK": "constexpr"},
            constexprs={"BLOCK": triton_codec.BLOCK},
            attrs={p: [["tt.divisibility", 16]] for p in pointers},
        )
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": triton_codec.NUM_WARPS})
        ptx = compiled.asm["ptx"]
        assert "ld.global.v4.b32" in ptx, f"{kernel.fn.__name__} loads no 16-byte vectors"
        assert "st.global.v4.b32" in ptx, f"{kernel.fn.__name__} stores no 16-byte vectors"


# -- on a GPU ---------------------------------------------------------------------------------------


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.cuda
def test_every_fp32_bit_pattern_matches_the_native_codec_on_the_gpu():
    """All 2**32 patterns, 2**26 at a time: Triton's low halves and tie bits are the native codec's
    bytes, its join of the parameter (torch's bf16 rounding) is the native join's bits, and that is
    the master back (a NaN as a NaN), as the CPU test of the native codec asserts."""
    chunk = 1 << 26
    device = torch.device("cuda")
    bits = torch.arange(chunk, dtype=torch.int32, device=device)
    master = bits.view(torch.float32)
    low = torch.empty(chunk, dtype=torch.int16, device=device)
    ties = torch.empty(chunk // 8, dtype=torch.uint8, device=device)
    out = torch.empty(chunk, device=device)
    host = {
        "master": torch.empty(chunk, pin_memory=True),
        "high": torch.empty(chunk, dtype=torch.bfloat16, pin_memory=True),
        "low": torch.empty(chunk, dtype=torch.int16, pin_memory=True),
        "ties": torch.empty(chunk // 8, dtype=torch.uint8, pin_memory=True),
        "out": torch.empty(chunk, pin_memory=True),
    }
    for start in range(0, 1 << 32, chunk):
        if start:
            bits.add_(chunk)  # wraps from 0x7FFFFFFF to -2**31 (0x80000000) half way
        high = master.to(torch.bfloat16)
        low.fill_(-1)
        ties.fill_(0xFF)
        triton_codec.split_master(master, low, ties)
        triton_codec.join_master(high, low, ties, out)
        host["master"].copy_(master)
        host["high"].copy_(high)
        native.split_master(host["master"], host["low"], host["ties"])
        native.join_master(host["high"], host["low"], host["ties"], host["out"])
        assert _same(low, host["low"].to(device)), f"low halves of the patterns from {start:#010x}"
        assert _same(ties, host["ties"].to(device)), f"tie bits of the patterns from {start:#010x}"
        assert _same(out, host["out"].to(device)), f"join of the patterns from {start:#010x}"
        back = (out.view(torch.int32) == bits) | (out.isnan() & master.isnan())
        assert bool(back.all()), f"{int(bits[~back][0]) & 0xFFFFFFFF:#010x} did not round-trip"
    assert int(bits[-1]) == -1  # the last chunk ended at 0xFFFFFFFF


LARGE = (1 << 31) + (1 << 20) + 5  # past 2**31 elements, not a multiple of 8 or of a block
LARGE_BYTES = LARGE * (4 + 2 + 2 + 4) + codec.tie_bytes(LARGE)  # the join's peak: master, high, low, out, ties


def _random_masters_cuda(n: int, seed: int) -> torch.Tensor:
    """Random fp32 bit patterns on the GPU (a third of them ties), made a chunk at a time."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    master = torch.empty(n, device="cuda")
    bits = master.view(torch.int32)
    step = 1 << 28
    for start in range(0, n, step):
        m = min(step, n - start)
        chunk = torch.randint(-(2**31), 2**31, (m,), dtype=torch.int64, device="cuda", generator=gen).to(torch.int32)
        tie = torch.rand(m, device="cuda", generator=gen) < 1 / 3
        bits[start : start + m] = torch.where(tie, (chunk & ~0xFFFF) | 0x8000, chunk)
    return master


@pytest.mark.cuda
def test_a_master_of_more_than_2_31_elements(monkeypatch):
    """Offsets past 2**31 (64-bit in the kernels): Triton's split is the torch path's bytes over the
    whole master, whose random content catches an offset that wraps, and its join gives the master back."""
    free, _ = torch.cuda.mem_get_info()
    if free < LARGE_BYTES + (4 << 30):
        pytest.skip(f"needs {(LARGE_BYTES + (4 << 30)) / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    master = _random_masters_cuda(LARGE, seed=0)
    low = torch.full((LARGE,), -1, dtype=torch.int16, device="cuda")
    ties = torch.full((codec.tie_bytes(LARGE),), 0xFF, dtype=torch.uint8, device="cuda")
    triton_codec.split_master(master, low, ties)
    with monkeypatch.context() as patch:
        patch.setattr(triton_codec, "available", lambda device: False)
        want_low = torch.empty_like(low)
        want_ties = torch.empty_like(ties)
        codec.split_master(master, want_low, want_ties)
    assert _same(low, want_low) and _same(ties, want_ties)
    del want_low, want_ties
    high = master.to(torch.bfloat16)
    out = torch.full_like(master, float("nan"))
    triton_codec.join_master(high, low, ties, out)
    del high, low, ties
    step = 1 << 28
    for start in range(0, LARGE, step):
        a, b = out[start : start + step], master[start : start + step]
        back = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
        assert bool(back.all()), f"element {start + int((~back).nonzero()[0])} did not round-trip"


@pytest.mark.cuda
def test_cuda_tensors_go_through_the_triton_kernels(monkeypatch):
    """`zkernel.platform.split_master` sends CUDA tensors to the kernels (and, without Triton, to the
    torch path, which writes the same bytes)."""
    calls = []

    def spy(name):
        real = getattr(triton_codec, name)

        def call(*args):
            calls.append(name)
            return real(*args)

        return call

    for name in ("split_master", "join_master"):
        monkeypatch.setattr(triton_codec, name, spy(name))
    n = 3 * triton_codec.BLOCK + 3
    master = interpreted.masters(n, seed=7).cuda()
    low = torch.empty(n, dtype=torch.int16, device="cuda")
    ties = torch.empty(codec.tie_bytes(n), dtype=torch.uint8, device="cuda")
    codec.split_master(master, low, ties)
    out = codec.join_master(master.to(torch.bfloat16), low, ties, torch.empty_like(master))
    assert calls == ["split_master", "join_master"]
    finite = ~master.isnan()
    assert torch.equal(out.view(torch.int32)[finite], master.view(torch.int32)[finite])

    monkeypatch.setattr(triton_codec, "available", lambda device: False)
    torch_low, torch_ties = torch.empty_like(low), torch.empty_like(ties)
    codec.split_master(master, torch_low, torch_ties)
    assert calls == ["split_master", "join_master"]
    assert _same(low, torch_low) and _same(ties, torch_ties)


@pytest.mark.cuda
def test_the_kernels_run_on_the_current_stream():
    """Queued on a side stream behind a long sleep and the master's write: split reads the master as
    written there and join reads split's output (a kernel on another stream would read zeros)."""
    n = 1 << 20
    source = interpreted.masters(n, seed=9)
    want_low, want_ties = interpreted.split_by("native", source)
    master = torch.zeros(n, device="cuda")
    low = torch.zeros(n, dtype=torch.int16, device="cuda")
    ties = torch.zeros(codec.tie_bytes(n), dtype=torch.uint8, device="cuda")
    out = torch.zeros(n, device="cuda")
    high = source.to(torch.bfloat16).cuda()
    on_gpu = source.cuda()  # (a copy from the host could hold the host back until the sleep ends)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time before the master is written
        master.copy_(on_gpu)
        triton_codec.split_master(master, low, ties)
        triton_codec.join_master(high, low, ties, out)
    side.synchronize()
    assert _same(low.cpu(), want_low) and _same(ties.cpu(), want_ties)
    assert _same(out.cpu(), interpreted.join_by("native", high.cpu(), want_low, want_ties))
