"""What this machine has and how fast it moves bytes: the numbers a planner decides from.

`Capacity` is the one type for how much memory a job has: `local_capacity`
(`Capacity.measure`) reads, on the calling rank, the free memory of its compute
device, the host memory available and the free disk at a path; the kernel
combines every rank's into the job's minima (`Capacity.combine`,
`zkernel.kernel.planning`); `machine_capacity` gives the machine's sizes. The probes
measure, cheaply and for real, what the placements differ in:

* `probe_copy`: host<->device copy throughput from page-locked memory (CUDA
  only; None without a GPU);
* `probe_disk`: sequential write and read throughput of a file at a path,
  through the repository's asynchronous I/O engine (`zkernel.platform.aio`, O_DIRECT
  where the file system has it), on a few tens of MiB, file removed after;
* `probe_cpu_adam`: elements per second of the native CPU Adam step on a
  buffer of a few million elements.

Each probe takes well under a second and reports the best of a few repeats
(the first warms caches, threads and allocators). A probe that cannot run
returns None with the reason in `Probe.reason`.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from zkernel.errors import ConfigError
from zkernel.telemetry.log import get_logger
from zkernel.platform.sizes import parse_size

log = get_logger()


@attrs.frozen(kw_only=True)
class Capacity:
    """Memory a job has, in bytes (None: unknown or not applicable): the one capacity type.

    What it describes depends on who made it: one rank's view of its machine
    (`Capacity.measure`, free memory now), the machine's installed sizes
    (`machine_capacity`, for ``zkernel estimate``'s table), or the job's minima
    over its ranks with a user's overrides (`Capacity.combine`, what a planner
    decides from). Host memory and disk are the machine's, shared by its
    ``ranks_per_machine`` ranks; ``device_bytes`` is one compute device's.
    """

    # Memory of one compute device; None when the compute device is the CPU (whose memory is
    # `host_bytes`), or unknown.
    device_bytes: int | None
    # Host memory available on the machine (MemAvailable, or ``ZKERNEL_HOST_MEMORY``).
    host_bytes: int | None
    # Free disk of the file system at offload.nvme_path (None: no path, or unknown).
    disk_bytes: int | None
    # GPUs on the machine (0: compute on the CPU).
    gpus: int = 0
    # Ranks sharing the machine's host memory and disk.
    ranks_per_machine: int = 1
    # Which of "device"/"host"/"disk" came from a user's overrides instead of detection.
    overridden: tuple[str, ...] = ()

    @classmethod
    def measure(cls, device: torch.device, nvme_path: str | os.PathLike | None) -> Capacity:
        """What the calling rank has now: the free memory of its compute device
        (torch.cuda.mem_get_info; None on the CPU), the host memory available, the free disk
        where ``nvme_path`` is (or would be created)."""
        cuda = device.type == "cuda"
        device_bytes = int(torch.cuda.mem_get_info(device)[0]) if cuda else None
        return cls(
            device_bytes=device_bytes,
            host_bytes=available_host_bytes(),
            disk_bytes=free_disk_bytes(nvme_path),
            gpus=torch.cuda.device_count() if cuda else 0,
        )

    @classmethod
    def combine(
        cls,
        ranks: Sequence[Capacity],
        ranks_per_machine: int,
        *,
        device: int | None = None,
        host: int | None = None,
        disk: int | None = None,
    ) -> Capacity:
        """The minimum over ``ranks`` of each figure (unknown where any rank does not know), then
        the overrides given (``device``, ``host``, ``disk``; None: detected)."""

        def smallest(values: list[int | None]) -> int | None:
            return None if not values or any(v is None for v in values) else min(values)

        found = {
            "device": smallest([r.device_bytes for r in ranks]),
            "host": smallest([r.host_bytes for r in ranks]),
            "disk": smallest([r.disk_bytes for r in ranks]),
        }
        given = {"device": device, "host": host, "disk": disk}
        for key, value in given.items():
            if value is not None:
                found[key] = value
        return cls(
            device_bytes=found["device"],
            host_bytes=found["host"],
            disk_bytes=found["disk"],
            gpus=min((r.gpus for r in ranks), default=0),
            ranks_per_machine=ranks_per_machine,
            overridden=tuple(k for k, v in given.items() if v is not None),
        )


# Overrides the host memory zkernel plans with (a size: "480GiB"), for machines whose
# MemAvailable understates what the process may use (memory that a VM balloons in on demand).
HOST_MEMORY_ENV = "ZKERNEL_HOST_MEMORY"


def available_host_bytes() -> int | None:
    """``ZKERNEL_HOST_MEMORY`` if set; else MemAvailable from /proc/meminfo, else free pages x page
    size from sysconf, else None."""
    override = os.environ.get(HOST_MEMORY_ENV)
    if override:
        try:
            return parse_size(override)
        except ValueError as error:
            raise ConfigError(f"{HOST_MEMORY_ENV}: {error}") from None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_disk_bytes(path: str | os.PathLike | None) -> int | None:
    """Free bytes where ``path`` is (or would be created: its nearest existing parent)."""
    if path is None:
        return None
    at = Path(path)
    while not at.exists() and at != at.parent:
        at = at.parent
    try:
        return shutil.disk_usage(at).free
    except OSError:
        return None


def local_capacity(device: torch.device, nvme_path: str | os.PathLike | None) -> Capacity:
    """What the calling rank has now: `Capacity.measure`."""
    return Capacity.measure(device, nvme_path)


def machine_capacity(nvme_path: str | os.PathLike | None = None) -> Capacity:
    """This machine's sizes: its GPUs and the smallest one's total memory (torch.cuda), the host
    memory available, the free disk at ``nvme_path``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device_bytes = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus)) if gpus else None
    return Capacity(device_bytes=device_bytes, host_bytes=available_host_bytes(), disk_bytes=free_disk_bytes(nvme_path), gpus=gpus)


# What the probes measure, by the name a planner reports them under (and takes them given, from a
# user describing another machine): bytes per second, elements per second for the CPU Adam step.
RATE_NAMES = ("host_to_device", "device_to_host", "disk_write", "disk_read", "cpu_adam")


@attrs.frozen
class Probe:
    """A measured rate (units per second; None when not measured) and why not, or what was measured."""

    rate: float | None
    reason: str = ""

    def text(self, unit: str) -> str:
        if self.rate is None:
            return f"not measured ({self.reason})"
        return f"{self.rate / 1e9:.2f} G{unit}/s"


def _best_of(repeats: int, run: Callable[[], None], sync: Callable[[], None] = lambda: None) -> float:
    """The shortest of ``repeats`` timed runs after one untimed warm-up, in seconds."""
    run()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def probe_copy(device: torch.device, nbytes: int = 64 << 20) -> tuple[Probe, Probe]:
    """(host->device, device->host) bytes per second of one ``nbytes`` copy from/to page-locked memory."""
    if device.type != "cuda":
        return Probe(None, "no CUDA device"), Probe(None, "no CUDA device")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def sync() -> None:
        torch.cuda.synchronize(device)

    h2d = _best_of(3, lambda: dev.copy_(host, non_blocking=True), sync)
    d2h = _best_of(3, lambda: host.copy_(dev, non_blocking=True), sync)
    return Probe(nbytes / h2d, f"{nbytes >> 20} MiB pinned"), Probe(nbytes / d2h, f"{nbytes >> 20} MiB pinned")


def probe_disk(path: str | os.PathLike | None, nbytes: int = 32 << 20) -> tuple[Probe, Probe]:
    """(write, read) bytes per second of an ``nbytes`` file in directory ``path`` through `zkernel.platform.aio`.

    The file is written (and fsynced, so the write reaches the disk rather
    than the page cache where O_DIRECT is unavailable), read back, and removed.
    """
    if path is None:
        return Probe(None, "no offload.nvme_path"), Probe(None, "no offload.nvme_path")
    from zkernel.platform import aio, native

    if not native.available():
        return Probe(None, "native extension not built"), Probe(None, "native extension not built")
    directory = Path(path)
    file = directory / f".zkernel-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    created = []  # directories made for the probe, removed after it
    at = directory
    while not at.exists() and at != at.parent:
        created.append(at)
        at = at.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        buffer = aio.aligned_empty(nbytes, pin=False)
        buffer.fill_(0x5A)
        with aio.AioHandle() as handle:

            def write() -> None:
                handle.write(buffer, file)
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

            write_s = _best_of(1, write)
            read_s = _best_of(2, lambda: handle.read(buffer, file))
            how = "O_DIRECT" if handle.direct else "buffered"
    except OSError as exc:
        return Probe(None, f"probe file failed: {exc}"), Probe(None, f"probe file failed: {exc}")
    finally:
        file.unlink(missing_ok=True)
        for made in created:
            try:
                made.rmdir()
            except OSError:
                break
    return Probe(nbytes / write_s, f"{nbytes >> 20} MiB {how}"), Probe(nbytes / read_s, f"{nbytes >> 20} MiB {how}")


def probe_cpu_adam(numel: int = 4 << 20) -> Probe:
    """Elements per second of `zkernel.platform.native.adam_step` (fp32 gradient, bf16 copy-out) on ``numel`` elements."""
    from zkernel.platform import native

    if not native.available():
        return Probe(None, "native extension not built")
    param, grad, m, v = (torch.full((numel,), 0.5) for _ in range(4))
    out = torch.empty(numel, dtype=torch.bfloat16)
    count = [0]

    def step() -> None:
        count[0] += 1
        native.adam_step(
            param, grad, m, v, step=count[0], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, copy_out=out
        )

    seconds = _best_of(2, step)
    return Probe(numel / seconds, f"{numel >> 20} Mi elements, {native.threads()} threads")
