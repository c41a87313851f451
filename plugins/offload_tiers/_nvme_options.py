"""Options of the ``nvme`` tier, one class per role (``offload.optimizer_options``, ``offload.params_options``)."""

from __future__ import annotations

import attrs

from zkernel.platform.aio import ALIGNMENT, DEFAULT_BLOCK_SIZE, DEFAULT_THREADS
from zkernel.spec.config import ConfigError
from zkernel.spec.options import OptionValidator, choice, integer, number


def _block_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= ALIGNMENT and value % ALIGNMENT == 0


_BLOCK_SIZE = OptionValidator(_block_size, f"a positive multiple of {ALIGNMENT} (bytes)")
_SHARE = OptionValidator(lambda v: number(minimum=0.0).test(v) and v <= 1.0, "a number in [0, 1] (a fraction of the trainable elements)")
_SHARE_OR_AUTO = OptionValidator(lambda v: v == "auto" or _SHARE.test(v), 'a number in [0, 1], or "auto"')



@attrs.frozen(kw_only=True)
class NvmeTierOptions:
    """``offload.optimizer_options`` of the ``nvme`` tier."""

    # Elements of one tensor per swap-file request: the unit of a read or write and of its CRC32C.
    sub_group_size: int = attrs.field(default=1 << 24, validator=integer(minimum=1024))
    # Bytes of page-locked host memory the step streams masters and state through; None: 2 GiB or
    # twice the largest group's master and state, whichever is more, capped at all of them.
    buffer_bytes: int | None = attrs.field(default=None, validator=integer(minimum=ALIGNMENT, optional=True))
    # Page-lock the buffers (pool and gradient landing): None = where CUDA is available.
    pin_memory: bool | None = None
    # I/O threads (concurrent requests at the disk) of the native async I/O engine.
    aio_threads: int = attrs.field(default=DEFAULT_THREADS, validator=integer(minimum=1))
    # Bytes per request chunk of the native async I/O engine.
    aio_block_size: int = attrs.field(default=DEFAULT_BLOCK_SIZE, validator=_BLOCK_SIZE)
    # Fractions of the trainable elements whose optimizer is not on disk ([Note: spill]): the first
    # ``gpu_share`` in module order (the next forward's order) on the GPU (master, state and fp32
    # gradient; CUDA, zero3 only), the next ``host_share`` with master and state in host memory.
    # ``gpu_share = "auto"``: none at first; after the first step, the first-needed groups that fit
    # the GPU memory it left move there from host memory or disk, as the cpu tier's "auto" does
    # ([Note: a share by default]); 0 without CUDA.
    gpu_share: float | str = attrs.field(default="auto", validator=_SHARE_OR_AUTO)
    # The fraction after gpu_share whose master and state stay in host memory.
    host_share: float = attrs.field(default=0.0, validator=_SHARE)
    # Keep the masters of the GPU and host shares as their low half beside the bf16 parameter shard,
    # 2.125 bytes an element instead of 4, rebuilt for each step ([Note: split masters in the tiers]):
    # "auto" (where the run is bf16 and the params tier keeps shards in memory), true (the same, and in
    # the swap files too: 10.1 bytes an element with Adam's moments instead of 12; an error where it
    # cannot apply), or false.
    split_master: bool | str = attrs.field(default="auto", validator=choice("auto", True, False))
    # Page-locked compute-dtype buffers host steps round updated parameters into before their
    # upload (the cpu tier's option: shared by all groups, each as large as the largest; as many
    # again carry later micro-batches' gradients down for accumulation on the host).
    staging_buffers: int = attrs.field(default=4, validator=integer(minimum=1))
    # Dtype gradients cross to the host in (the cpu tier's option): "fp32", or "bf16" (half the
    # bytes over the link; with accumulation the host still adds into an fp32 landing buffer).
    grad_dtype: str = attrs.field(default="fp32", validator=choice("fp32", "bf16"))
    # With gradient accumulation (the cpu tier's option): fraction of the elements stepped off the GPU
    # whose gradient adds up on the GPU over a window and crosses once, or "auto".
    device_accumulation: float | str = attrs.field(default="auto", validator=_SHARE_OR_AUTO)

    def __attrs_post_init__(self) -> None:
        if self.gpu_share != "auto" and self.gpu_share + self.host_share > 1.0:
            raise ConfigError(
                f"offload.optimizer_options: gpu_share ({self.gpu_share}) + host_share ({self.host_share}) is more "
                "than 1; they are fractions of the trainable elements, and what is left is on disk"
            )


@attrs.frozen(kw_only=True)
class NvmeParamsOptions:
    """``offload.params_options`` of the ``nvme`` tier."""

    # Bytes of parameters ahead of the running unit, in the traced order, to read from disk into
    # host memory, and (nearer) to upload to the device (the nearest prefetch_bytes are gathered).
    lookahead_host_bytes: int = attrs.field(default=2 << 30, validator=integer(minimum=0))
    # The nearer of the two: bytes uploaded to the device ahead of use.
    prefetch_device_bytes: int = attrs.field(default=512 << 20, validator=integer(minimum=0))
    # Bytes of page-locked host memory for shards read ahead and updates written back; None: the
    # host look-ahead plus four of the largest shard, capped at twice all shards together.
    buffer_bytes: int | None = attrs.field(default=None, validator=integer(minimum=ALIGNMENT, optional=True))
    # Elements per swap-file request: the unit of a read or write and of its CRC32C.
    sub_group_size: int = attrs.field(default=1 << 25, validator=integer(minimum=2048))
    # Page-lock the pool: None = where CUDA is available.
    pin_memory: bool | None = None
    # I/O threads (concurrent requests at the disk) of the native async I/O engine.
    aio_threads: int = attrs.field(default=DEFAULT_THREADS, validator=integer(minimum=1))
    # Bytes per request chunk of the native async I/O engine.
    aio_block_size: int = attrs.field(default=DEFAULT_BLOCK_SIZE, validator=_BLOCK_SIZE)
