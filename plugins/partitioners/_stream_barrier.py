"""A barrier between ranks' streams that holds no multiprocessor: CUDA stream memory operations.

[Note: barriers off the multiprocessors] The matrix multiplies of a transformer
(cuBLAS's persistent kernels on Hopper) launch one block per multiprocessor. A
kernel of another stream that is resident when one launches, however small,
leaves a block without a multiprocessor until another finishes, and the matmul
takes up to twice as long; a barrier kernel that spins until the peer arrives
does exactly that whenever the ranks are out of step (BENCHMARKS.md, "Figures formerly in docstrings").

Here a barrier is two stream memory operations per peer, which the GPU's front
end executes without a kernel: write this barrier's number into the peer's
signal word for this rank (`cuStreamWriteValue32`, preceded by a memory fence
scoped to the stream, so everything the stream ordered before is visible to
the peer first), then wait until every peer has written at least that number
into this rank's words (`cuStreamWaitValue32`, greater-or-equal). The stream
blocks in the front end meanwhile; other streams run on. Gathers and
reductions each have their own words, and every rank issues the same barriers
of each in the same order (the path check holds the gathers and reductions to
it), so the numbers pair up.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.distributed as dist

from zkernel.platform.distributed import every_rank
from zkernel.telemetry.log import get_logger

log = get_logger()

_WAIT_GEQ = 0x0
_driver = None


def _cuda_driver():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _driver = lib
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")


class StreamBarrier:
    """Barriers of every rank's stream, through one word per rank in symmetric memory."""

    def __init__(self, driver, words: torch.Tensor, handle) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self._write, self._wait = driver.cuStreamWriteValue32_v2, driver.cuStreamWaitValue32_v2
        self.words, self._handle = words, handle  # the handle keeps the peers' mappings alive
        # This rank's word in each peer's signals, and each peer's word in this rank's.
        self._outbox = [
            handle.get_buffer(peer, (self.world,), torch.int32, 0).data_ptr() + 4 * self.rank
            for peer in range(self.world)
            if peer != self.rank
        ]
        self._inbox = [words.data_ptr() + 4 * peer for peer in range(self.world) if peer != self.rank]
        self.count = 0

    def __call__(self, stream: torch.cuda.Stream) -> None:
        """Queue the next barrier on ``stream``: work queued after it starts once every rank's stream
        has reached its barrier of the same number, with what each queued before visible."""
        self.count += 1
        handle = ctypes.c_void_p(stream.cuda_stream)
        for address in self._outbox:
            _check(self._write(handle, address, self.count, 0), "cuStreamWriteValue32")
        for address in self._inbox:
            _check(self._wait(handle, address, self.count, _WAIT_GEQ), "cuStreamWaitValue32")

    def try_own_word(self, device: torch.device) -> str:
        """One write and wait on this rank's own word (a driver may refuse them on some memory), which
        is zero again after; why not, or ""."""
        stream = torch.cuda.Stream(device)
        handle, address = ctypes.c_void_p(stream.cuda_stream), self.words.data_ptr() + 4 * self.rank
        try:
            _check(self._write(handle, address, 1, 0), "cuStreamWriteValue32")
            _check(self._wait(handle, address, 1, _WAIT_GEQ), "cuStreamWaitValue32")
        except RuntimeError as exc:
            return str(exc)
        stream.synchronize()
        self.words.zero_()
        torch.cuda.synchronize(device)
        return ""


def _stream_barrier(device: torch.device) -> tuple[StreamBarrier | None, str]:
    """A `StreamBarrier` where every rank can use stream memory operations (collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    reason = ""
    try:
        driver = _cuda_driver()
    except (OSError, AttributeError) as exc:
        driver, reason = None, f"the CUDA driver has no stream memory operations ({exc})"
    if not every_rank(not reason, device):
        return None, reason or "another rank's CUDA driver has no stream memory operations"
    words = symm_mem.empty(dist.get_world_size(), dtype=torch.int32, device=device)
    words.zero_()
    handle = symm_mem.rendezvous(words, dist.group.WORLD.group_name)
    barrier = StreamBarrier(driver, words, handle)
    reason = barrier.try_own_word(device)
    # Every rank's words are zero (again) before any rank's first barrier writes into them.
    if not every_rank(not reason, device):
        return None, reason or "another rank could not use stream memory operations"
    return barrier, ""


def open_barrier(handle, channel: int, device: torch.device) -> Callable[[torch.cuda.Stream], None]:
    """A barrier of every rank's stream (collective: every rank calls it at the same point): stream
    memory operations where every rank can use them ([Note: barriers off the multiprocessors]), else
    the symmetric-memory barrier kernel on ``channel`` of ``handle`` (a WARNING says why)."""
    barrier, reason = _stream_barrier(device)
    if barrier is not None:
        return barrier
    log.warning("zkernel.zero3.stream_barrier_unavailable", reason=reason, fallback="barrier kernel")

    def kernel_barrier(stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            handle.barrier(channel=channel)

    return kernel_barrier
