"""Block checksums of checkpoint files.

Each file's data region is checksummed in fixed blocks (`BLOCK_BYTES`), and
its header separately, so a rank that reads only some byte ranges (re-sharding,
consolidation) verifies exactly the blocks it reads. `checksum_function` is the
one place that maps an algorithm to code, and `default_algorithm` the one that
picks it for new files; the manifest records the name, so a reader refuses an
algorithm it does not know rather than skipping the check.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

from zkernel.checkpoint.format import CheckpointError

BLOCK_BYTES = 1 << 20
# The standard check value: CRC-32C of b"123456789".
_CRC32C_CHECK = 0xE3069283


@functools.cache
def _native_crc32c() -> Callable[[memoryview], int] | None:
    """CRC-32C from the native extension (hardware instructions), when it offers one that passes the check."""
    try:
        from zkernel.platform import native

        crc32c = getattr(native, "crc32c", None)
        if crc32c is not None and int(crc32c(memoryview(b"123456789"))) == _CRC32C_CHECK:
            return lambda data: int(crc32c(data))
    except Exception:  # noqa: BLE001 - any mismatch in the native API: fall back to zlib
        pass
    return None


def default_algorithm() -> str:
    """``crc32c`` where the native extension provides it (several GB/s per core), else ``crc32``
    (zlib's, in the standard library; releases the GIL on large buffers, about 1 GB/s per core)."""
    return "crc32c" if _native_crc32c() is not None else "crc32"


def checksum_function(algorithm: str) -> Callable[[memoryview], int]:
    """The checksum of one buffer under ``algorithm`` (as named in a manifest)."""
    if algorithm == "crc32":
        return zlib.crc32
    if algorithm == "crc32c":
        crc32c = _native_crc32c()
        if crc32c is not None:
            return crc32c
        raise CheckpointError(
            "this checkpoint's checksums are CRC-32C, which needs zkernel's native extension "
            "(zkernel.platform.native.crc32c); build it with `pip install -e .`"
        )
    raise CheckpointError(f"checksum algorithm {algorithm!r} is not supported by this zkernel (it knows crc32, crc32c)")
