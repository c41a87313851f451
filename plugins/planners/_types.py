"""What the default planner judges: a candidate placement, how its activations are kept, and the outcome."""

from __future__ import annotations

import enum

import attrs


class Mode(enum.Enum):
    """How the blocks' activations are kept."""

    AS_CONFIGURED = "as configured"
    PLAIN = "no checkpointing"
    CHECKPOINT = "every block checkpointed"
    OFFLOAD = "every block checkpointed, inputs in host memory"


@attrs.frozen
class Candidate:
    partitioner: str
    optimizer: str
    params: str
    mode: Mode
    # Options the planner gives the optimizer tier beyond the config's, as (name, value) pairs
    # (its split turned off: `TierSizing.split_option`).
    tier_options: tuple[tuple[str, object], ...] = ()

    def text(self) -> str:
        where = {"none": "device"}
        text = f"{self.partitioner} optimizer@{where.get(self.optimizer, self.optimizer)} params@{where.get(self.params, self.params)}"
        text = text if self.mode is Mode.AS_CONFIGURED else f"{text} ({self.mode.value})"
        return " ".join([text, *(f"{k} {str(v).lower()}" for k, v in self.tier_options)])


@attrs.frozen
class Outcome:
    """One candidate judged: bytes by place and kind, what is short, and what was added to make it fit."""

    need: dict[str, dict[str, int]]
    report: dict[str, dict[str, int]]
    short: list[str]
    tiling: tuple[int, int] | None = None
    # The optimizer tier's spill fractions the bytes were counted with (given, or sized here).
    shares: dict[str, float] = attrs.field(factory=dict)

    @property
    def disk(self) -> int:
        """Bytes per rank in swap files: what every step moves over the disk."""
        return sum(self.need.get("nvme", {}).values())

    def shares_text(self) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in self.shares.items() if v > 0)


@attrs.frozen
class States:
    """A candidate's model states at given spill fractions, and what they need beside them."""

    report: dict[str, dict[str, int]]
    largest: int  # bytes of the largest group while gathered or reduced
    prefetch: int  # zero3's prefetch window
    pools: int  # page-locked host pools the nvme tiers stream swap files through
