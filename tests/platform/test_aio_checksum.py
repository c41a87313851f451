"""CRC32C computed by the async I/O engine's threads, and altered files caught on read."""

from __future__ import annotations

import errno
import os
import pickle
import tempfile

import pytest
import torch

from zkernel.platform import native
from zkernel.platform.aio import AioHandle, ChecksumError, aligned_empty

KIB = 1024


@pytest.fixture
def handle():
    with AioHandle(block_size=64 * KIB, threads=4, queue_depth=16) as h:
        yield h


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    out = aligned_empty(n)
    out.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_check_value_through_the_engine(handle, tmp_path):
    path = tmp_path / "check.bin"
    assert handle.write(b"123456789", path, checksum=True) == 0xE3069283
    back = bytearray(9)
    assert handle.read(back, path, checksum=True) == 0xE3069283
    assert handle.read(back, path, expect_crc=0xE3069283) == 0xE3069283
    assert handle.write(b"123456789", path) is None  # no checksum asked: none computed


@pytest.mark.parametrize(
    "nbytes,offset,misalign",
    [
        (1, 0, 0),
        (4095, 0, 0),  # all of it through the page cache (shorter than the alignment)
        (64 * KIB * 3 + 517, 8192, 0),  # three O_DIRECT chunks and a page-cache tail
        (64 * KIB * 3, 4096, 0),  # whole chunks only
        (200 * KIB, 513, 0),  # misaligned file offset: page cache
        (200 * KIB + 7, 4096, 3),  # misaligned buffer: page cache
    ],
)
def test_request_crc_equals_the_buffers_crc(handle, tmp_path, nbytes, offset, misalign):
    path = tmp_path / "data.bin"
    data = _random_bytes(nbytes + misalign, seed=nbytes)[misalign:]
    want = native.crc32c(data)
    assert handle.write(data, path, offset, checksum=True) == want
    back = aligned_empty(nbytes + misalign)[misalign:]
    assert handle.read(back, path, offset, expect_crc=want) == want
    assert torch.equal(back, data)


@pytest.mark.parametrize("where", ["direct_chunk", "last_direct_byte", "page_cache_tail"])
def test_one_flipped_byte_is_caught_and_named(handle, tmp_path, where):
    path = tmp_path / "swap.bin"
    offset, nbytes = 4096, 64 * KIB * 3 + 517
    data = _random_bytes(nbytes, seed=7)
    crc = handle.write(data, path, offset, checksum=True)
    flip_at = {"direct_chunk": offset + 70_000, "last_direct_byte": offset + 64 * KIB * 3 - 1,
               "page_cache_tail": offset + nbytes - 1}[where]
    _flip_byte(path, flip_at)
    back = aligned_empty(nbytes)
    with pytest.raises(ChecksumError) as caught:
        handle.read(back, path, offset, expect_crc=crc)
    err = caught.value
    assert isinstance(err, OSError) and err.errno == errno.EIO
    assert err.filename == str(path)
    assert (err.offset, err.nbytes, err.expected) == (offset, nbytes, crc)
    assert err.actual == native.crc32c(back) != crc
    assert f"{offset}..{offset + nbytes - 1}" in str(err) and str(path) in str(err)
    again = pickle.loads(pickle.dumps(err))  # reaches a parent process intact
    assert (type(again), str(again), again.actual) == (ChecksumError, str(err), err.actual)
    # The handle is still usable, and another region of the same file still reads clean.
    head = _random_bytes(4096, seed=8)
    head_crc = handle.write(head, path, 0, checksum=True)
    assert handle.read(aligned_empty(4096), path, 0, expect_crc=head_crc) == head_crc


def test_many_requests_collected_in_any_order(handle, tmp_path):
    blobs = [_random_bytes(64 * KIB + 100 * i, seed=i) for i in range(6)]
    ids = {}
    for i, blob in enumerate(blobs):
        ids[handle.submit_write(blob, tmp_path / f"f{i}.bin", checksum=i % 2 == 0)] = i
    crcs = handle.wait_all()
    assert crcs == {req: native.crc32c(blobs[i]) for req, i in ids.items() if i % 2 == 0}
    backs = [aligned_empty(b.numel()) for b in blobs]
    reads = {handle.submit_read(backs[i], tmp_path / f"f{i}.bin", checksum=i != 3): i for i in range(6)}
    seen = {}
    while len(seen) < len(reads):
        request, crc = handle.wait_any_with_crc()
        seen[reads[request]] = crc
    assert seen == {i: (None if i == 3 else native.crc32c(blobs[i])) for i in range(6)}
    reads = [handle.submit_read(backs[i], tmp_path / f"f{i}.bin", expect_crc=native.crc32c(blobs[i]))
             for i in range(6)]
    assert sorted(handle.wait_any() for _ in reads) == sorted(reads)


def test_software_crc_path_in_the_io_threads(handle, tmp_path):
    data = _random_bytes(64 * KIB * 2 + 3, seed=9)
    native.set_crc32c_path("table")
    try:
        crc = handle.write(data, tmp_path / "t.bin", checksum=True)
    finally:
        native.set_crc32c_path("auto")
    assert crc == native.crc32c(data)
    assert handle.read(aligned_empty(data.numel()), tmp_path / "t.bin", expect_crc=crc) == crc


def test_empty_request_failed_read_and_bad_expectation(handle, tmp_path):
    path = tmp_path / "short.bin"
    assert handle.write(torch.empty(0, dtype=torch.uint8), path, checksum=True) == 0
    with pytest.raises(ChecksumError):
        handle.read(bytearray(0), path, expect_crc=1)
    handle.write(b"abc", path)
    # An I/O failure is reported as itself, not as a checksum mismatch.
    with pytest.raises(EOFError):
        handle.read(bytearray(10), path, expect_crc=0)
    with pytest.raises(FileNotFoundError):
        handle.read(bytearray(3), tmp_path / "missing.bin", expect_crc=0)
    with pytest.raises(ValueError, match="expect_crc must be a CRC32C value"):
        handle.submit_read(bytearray(3), path, expect_crc=1 << 32)
    assert handle.pending == 0


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct_if_supported", "buffered_only"])
def test_tmpfs(direct):
    """/dev/shm: tmpfs refuses O_DIRECT before Linux 6.6 (the engine falls back to
    buffered I/O) and accepts it since; direct=False forces the buffered path anyway."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm") as d,
        AioHandle(block_size=64 * KIB, threads=4, direct=direct) as h,
    ):
        path = os.path.join(d, "swap.bin")
        data = _random_bytes(64 * KIB * 4 + 1, seed=10)
        crc = h.write(data, path, checksum=True)
        assert crc == native.crc32c(data)
        assert h.read(aligned_empty(data.numel()), path, expect_crc=crc) == crc
        _flip_byte(path, 12_345)
        with pytest.raises(ChecksumError, match="swap.bin"):
            h.read(aligned_empty(data.numel()), path, expect_crc=crc)
