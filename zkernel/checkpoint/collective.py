"""Small JSON messages between the ranks of a save or load (status, checksums, fragments).

Sent as UTF-8 bytes in tensors (two all-gathers: lengths, then padded bytes)
rather than with ``all_gather_object``, which pickles: nothing in a checkpoint
path unpickles anything.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from zkernel.platform.distributed import DistInfo


def exchange_json(value: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order. Collective."""
    if not info.distributed:
        return [value]
    device = info.device if dist.get_backend() == "nccl" else torch.device("cpu")
    data = json.dumps(value, separators=(",", ":")).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(info.world_size)]
    dist.all_gather(lengths, length)
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    mine = mine.to(device)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(info.world_size)]
    dist.all_gather(gathered, mine)
    return [json.loads(bytes(t[: int(n)].cpu().numpy())) for t, n in zip(gathered, lengths)]
