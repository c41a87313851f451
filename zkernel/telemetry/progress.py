"""Progress bars for long operations a user waits for, shown on rank 0 only and only to a person.

``progress(total, desc, unit="B")`` returns a tqdm bar on stderr when all of
these hold, and otherwise an object with the same small API that does nothing:

* this process is rank 0 (of the process group, else of torchrun's ``RANK``);
* ``ZKERNEL_PROGRESS=1`` forces bars and ``ZKERNEL_PROGRESS=0`` turns them off,
  whatever else holds; without it, a caller's ``enabled=True``/``False``
  decides (``zkernel.consolidate(..., progress=True)``), and without that,
  whether stderr is a terminal.

So tests, logs redirected to files and programs that use zkernel as a library
stay quiet. Either object has ``update(n)``, ``close()`` and works as a
context manager; bars in bytes (``unit="B"``) count in KiB/MiB/GiB.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "ZKERNEL_PROGRESS"


class NoProgress:
    """What `progress` returns when no bar is shown: every call does nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def shown(enabled: bool | None = None) -> bool:
    """Whether `progress` would show a bar in this process now (see the module docstring)."""
    if _rank() != 0:
        return False
    setting = os.environ.get(ENV, "")
    if setting in ("0", "1"):
        return setting == "1"
    if enabled is not None:
        return enabled
    return sys.stderr is not None and sys.stderr.isatty()


def progress(total: float | None, desc: str, unit: str = "B", *, enabled: bool | None = None) -> Any:
    """A tqdm bar of ``total`` ``unit`` labelled ``desc`` on rank 0 for a person, else a `NoProgress`."""
    if not shown(enabled):
        return NoProgress()
    from tqdm import tqdm

    scaled = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scaled,
        unit_divisor=1024 if scaled else 1000,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
        mininterval=0.25,
    )
