"""CRC32C (`zkernel.platform.native.crc32c`): published check values, an independent Python oracle, both paths."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from zkernel.platform import native


def _reference_table() -> list[int]:
    table = []
    for byte in range(256):
        r = byte
        for _ in range(8):
            r = (r >> 1) ^ (0x82F63B78 if r & 1 else 0)
        table.append(r)
    return table


_TABLE = _reference_table()


def _reference(data: bytes, seed: int = 0) -> int:
    """Byte-at-a-time CRC32C straight from its definition (reflected 0x1EDC6F41)."""
    r = seed ^ 0xFFFFFFFF
    for b in data:
        r = (r >> 8) ^ _TABLE[(r ^ b) & 0xFF]
    return r ^ 0xFFFFFFFF


def _paths() -> list[str]:
    return ["table", "sse4.2"] if native.best_crc32c_path() == "sse4.2" else ["table"]


@pytest.fixture(params=_paths())
def crc_path(request):
    native.set_crc32c_path(request.param)
    yield request.param
    native.set_crc32c_path("auto")


def test_published_check_values(crc_path):
    # The CRC catalogue's check value and the iSCSI test vectors of RFC 3720, appendix B.4.
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(b"") == 0
    assert native.crc32c(bytes(32)) == 0x8A9136AA
    assert native.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert native.crc32c(bytes(range(32))) == 0x46DD794E
    assert native.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C


@pytest.mark.parametrize("misalign", [0, 1, 5])
def test_matches_the_reference_at_every_length_around_the_lane_blocks(crc_path, misalign):
    rng = np.random.default_rng(misalign)
    raw = rng.integers(0, 256, 30_000, dtype=np.uint8).tobytes()
    # Around 8-byte words, the 3 x 256-byte short blocks and the 3 x 8 KiB long blocks.
    for n in [0, 1, 7, 8, 9, 63, 767, 768, 769, 1000, 24_575, 24_576, 24_577, 24_576 + 775, 29_000]:
        data = memoryview(raw)[misalign : misalign + n]
        assert native.crc32c(data) == _reference(bytes(data)), n


def test_seed_chains_and_combine_joins(crc_path):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 5_000, dtype=np.uint8).tobytes()
    b = rng.integers(0, 256, 70_001, dtype=np.uint8).tobytes()
    whole = native.crc32c(a + b)
    assert native.crc32c(b, seed=native.crc32c(a)) == whole
    assert native.crc32c_combine(native.crc32c(a), native.crc32c(b), len(b)) == whole
    assert native.crc32c_combine(native.crc32c(a), native.crc32c(b""), 0) == native.crc32c(a)
    assert native.crc32c(b"", seed=0x12345678) == 0x12345678


def test_multithreaded_pieces_equal_one_pass():
    n = (5 << 20) + 12_345  # five 1 MiB pieces and a short one
    data = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))[3:]
    one = native.crc32c(data, threads=1)
    assert native.crc32c(data) == one
    assert native.crc32c(data, seed=0xDEADBEEF) == native.crc32c(data, seed=0xDEADBEEF, threads=1)
    head = bytes(data[:100_000].numpy())
    assert native.crc32c(head) == _reference(head)
    assert native.crc32c(data[100_000:], seed=native.crc32c(head)) == one
    native.set_crc32c_path("table")
    try:
        assert native.crc32c(data) == one
    finally:
        native.set_crc32c_path("auto")


def test_tensors_are_checksummed_as_their_bytes():
    t = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    assert native.crc32c(t) == _reference(t.numpy().tobytes())
    b = t.to(torch.bfloat16)
    assert native.crc32c(b) == _reference(b.view(torch.int16).numpy().tobytes())
    assert native.crc32c(np.arange(10, dtype=np.int64)) == _reference(np.arange(10, dtype=np.int64).tobytes())
    assert native.crc32c(torch.empty(0)) == 0


def test_bad_input():
    with pytest.raises(ValueError, match="crc32c data must be contiguous"):
        native.crc32c(torch.zeros(10)[::2])
    with pytest.raises(TypeError, match="CPU tensor or support the buffer protocol, got str"):
        native.crc32c("123456789")
    with pytest.raises(ValueError, match="seed must be a CRC32C value in 0..2\\*\\*32-1"):
        native.crc32c(b"x", seed=-1)
    with pytest.raises(ValueError, match="len_b must be >= 0"):
        native.crc32c_combine(0, 0, -1)
    with pytest.raises(ValueError, match="unknown CRC32C path 'avx'"):
        native.set_crc32c_path("avx")
    assert native.crc32c_path() == native.best_crc32c_path()


def test_hardware_path_is_used_where_the_cpu_has_it():
    has_sse42 = "sse4_2" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else None
    if has_sse42 is None:
        pytest.skip("no /proc/cpuinfo")
    assert native.best_crc32c_path() == ("sse4.2" if has_sse42 else "table")
