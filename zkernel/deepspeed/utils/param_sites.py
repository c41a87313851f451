"""Where a model parameter lives in a zkernel engine: its engine, group, position and this rank's fragments.

DeepSpeed tags each parameter with its optimizer's bookkeeping, so
``safe_get_full_grad(param)`` needs nothing but the parameter. zkernel leaves
parameters untagged; `zkernel.deepspeed.initialize` records each engine it
builds (`zkernel.deepspeed.zero.track`), and `site_of` finds the live engine
whose model holds a parameter and the parameter's place in it, indexed once per
engine by identity.
"""

from __future__ import annotations

import weakref

import attrs
import torch
import torch.distributed as dist

from zkernel.deepspeed import zero
from zkernel.spec.groups import Fragment, ParamGroup, ShardLayout

# engine -> {id(param): (param, ParamSite)}; a site holds its engine weakly.
_indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@attrs.frozen(kw_only=True)
class ParamSite:
    """A trainable parameter's place in an engine: its ``group`` (a trainable one), its ``position`` in
    ``group.params``, its ``name`` and whole ``shape``, the shard ``layout`` and the ``fragments`` of
    the parameter this rank's shard holds (none on a rank whose shard holds none of it)."""

    engine_ref: weakref.ref = attrs.field(repr=False)
    group: ParamGroup = attrs.field(repr=False)
    position: int
    name: str
    shape: torch.Size
    layout: ShardLayout = attrs.field(repr=False)
    fragments: tuple[Fragment, ...]

    @property
    def engine(self):
        return self.engine_ref()

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def comm_device(self) -> torch.device:
        """Where the ranks sum a whole tensor: the compute device under NCCL, else the CPU."""
        engine = self.engine
        if engine.dist.distributed and dist.get_backend() == "nccl":
            return engine.device
        return torch.device("cpu")


def site_of(param: torch.Tensor) -> ParamSite | None:
    """``param``'s `ParamSite`, or None where no registered engine trains it (a frozen parameter, one
    of no engine's model)."""
    engines = zero.tracked()
    for engine in sorted(engines, key=lambda e: e.closed):  # a closed engine's, to say so, only if no live one
        entry = _index(engine).get(id(param))
        if entry is not None and entry[0] is param:
            return entry[1]
    return None


def _index(engine) -> dict[int, tuple[torch.Tensor, ParamSite | None]]:
    index = _indexes.get(engine)
    if index is None:
        index = _indexes[engine] = _build_index(engine)
    return index


def _build_index(engine) -> dict[int, tuple[torch.Tensor, ParamSite | None]]:
    """Every parameter of the engine's model: its site where a trainable group holds it, else None."""
    index: dict[int, tuple[torch.Tensor, ParamSite | None]] = {
        id(p): (p, None) for p in engine.module.parameters()
    }
    ref = weakref.ref(engine)
    for group in engine.trainable_groups:
        layout = group.shard_layout or engine.hook.zkernel_describe_shard(group=group)
        if layout is None:
            raise RuntimeError(
                f"partitioner {engine.config.partitioner!r} does not describe its shard of group {group.name!r} "
                "(hook zkernel_describe_shard), so zkernel.deepspeed.utils cannot find its parameters' values"
            )
        for position, (param, name) in enumerate(zip(group.params, group.param_names)):
            shape = engine.original_tensors.get(name, (param.shape, param.dtype))[0]
            index[id(param)] = (param, ParamSite(
                engine_ref=ref, group=group, position=position, name=name, shape=torch.Size(shape), layout=layout,
                fragments=tuple(f for f in layout.fragments if f.param == position),
            ))  # fmt: skip
    return index
