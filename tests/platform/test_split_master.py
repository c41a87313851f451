"""The split master's native codec: every fp32 bit pattern round-trips, and the native paths write the
torch path's bytes ([Note: the master's low half] in zkernel/platform/split_master.py).

The oracle for the parameter is torch's own ``.to(torch.bfloat16)``; the torch path of
`zkernel.platform.split_master` (selected by making `native.has_split_master` answer False) is the
reference for the bytes of ``low`` and ``ties`` and for join's output on any input.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.support.simd import simd_path, simd_paths  # noqa: F401 (simd_path: a fixture)
from zkernel.platform import native
from zkernel.platform import split_master as codec

pytestmark = pytest.mark.skipif(not native.has_split_master(), reason="native extension not built")

LENGTHS = [1, 7, 9, 32769, 1_000_003]
_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]




@pytest.fixture
def torch_path(monkeypatch):
    """Run `codec`'s torch path on CPU tensors."""
    monkeypatch.setattr(native, "has_split_master", lambda: False)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    nbytes = a.numel() * a.element_size()
    return nbytes == b.numel() * b.element_size() and _memcmp(a.data_ptr(), b.data_ptr(), nbytes) == 0


def _masters(n: int, seed: int) -> torch.Tensor:
    """Random fp32 bit patterns, a third of them with a low half of 0x7FFF, 0x8000 or 0x8001 (ties and
    their neighbours, with either parity of the upper half)."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=gen).to(torch.int32)
    near = torch.rand(n, generator=gen) < 1 / 3
    lows = torch.tensor([0x7FFF, 0x8000, 0x8001], dtype=torch.int32)[torch.randint(0, 3, (n,), generator=gen)]
    bits = torch.where(near, (bits & ~0xFFFF) | lows, bits)
    return bits.view(torch.float32)


def _split(master: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    n = master.numel()
    # Poisoned outputs: every byte, padding bits included, must be written.
    low = torch.full((n,), -1, dtype=torch.int16)
    ties = torch.full((codec.tie_bytes(n),), 0xFF, dtype=torch.uint8)
    native.split_master(master, low, ties, **kwargs)
    return low, ties


def _join(high: torch.Tensor, low: torch.Tensor, ties: torch.Tensor, **kwargs) -> torch.Tensor:
    out = torch.full((high.numel(),), float("nan"))
    native.join_master(high, low, ties, out, **kwargs)
    return out


def test_every_fp32_bit_pattern_round_trips():
    """All 2**32 patterns, 2**20 at a time (each chunk's buffers stay in the caches): the parameter is
    torch's bf16 rounding, join gives back the master bit for bit (a NaN as a NaN), and the tie bits
    are set exactly where the low 17 bits are 0x8000."""
    chunk = 1 << 20
    bits = torch.arange(chunk, dtype=torch.int32)
    master = bits.view(torch.float32)
    high = torch.empty(chunk, dtype=torch.bfloat16)
    low = torch.empty(chunk, dtype=torch.int16)
    ties = torch.empty(chunk // 8, dtype=torch.uint8)
    out = torch.empty(chunk)
    # Every chunk starts at a multiple of 2**17, so every chunk has the same ties: element 0x8000 of
    # each 2**17 (bit 0 of its byte).
    want_ties = torch.zeros(chunk // 8, dtype=torch.uint8)
    want_ties[0x8000 // 8 :: (1 << 17) // 8] = 1
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread on in-cache chunks: the pools' wake-ups cost more than they save
    try:
        for start in range(0, 1 << 32, chunk):
            if start:
                bits.add_(chunk)  # wraps from 0x7FFFFFFF to -2**31 (0x80000000) half way
            high.copy_(master)
            native.split_master(master, low, ties, threads=1)
            native.join_master(high, low, ties, out, threads=1)
            assert _same_bytes(ties, want_ties), f"tie bits of the patterns from {start:#010x}"
            if not _same_bytes(out, master):
                bad = (out.view(torch.int32) != bits).nonzero().squeeze(1)
                wrong = bad[~master[bad].isnan()]
                assert wrong.numel() == 0, f"{int(bits[wrong[0]]) & 0xFFFFFFFF:#010x} did not round-trip"
                assert out[bad].isnan().all(), f"a NaN from {start:#010x} came back as a number"
    finally:
        torch.set_num_threads(torch_threads)
    assert int(bits[-1]) == -1  # the last chunk ended at 0xFFFFFFFF


@pytest.mark.parametrize("simd_path", simd_paths(), indirect=True)
@pytest.mark.parametrize("n", LENGTHS)
def test_split_writes_the_torch_paths_bytes(simd_path, n, torch_path):
    master = _masters(n, seed=n)
    low, ties = _split(master)
    want_low = torch.empty(n, dtype=torch.int16)
    want_ties = torch.empty(codec.tie_bytes(n), dtype=torch.uint8)
    codec.split_master(master, want_low, want_ties)
    assert _same_bytes(low, want_low)
    assert _same_bytes(ties, want_ties)
    if n % 8:
        assert int(ties[-1]) >> (n % 8) == 0  # padding bits are 0


@pytest.mark.parametrize("simd_path", simd_paths(), indirect=True)
@pytest.mark.parametrize("n", LENGTHS)
def test_join_writes_the_torch_paths_bits_on_any_input(simd_path, n, torch_path):
    """Any high/low/ties, consistent with a master or not: the same uint32 arithmetic."""
    gen = torch.Generator().manual_seed(n + 1)
    high = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    low = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=gen)
    low[torch.rand(n, generator=gen) < 0.3] = -0x8000  # 0x8000: the tie bit decides
    ties = torch.randint(0, 256, (codec.tie_bytes(n),), dtype=torch.uint8, generator=gen)
    want = torch.empty(n)
    codec.join_master(high, low, ties, want)
    assert _same_bytes(_join(high, low, ties), want)


@pytest.mark.parametrize("simd_path", simd_paths(), indirect=True)
def test_round_trip_through_misaligned_views(simd_path):
    """Tensors that start mid-way into their storage (no SIMD store is aligned) and lengths that end
    mid-block."""
    n = 100_003
    master = _masters(n + 1, seed=3)[1:]
    low = torch.empty(n + 3, dtype=torch.int16)[3:]
    ties = torch.full((codec.tie_bytes(n) + 1,), 0xFF, dtype=torch.uint8)[1:]
    native.split_master(master, low, ties)
    want_low, want_ties = _split(master.clone())
    assert _same_bytes(low, want_low) and _same_bytes(ties, want_ties)
    out = torch.empty(n + 1)[1:]
    native.join_master(master.to(torch.bfloat16), low, ties, out)
    finite = ~master.isnan()
    assert torch.equal(out.view(torch.int32)[finite], master.view(torch.int32)[finite])
    assert out[~finite].isnan().all()


# 4_194_311: above the streaming-store threshold, a tail of 7.
@pytest.mark.parametrize("n", [1_000_003, 4_194_311])
def test_one_thread_and_the_pool_write_the_same_bytes(n):
    master = _masters(n, seed=5)
    low_1, ties_1 = _split(master, threads=1)
    low_n, ties_n = _split(master)
    assert _same_bytes(low_1, low_n) and _same_bytes(ties_1, ties_n)
    high = master.to(torch.bfloat16)
    assert _same_bytes(_join(high, low_1, ties_1, threads=1), _join(high, low_n, ties_n))


def test_empty_master():
    low, ties = _split(torch.empty(0))
    assert low.numel() == 0 and ties.numel() == 0
    assert _join(torch.empty(0, dtype=torch.bfloat16), low, ties).numel() == 0


def _split_args(n: int = 16) -> dict[str, torch.Tensor]:
    return {
        "master": torch.zeros(n),
        "low": torch.zeros(n, dtype=torch.int16),
        "ties": torch.zeros(codec.tie_bytes(n), dtype=torch.uint8),
    }


def _join_args(n: int = 16) -> dict[str, torch.Tensor]:
    return {
        "high": torch.zeros(n, dtype=torch.bfloat16),
        "low": torch.zeros(n, dtype=torch.int16),
        "ties": torch.zeros(codec.tie_bytes(n), dtype=torch.uint8),
        "out": torch.zeros(n),
    }


BAD_SPLIT = [
    ("master", torch.zeros(16, dtype=torch.float64), TypeError, "master must have dtype float32"),
    ("master", torch.zeros(16, dtype=torch.bfloat16), TypeError, "master must have dtype float32"),
    ("low", torch.zeros(16, dtype=torch.uint16), TypeError, "low must have dtype int16"),
    ("ties", torch.zeros(2, dtype=torch.bool), TypeError, "ties must have dtype uint8"),
    ("low", torch.zeros(15, dtype=torch.int16), ValueError, "low has 15 elements, expected 16"),
    ("ties", torch.zeros(16, dtype=torch.uint8), ValueError, "ties has 16 elements, expected 2"),
    ("low", torch.zeros(32, dtype=torch.int16)[::2], ValueError, "low must be contiguous"),
    ("master", torch.zeros(16, device="meta"), ValueError, "master must be on CPU"),
]

BAD_JOIN = [
    ("high", torch.zeros(16, dtype=torch.float16), TypeError, "high must have dtype bfloat16"),
    ("low", torch.zeros(16, dtype=torch.int32), TypeError, "low must have dtype int16"),
    ("out", torch.zeros(16, dtype=torch.bfloat16), TypeError, "out must have dtype float32"),
    ("high", torch.zeros(17, dtype=torch.bfloat16), ValueError, "high has 17 elements, expected 16"),
    ("ties", torch.zeros(3, dtype=torch.uint8), ValueError, "ties has 3 elements, expected 2"),
    ("out", torch.zeros(32)[::2], ValueError, "out must be contiguous"),
    ("ties", torch.zeros(2, dtype=torch.uint8, device="meta"), ValueError, "ties must be on CPU"),
]


@pytest.mark.parametrize(("name", "bad", "error", "message"), BAD_SPLIT, ids=[m for *_, m in BAD_SPLIT])
def test_split_refuses_bad_arguments(name, bad, error, message):
    args = _split_args() | {name: bad}
    with pytest.raises(error, match=message):
        native.split_master(args["master"], args["low"], args["ties"])


@pytest.mark.parametrize(("name", "bad", "error", "message"), BAD_JOIN, ids=[m for *_, m in BAD_JOIN])
def test_join_refuses_bad_arguments(name, bad, error, message):
    args = _join_args() | {name: bad}
    with pytest.raises(error, match=message):
        native.join_master(args["high"], args["low"], args["ties"], args["out"])


@pytest.mark.cuda
def test_native_refuses_cuda_tensors():
    split = _split_args() | {"low": torch.zeros(16, dtype=torch.int16, device="cuda")}
    with pytest.raises(ValueError, match="low must be on CPU"):
        native.split_master(split["master"], split["low"], split["ties"])
    join = _join_args() | {"out": torch.zeros(16, device="cuda")}
    with pytest.raises(ValueError, match="out must be on CPU"):
        native.join_master(join["high"], join["low"], join["ties"], join["out"])
