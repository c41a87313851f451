"""The user's own state saved beside the model (``client_state``), as DeepSpeed's checkpoints keep it.

[Note: client state] ``engine.save_checkpoint(dir, client_state={...})``
keeps what the training script needs to go on besides the model: the epoch,
the data loader's position, the best validation loss, a scheduler of its own.
Rank 0's dict is serialised with ``torch.save`` into its rank file
(``client/state/0``: checksummed and committed with the rest, so a save that
fails leaves no client state behind either), and the manifest records its
size (``client_state``). `Engine.load_checkpoint` hands it back to every rank,
loaded with ``weights_only=True`` as a module's extra state is (tensors,
containers and primitive values; any other class must be allowed with
``torch.serialization.add_safe_globals``), so loading never runs code from
the file. A value torch cannot save is refused at ``save_checkpoint``, before
anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zkernel.checkpoint import extra_state
from zkernel.checkpoint.format import CheckpointError
from zkernel.checkpoint.reader import CheckpointIndex, ReadBatch

KIND = "client"
NAME = "state"
_WHAT = "the client_state given to save_checkpoint"


def check(value: Any) -> None:
    """A `TypeError` unless ``value`` is a mapping (what every rank checks of its own client state)."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"save_checkpoint's client_state must be a dict (of tensors, containers and primitive values), "
            f"not a {type(value).__name__}"
        )


def serialize(value: Mapping[str, Any]) -> torch.Tensor:
    """``value`` (the user's dict) as the bytes ``torch.save`` writes."""
    check(value)
    return extra_state.serialize(NAME, dict(value), what=_WHAT)


def read(index: CheckpointIndex, reader, device: torch.device | None = None) -> dict[str, Any]:
    """The client state saved in checkpoint ``index`` ({} where none was given), read through ``reader``
    (a `RangeReader`; checksums verified); tensors rank 0 kept on a GPU land on ``device``."""
    nbytes = index.client_state_bytes
    if nbytes is None:
        return {}
    data = torch.empty(nbytes, dtype=torch.uint8)
    batch = ReadBatch(index)
    batch.add(NAME, KIND, 0, data)
    batch.run(reader)
    value = extra_state.deserialize(NAME, data, str(index.dir), device, what=_WHAT)
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint {index.dir}: its client state is a {type(value).__name__}, not a dict")
    return value
