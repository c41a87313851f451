"""Block checksums of checkpoint files.

Each file's data region is checksummed in fixed blocks (`BLOCK_BYTES`), and
its header separately, so a rank that reads only some byte ranges (re-sharding,
consolidation) verifies exactly the blocks it reads. `checksum_function` is the
one place that picks the algorithm; the manifest records its name, so a reader
refuses an algorithm it does not know rather than skipping the check.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from zkernel.checkpoint.format import CheckpointError

# zlib's CRC-32: in the standard library, releases the GIL on large buffers (blocks are
# checksummed on a thread pool), about 1 GB/s per core.
ALGORITHM = "crc32"
BLOCK_BYTES = 1 << 20


def checksum_function(algorithm: str = ALGORITHM) -> Callable[[memoryview], int]:
    """The checksum of one buffer under ``algorithm`` (as named in a manifest)."""
    if algorithm == "crc32":
        return zlib.crc32
    raise CheckpointError(f"checksum algorithm {algorithm!r} is not supported by this zkernel (it knows crc32)")
