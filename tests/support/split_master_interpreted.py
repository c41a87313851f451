"""The Triton split-master kernels under Triton's interpreter, against the native codec and the torch path.

Run as a script (``python split_master_interpreted.py``) with ``TRITON_INTERPRET=1`` in its
environment: Triton reads it when the kernels are built, and the interpreter, once it has run a
kernel, leaves ``triton.language`` patched for the rest of the process, so it gets a process of its
own (tests/platform/test_split_master_triton.py starts it). The interpreter runs the kernels on CPU
tensors, so the native codec (`zkernel.platform.native`) and the torch path of
`zkernel.platform.split_master` (native switched off) are the references, byte for byte. Prints one
JSON object on its last line of stdout: each case's name -> None where it passed, else the failure.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from unittest import mock

import torch

from zkernel.platform import native
from zkernel.platform import split_master as codec
from zkernel.platform import split_master_triton as triton_codec

BLOCK = triton_codec.BLOCK
SIZES = [0, 1, 7, 8, 9, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 3]

# Bit patterns at the edges of the encoding: ties kept and rounded up (even and odd upper halves) and
# their neighbours, the extreme low halves, NaNs (quiet, signalling, negative, one whose low half is a
# tie), infinities, signed zeros, subnormals (a tie among them), the largest finite (rounds to inf)
# and a tie below it.
SPECIAL = [
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x3F81FFFF, 0x3F810000, 0xBF808000, 0xBF818000,
    0x7FC00000, 0x7F800001, 0xFFC00000, 0x7FFF8000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F808000,
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
    0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x807FFFFF, 0x80008000,
    0x7F7FFFFF, 0x7F7F8000, 0x7F7E8000, 0x00017FFF, 0x0000FFFF,
]


def masters(n: int, seed: int) -> torch.Tensor:
    """Random fp32 bit patterns, a third of them with a low half of 0x7FFF, 0x8000 or 0x8001."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=gen).to(torch.int32)
    near = torch.rand(n, generator=gen) < 1 / 3
    lows = torch.tensor([0x7FFF, 0x8000, 0x8001], dtype=torch.int32)[torch.randint(0, 3, (n,), generator=gen)]
    return torch.where(near, (bits & ~0xFFFF) | lows, bits).view(torch.float32)


def special_masters() -> torch.Tensor:
    """`SPECIAL` repeated 8 times with one element of filler between, so each pattern takes every bit
    position of its tie byte (the period, 31, is odd)."""
    assert len(SPECIAL) % 2 == 0
    period = torch.tensor([*SPECIAL, 0x12345678], dtype=torch.int64).to(torch.int32)
    return period.repeat(8).view(torch.float32)


def poisoned(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``low`` and ``ties`` for ``n`` elements, every byte set, so every byte written shows."""
    return torch.full((n,), -1, dtype=torch.int16), torch.full((codec.tie_bytes(n),), 0xFF, dtype=torch.uint8)


def split_by(path: str, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low, ties = poisoned(master.numel())
    if path == "triton":
        triton_codec.split_master(master, low, ties)
    elif path == "native":
        native.split_master(master, low, ties)
    else:
        with mock.patch.object(native, "has_split_master", return_value=False):
            codec.split_master(master, low, ties)
    return low, ties


def join_by(path: str, high: torch.Tensor, low: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    out = torch.full((high.numel(),), float("nan"))
    if path == "triton":
        triton_codec.join_master(high, low, ties, out)
    elif path == "native":
        native.join_master(high, low, ties, out)
    else:
        with mock.patch.object(native, "has_split_master", return_value=False):
            codec.join_master(high, low, ties, out)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_round_trip(master: torch.Tensor) -> None:
    """Split and join by Triton: the bytes of the native codec and of the torch path, and the master
    back bit for bit (a NaN as a NaN)."""
    low, ties = split_by("triton", master)
    for path in ("native", "torch"):
        want_low, want_ties = split_by(path, master)
        assert same_bits(low, want_low), f"low differs from the {path} path's"
        assert same_bits(ties, want_ties), f"ties differ from the {path} path's"
    high = master.to(torch.bfloat16)
    out = join_by("triton", high, low, ties)
    assert same_bits(out, join_by("native", high, low, ties)), "join differs from the native path's"
    finite = ~master.isnan()
    assert torch.equal(out.view(torch.int32)[finite], master.view(torch.int32)[finite]), "a master did not round-trip"
    assert out[~finite].isnan().all(), "a NaN came back as a number"


def check_join_on_any_input(n: int, seed: int) -> None:
    """Any high, low and ties, a master's or not: Triton's join writes the other paths' bits."""
    gen = torch.Generator().manual_seed(seed)
    high = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    low = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=gen)
    low[torch.rand(n, generator=gen) < 0.3] = -0x8000  # 0x8000: the tie bit decides
    ties = torch.randint(0, 256, (codec.tie_bytes(n),), dtype=torch.uint8, generator=gen)
    out = join_by("triton", high, low, ties)
    for path in ("native", "torch"):
        assert same_bits(out, join_by(path, high, low, ties)), f"join differs from the {path} path's"


def check_views_at_offsets() -> None:
    """Tensors that start inside larger buffers: at odd element offsets (pointers not 16-byte aligned),
    and a master slice at a multiple of 8 whose low half and tie bytes are the same slices of the
    whole's."""
    n = 2 * BLOCK + 5
    whole = masters(n + 1, seed=11)
    master = whole[1:]
    low = torch.full((n + 3,), -1, dtype=torch.int16)[3:]
    ties = torch.full((codec.tie_bytes(n) + 1,), 0xFF, dtype=torch.uint8)[1:]
    triton_codec.split_master(master, low, ties)
    want_low, want_ties = split_by("native", master.clone())
    assert same_bits(low, want_low) and same_bits(ties, want_ties), "split of misaligned views"
    high = torch.empty(n + 1, dtype=torch.bfloat16)[1:]
    high.copy_(master)
    out = torch.full((n + 1,), float("nan"))[1:]
    triton_codec.join_master(high, low, ties, out)
    assert same_bits(out, join_by("native", high.clone(), want_low, want_ties)), "join of misaligned views"

    start = 8 * 37
    whole_low, whole_ties = split_by("native", master)
    part_low, part_ties = poisoned(n)
    triton_codec.split_master(master[start:], part_low[start:], part_ties[start // 8 :])
    assert same_bits(part_low[start:], whole_low[start:]), "low of a slice at a multiple of 8"
    assert same_bits(part_ties[start // 8 :], whole_ties[start // 8 :]), "ties of a slice at a multiple of 8"
    assert (part_ties[: start // 8] == 0xFF).all() and (part_low[:start] == -1).all(), "wrote outside the slice"


def cases() -> dict[str, Callable[[], None]]:
    found: dict[str, Callable[[], None]] = {}
    for n in SIZES:
        found[f"round_trip[{n}]"] = lambda n=n: check_round_trip(masters(n, seed=n))
        found[f"join_any_input[{n}]"] = lambda n=n: check_join_on_any_input(n, seed=n + 1)
    found["round_trip[special]"] = lambda: check_round_trip(special_masters())
    found["views_at_offsets"] = check_views_at_offsets
    return found


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 in the environment (Triton's interpreter on CPU tensors)")
    results: dict[str, str | None] = {}
    for name, check in cases().items():
        try:
            check()
            results[name] = None
        except Exception:  # every case reports, not only the first to fail
            results[name] = traceback.format_exc(limit=-3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
