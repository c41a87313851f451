"""The async file I/O engine: round trips, concurrency, and the errors a user hits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zkernel.platform.aio import AioHandle, aligned_empty, preallocate

KIB = 1024


@pytest.fixture
def handle():
    with AioHandle(block_size=64 * KIB, threads=4, queue_depth=16) as h:
        yield h


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    out = aligned_empty(n)
    out.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def _file_bytes(path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


@pytest.mark.parametrize(
    "nbytes,offset,misalign",
    [
        (1, 0, 0),
        (4095, 0, 0),
        (4097, 4096, 0),
        (64 * KIB * 3 + 517, 8192, 0),  # several chunks + a tail through the page cache
        (200 * KIB, 513, 0),  # misaligned file offset
        (200 * KIB + 7, 4096, 3),  # misaligned buffer address
        (1 << 20, 12345, 1),
    ],
)
def test_round_trip_at_odd_sizes_and_offsets(handle, tmp_path, nbytes, offset, misalign):
    path = tmp_path / "data.bin"
    data = _random_bytes(nbytes + misalign, seed=nbytes)[misalign:]
    handle.write(data, path, offset)
    assert _file_bytes(path, offset, nbytes) == data.numpy().tobytes()  # independent oracle
    back = aligned_empty(nbytes + misalign)[misalign:]
    handle.read(back, path, offset)
    assert torch.equal(back, data)
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_writes_do_not_truncate_and_accept_buffer_protocol_objects(handle, tmp_path):
    path = tmp_path / "f.bin"
    handle.write(bytes(range(256)) * 64, path, 0)
    handle.write(bytearray(b"\xff" * 100), path, 1000)
    content = path.read_bytes()
    assert len(content) == 256 * 64 and content[1000:1100] == b"\xff" * 100 and content[999] == 999 % 256
    back = bytearray(100)
    handle.read(back, path, 1000)
    assert back == b"\xff" * 100
    with pytest.raises(ValueError, match="read-only"):
        handle.submit_read(b"immutable", path, 0)


def test_many_concurrent_requests(tmp_path):
    chunk = 96 * KIB + 100
    files = [tmp_path / f"part{i}.bin" for i in range(4)]
    sources = [_random_bytes(chunk, seed=i) for i in range(64)]
    with AioHandle(block_size=32 * KIB, threads=6, queue_depth=8) as h:  # submit blocks past 8
        writes = [h.submit_write(src, files[i % 4], (i // 4) * chunk) for i, src in enumerate(sources)]
        assert len(set(writes)) == 64
        h.wait_all()
        assert h.pending == 0
        targets = [aligned_empty(chunk) for _ in sources]
        reads = {h.submit_read(dst, files[i % 4], (i // 4) * chunk): i for i, dst in enumerate(targets)}
        seen = set()
        first = next(iter(reads))
        h.wait(first)
        seen.add(first)
        while len(seen) < len(reads):
            seen.add(h.wait_any())
        assert seen == set(reads)
        for src, dst in zip(sources, targets):
            assert torch.equal(src, dst)
        polled = h.submit_write(sources[0], files[0], 0)
        while not h.done(polled):
            pass
        h.wait(polled)
        with pytest.raises(IndexError):
            h.wait(polled)  # already collected


def test_missing_directory_names_path_and_offset(handle, tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "f.bin"
    with pytest.raises(FileNotFoundError) as info:
        handle.write(_random_bytes(8192, 0), path, 4096)
    assert info.value.errno == 2 and info.value.filename == str(path)
    assert "offset 4096" in str(info.value) and "ENOENT" in str(info.value)
    _assert_still_usable(handle, tmp_path)


def test_read_past_end_of_file(handle, tmp_path):
    path = tmp_path / "short.bin"
    handle.write(_random_bytes(10_000, 1), path, 0)
    with pytest.raises(EOFError, match=r"short.bin: read of 8192 bytes at offset 4096 reached the end"):
        handle.read(aligned_empty(8192), path, 4096)
    _assert_still_usable(handle, tmp_path)


def test_write_to_a_directory_and_full_device(handle, tmp_path):
    with pytest.raises(IsADirectoryError, match="EISDIR"):
        handle.write(_random_bytes(4096, 0), tmp_path, 0)
    with pytest.raises(OSError, match=r"No space left on device \[ENOSPC\].*offset 0") as info:
        handle.write(_random_bytes(4096, 0), "/dev/full", 0)
    assert info.value.errno == 28
    _assert_still_usable(handle, tmp_path)


def test_wait_all_raises_first_failure_and_collects_everything(handle, tmp_path):
    good = handle.submit_write(_random_bytes(4096, 3), tmp_path / "ok.bin", 0)
    handle.submit_read(aligned_empty(4096), tmp_path / "missing.bin", 0)
    handle.submit_read(aligned_empty(4096), tmp_path / "missing2.bin", 0)
    with pytest.raises(FileNotFoundError) as info:
        handle.wait_all()
    assert "missing2.bin" in " ".join(getattr(info.value, "__notes__", []))
    assert handle.pending == 0 and good >= 0
    _assert_still_usable(handle, tmp_path)


def _mount_small_tmpfs(where) -> bool:
    if os.geteuid() != 0:
        return False
    where.mkdir()
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    return rc.returncode == 0


def test_full_disk_on_a_small_tmpfs(handle, tmp_path):
    mnt = tmp_path / "small"
    if not _mount_small_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here; the RLIMIT_FSIZE test covers a size limit")
    try:
        with pytest.raises(OSError, match="ENOSPC") as info:
            handle.write(_random_bytes(1 << 20, 4), mnt / "big.bin", 0)
        assert info.value.errno == 28 and info.value.filename == str(mnt / "big.bin")
        (mnt / "big.bin").unlink()  # the partial write filled the file system
        handle.write(_random_bytes(8 * KIB, 5), mnt / "small.bin", 0)  # no O_DIRECT on tmpfs: buffered
        back = aligned_empty(8 * KIB)
        handle.read(back, mnt / "small.bin", 0)
        assert torch.equal(back, _random_bytes(8 * KIB, 5))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_file_size_limit_in_a_subprocess(tmp_path):
    script = textwrap.dedent(
        f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from zkernel.platform.aio import AioHandle, aligned_empty
        h = AioHandle()
        try:
            h.write(aligned_empty(4 << 20), {str(tmp_path / 'big.bin')!r}, 0)
        except OSError as e:
            print("errno", e.errno, e)
        h.write(aligned_empty(4096), {str(tmp_path / 'small.bin')!r}, 0)
        print("still usable")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "errno 27" in out.stdout and "EFBIG" in out.stdout and "big.bin" in out.stdout, out.stderr
    assert "still usable" in out.stdout


def _assert_still_usable(handle, tmp_path):
    data = _random_bytes(3 * 64 * KIB + 11, seed=99)
    handle.write(data, tmp_path / "after.bin", 4096)
    back = aligned_empty(data.numel())
    handle.read(back, tmp_path / "after.bin", 4096)
    assert torch.equal(back, data)


def test_preallocate_and_aligned_buffers(handle, tmp_path):
    path = tmp_path / "swap.bin"
    preallocate(path, 3 << 20)
    assert path.stat().st_size == 3 << 20 and path.stat().st_mode & 0o777 == 0o600
    data = _random_bytes(1 << 20, 7)
    handle.write(data, path, 1 << 20)
    assert path.stat().st_size == 3 << 20
    with pytest.raises(FileNotFoundError):
        preallocate(tmp_path / "missing" / "x", 4096)
    buf = aligned_empty(1000, torch.float32)
    assert buf.dtype == torch.float32 and buf.numel() == 1000 and buf.data_ptr() % 4096 == 0
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            aligned_empty(16, pin=True)


def test_bad_configuration():
    with pytest.raises(ValueError, match="block_size must be a positive multiple of the alignment"):
        AioHandle(block_size=1000)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        AioHandle(threads=0)
