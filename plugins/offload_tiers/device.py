"""Tier ``none``: optimizer state and parameters stay on the compute device.

The trivial tier: every hook is a no-op because the partitioner already keeps
masters, gradients and optimizer state where compute runs (the GPU when there
is one). It exists so that ``offload.optimizer = "none"`` names a component
like any other, and as the smallest example of a tier plugin.
"""

from __future__ import annotations

from zkernel import hookimpl


class DeviceTier:
    """State stays where compute is; nothing to fetch or write back."""

    def __init__(self, context, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"DeviceTier(role={self.role!r})"


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "none",
        DeviceTier,
        description="state stays on the compute device (GPU when present, else CPU)",
    )
