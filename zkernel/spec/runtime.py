"""What a component is built with: the validated config and where this process sits."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.spec.config import Config
from zkernel.platform.distributed import DistInfo
from zkernel.platform.streams import Streams
from zkernel.telemetry.timeline import Timeline
from zkernel.spec.tiers import PlacementInfo


@attrs.frozen(kw_only=True)
class RuntimeContext:
    """Passed to every component factory and to `zkernel_partition_params`."""

    config: Config
    dist: DistInfo
    # Dtype of parameters and activations during forward/backward.
    compute_dtype: torch.dtype
    # The selected component's own validated options (None when it takes none).
    options: Any = None
    # Side streams for transfers (see [Note: streams and events]).
    streams: Streams = attrs.field(factory=Streams)
    # The engine's one host worker thread (see [Note: tier threads] in zkernel.spec.tiers).
    host_worker: ThreadPoolExecutor | None = None
    # The engine's step timeline (disabled unless config.timeline); components add spans to it.
    timeline: Timeline = attrs.field(factory=lambda: Timeline("cpu", enabled=False))
    # Where the tiers keep masters and parameter shards (set for the partitioner).
    placement: PlacementInfo | None = None
    # `initialize`'s ``init_fn``: initialises one module of a meta-device model when a
    # partitioner materialises it; None means the module's own ``reset_parameters()``.
    init_fn: Callable[[nn.Module], Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    # Names of the parameters and buffers a partitioner's construction of a meta-device model left
    # unset (the initialiser did not write them); the partitioner adds to it while it partitions, and
    # the kernel refuses to use them until a load writes them ([Note: values left unset] in
    # `zkernel.params.unset`). One set shared by every context evolved from the same base.
    left_unset: set[str] = attrs.field(factory=set, eq=False)

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def device(self) -> torch.device:
        return self.dist.device
