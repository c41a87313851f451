"""What the builtin tiers answer for their bytes (``zkernel_size_offload_tier``).

Each answer says where the tier keeps the buffers of the role it serves, as
its ``zkernel_memory_tensors`` names them after a step (tests/sizing/test_estimator.py
holds the answers to ``memory_report()``):

* ``none``: everything on the compute device. As the optimizer tier it adopts
  the reduced gradient as its landing buffer and writes updates straight into
  parameters that live on the device.
* ``cpu``: the fp32 master, optimizer state, fp32 gradient landing buffer and
  the compute-dtype staging copy in (pinned) host memory; as the params tier,
  the compute-dtype shard in host memory. Host steps round their updates into
  buffers lent per step from one pool of ``staging_buffers`` (each as large
  as the largest group). ``gpu_share`` keeps the optimizer of the first groups
  on the GPU ([Note: GPU share] in `_gpu_share`): module-bound groups as they are
  adopted, the others moved after the first step (their master then a copy);
  ``"auto"`` (the default) is sized after the first step from the GPU memory
  it left and is answered as 0: host memory holds every group until then.
* ``nvme``: master and optimizer state in swap files, the gradient landing
  buffer and staging copy in host memory; ``gpu_share`` (a number placed at
  adopt; ``"auto"``, the default, moves groups after the first step and is
  answered as 0, as the cpu tier's) and
  ``host_share`` keep the first groups' optimizer on the GPU and in host
  memory ([Note: spill] in `nvme`). Files stream through a
  page-locked pool (``buffer_bytes``, else `DEFAULT_BUFFER_BYTES` or two of
  the largest group's file image, capped at all of them). As the params tier,
  the shard in swap files, read through its own pool (``buffer_bytes``, else
  the host look-ahead plus four of the largest shard, capped at twice all);
  it lends the optimizer a buffer for each update, so no staging copy is kept.

Both optimizer tiers answer their ``split_master`` option
(`TierSizing.split_master`: the masters on the GPU, in host memory and, for ``nvme`` with ``true``, in swap files kept as
a low half and a tie bit, 2.125 bytes an element, where the run allows it;
[Note: sizing a split master] in
`zkernel.spec.sizing` and [Note: split masters in the tiers] in
`_split_master`). ``"auto"``, the default, is true for ``nvme`` (more of the
optimizer stays off the disk) and false for ``cpu`` (chosen where host memory
holds everything, where the split would only add a download of the bf16 shard
and two host passes a step). Each place rebuilds its split masters into one
lent buffer at a time (`TierSizing.split_buffers`).
"""

from __future__ import annotations

from collections.abc import Sequence

from zkernel.spec import DEVICE, Role, Spill, TierSizing

from ._arena import aligned

_ON_DEVICE = {Role.MASTER: DEVICE, Role.GRAD_LANDING: DEVICE, Role.OPTIMIZER_STATE: DEVICE, Role.STAGING: DEVICE}
_ON_HOST = {Role.MASTER: "cpu", Role.GRAD_LANDING: "cpu", Role.OPTIMIZER_STATE: "cpu", Role.STAGING: "cpu"}
_IN_MEMORY = (DEVICE, "cpu")  # where the tiers keep masters split: the GPU share and host memory
_ON_DISK = {Role.MASTER: "nvme", Role.GRAD_LANDING: "cpu", Role.OPTIMIZER_STATE: "nvme", Role.STAGING: "cpu"}


def split_master(options, auto: bool, places: tuple[str, ...] = _IN_MEMORY) -> tuple[str, ...]:
    """Where the tier keeps masters split (`TierSizing.split_master`: ``places``) by its ``split_master``
    option (``"auto"``: as ``auto``); asked by `cpu_footprint` and `nvme_footprint`."""
    value = options.split_master
    return places if (auto if value == "auto" else bool(value)) else ()


def _share(value) -> float:
    """A fraction the options give; a value sized at run time ("auto") counts 0."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def device_footprint(role: str) -> TierSizing:
    if role == "optimizer":
        return TierSizing(role=role, where=_ON_DEVICE)
    return TierSizing(role=role, where={Role.PARAM_SHARD: DEVICE})


def cpu_footprint(role: str, options) -> TierSizing:
    if role == "params":
        return TierSizing(role=role, where={Role.PARAM_SHARD: "cpu"})
    return TierSizing(
        role=role,
        where=_ON_HOST,
        spills=(Spill(option="gpu_share", share=_share(options.gpu_share), where=_ON_DEVICE, cuda_only=True, at_adopt=False),),
        staging_pool=options.staging_buffers,
        steps_on="cpu",
        split_master=split_master(options, auto=False),
        split_option="split_master",
    )


def nvme_footprint(role: str, options) -> TierSizing:
    from ._nvme_optimizer import DEFAULT_BUFFER_BYTES

    if role == "params":

        def params_pool(groups: Sequence[Sequence[int]]) -> int:
            shards = [aligned(n) for group in groups for n in group]
            if not shards:
                return 0
            return options.buffer_bytes or min(2 * sum(shards), options.lookahead_host_bytes + 4 * max(shards))

        return TierSizing(role=role, where={Role.PARAM_SHARD: "nvme"}, lends_update_buffer=True, pool_bytes=params_pool)

    def optimizer_pool(groups: Sequence[Sequence[int]]) -> int:
        files = [f for f in (sum(aligned(n) for n in group) for group in groups) if f]
        if not files:
            return 0
        return options.buffer_bytes or min(sum(files), max(DEFAULT_BUFFER_BYTES, 2 * max(files)))

    return TierSizing(
        role=role,
        where=_ON_DISK,
        spills=(
            Spill(option="gpu_share", share=_share(options.gpu_share), where=_ON_DEVICE, cuda_only=True),
            Spill(option="host_share", share=_share(options.host_share), where=_ON_HOST),
        ),
        staging_pool=options.staging_buffers,
        steps_on="cpu",
        pool_bytes=optimizer_pool,
        # true: its swap files too; "auto": the GPU and host memory only
        split_master=split_master(options, auto=True, places=(*_IN_MEMORY, "nvme") if options.split_master is True else _IN_MEMORY),
        split_option="split_master",
    )
