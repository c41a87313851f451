"""Materialising a meta-device model one unit at a time (zero3's partitioned construction).

A model built under ``torch.device("meta")`` has shapes and no storage. zero3
asks for its units one at a time; each unit's parameters are allocated on the
compute device, initialised, sliced and freed before the next unit is built,
so no rank ever holds more than one whole unit beyond its shards. Buffers
left on meta (a Hugging Face rotary embedding's ``inv_freq``) are built the
same way, one owning module at a time, after the last unit.

[Note: materialising a unit] Each materialisation is a *job* over a set T of
meta tensors (one unit's parameters, or one module's buffers):

1. Every tensor of T gets storage on the device, filled with NaN (an integer
   buffer: its dtype's minimum), and takes the place of its meta tensor with
   ``torch.utils.swap_tensors``, so the Python object stays the same: a tied
   parameter held by two modules (``lm_head.weight is wte.weight``) is still
   one object, and references the user took before ``initialize`` stay valid.
   Where a swap is impossible (a weak reference to the tensor exists) a new
   object replaces the old one in every module that holds it.
2. Under the job's seed, ``reset_parameters()`` runs on each module that
   holds a tensor of T and has one, children first, as the module's
   constructor ran it in an eager build; then ``init_fn``, where given, runs
   on those holders and on every ancestor of theirs, children before parents
   (the order of Hugging Face's ``initialize_weights``): an ``init_fn`` may
   write a module's own tensors and any descendant's (HF's GPT-2 init scales
   ``attn.c_proj.weight`` from the attention module). So an ``init_fn`` that
   writes only some modules (a parent's initialiser that knows some of its
   children) leaves the others with their own initialisation, as eager
   construction followed by that initialiser would, not unset.
   ``reset_parameters()`` runs on the holders only: by torch's convention it
   initialises a module's own tensors, and a root ``reset_parameters`` that
   re-initialises the whole model (the demo GPT has one) would otherwise run
   once per unit, at a cost that grows with the square of the depth. While
   the initialiser runs, every slot of the model outside T holds a meta
   stand-in of its tensor's original shape, so writes to it are free no-ops:
   tensors of earlier units (already sliced), of later units (still meta) and
   the ones the user built on a real device are left alone.
3. Every tensor of T must have been written. A parameter or a persistent
   buffer left unset (a NaN or the integer sentinel left behind, also where
   its module has no way to initialise it) is recorded (``unset``), for a
   load to write before anything uses it ([Note: values left unset] in
   `zkernel.params.unset`): a model built with accelerate's ``init_empty_weights()``
   and given its weights by `Engine.load_state_dict` needs no initialiser.
   A non-persistent buffer left unset, or one whose module has no
   ``reset_parameters()`` when there is no ``init_fn``, is an error naming
   the tensor and the module that holds it: no load could write it.

[Note: sub-models' own initialisers] ``init_fn`` given as a bound method of
the root model (``model._init_weights``) runs, on a module inside a sub-model
that has its own method of that name from the same family (the most basic
class that defines it: Hugging Face's ``PreTrainedModel``), as that
sub-model's method instead: a LLaVA's vision tower is initialised by the
CLIP vision model's ``_init_weights`` with the CLIP config, as Hugging Face's
``initialize_weights`` dispatches. The nearest such sub-model on the
module's first path from the root wins; a plain callable runs everywhere as
given.

[Note: parametrized tensors] A tensor under ``torch.nn.utils.parametrize``
(``weight_norm``: ``conv.parametrizations.weight.original0/1``) cannot be
written through its module: ``conv.weight`` is computed from the originals,
so an initialiser's in-place write lands on a temporary (Hugging Face's own
``_init_weights`` of wav2vec2's positional convolution is such a no-op; the
values it ends with come from ``Conv1d``'s constructor, decomposed when
``weight_norm`` was applied). Where the originals are still unset after the
initialiser, the module's own class initialises a plain tensor of the
parametrized shape (its ``reset_parameters()``, on a copy of the module whose
other tensors are meta stand-ins) and the parametrization's
``right_inverse`` writes the originals from it, as a model built on a real
device had them.

A tensor held by several modules (a tie) is written only through its first
holder in registration order, the module whose name ``named_parameters()``
gives it; the other holders' slots hold the stand-in during the job. That is
what Hugging Face's construction does (the head is initialised, then tied to
the input embedding, whose values win), and it is the same on every rank
whichever unit the tie falls in. So each tensor ends with the value a full
children-first initialisation pass would give it, with random draws that
depend only on the job's seed and T.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from zkernel.telemetry.log import get_logger
from zkernel.telemetry.progress import progress

log = get_logger()

InitFn = Callable[[nn.Module], object]
_SlotMap = dict  # a module's ``_parameters`` or ``_buffers``


def _describe(path: str, module: nn.Module) -> str:
    return f"`{path}` ({type(module).__name__})" if path else f"the root module ({type(module).__name__})"


def _sentinel_fill(t: torch.Tensor) -> None:
    """Fill ``t`` with a value no initialiser writes, so an unwritten element can be found."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)
    else:
        t.fill_(False)  # no sentinel exists for bool: not checked


def _unwritten(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.isnan().any()
    if t.dtype != torch.bool:
        return (t == torch.iinfo(t.dtype).min).any()
    return torch.zeros((), dtype=torch.bool, device=t.device)


class MetaMaterializer:
    """Builds the meta tensors of ``root`` on ``device``, one job at a time (see [Note: materialising a unit]).

    ``init_fn(module)`` initialises a module (Hugging Face: ``model._init_weights``)
    after ``module.reset_parameters()``, which runs where the module has one. The names
    of parameters and persistent buffers left unset are added to ``unset`` as
    each job ends. Create it before any tensor of ``root`` is materialised: it
    records every tensor's original shape.
    """

    def __init__(
        self, root: nn.Module, device: torch.device, init_fn: InitFn | None = None, unset: set[str] | None = None
    ) -> None:
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be a callable taking one module, got {type(init_fn).__name__}")
        self.root = root
        self.device = torch.device(device)
        self.init_fn = init_fn
        self.unset: set[str] = set() if unset is None else unset  # values the initialiser left unset
        self._path: dict[int, str] = {}
        self._pre_order: list[nn.Module] = []
        self._post_order: list[nn.Module] = []
        self._parents: dict[int, set[int]] = {}
        self._initializer: dict[int, InitFn] = {}  # module -> the init_fn that runs on it
        self._family = _family(init_fn, root)
        self._visit(root, "", set(), init_fn)
        # For each tensor: every (slot map, name) holding it and the modules holding it, in
        # registration order (the first is its canonical holder), its name and meta stand-in.
        self._slots: dict[int, list[tuple[_SlotMap, str]]] = {}
        self._holders: dict[int, list[nn.Module]] = {}
        self._names: dict[int, str] = {}
        self._stand_in: dict[int, torch.Tensor] = {}
        for module in self._pre_order:
            for slots, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in slots.items():
                    if t is None:
                        continue
                    self._slots.setdefault(id(t), []).append((slots, name))
                    self._holders.setdefault(id(t), []).append(module)
                    if id(t) not in self._stand_in:
                        path = self._path[id(module)]
                        self._names[id(t)] = f"{path}.{name}" if path else name
                        twin = torch.empty_like(t, device="meta")
                        self._stand_in[id(t)] = nn.Parameter(twin, requires_grad=t.requires_grad) if is_param else twin
        self._order = {id(m): i for i, m in enumerate(self._post_order)}
        self._modules = {id(m): m for m in self._post_order}

    def _visit(self, module: nn.Module, path: str, seen: set[int], init_fn: InitFn | None) -> None:
        """Pre- and post-order of the distinct modules, their first paths, parents and initialisers."""
        seen.add(id(module))
        self._path[id(module)] = path
        self._pre_order.append(module)
        self._parents.setdefault(id(module), set())
        if self._family is not None and module is not self.root and isinstance(module, self._family[1]):
            init_fn = getattr(module, self._family[0])  # a sub-model's own ([Note: sub-models' own initialisers])
        self._initializer[id(module)] = init_fn
        for name, child in module.named_children():
            self._parents.setdefault(id(child), set()).add(id(module))
            if id(child) not in seen:
                self._visit(child, f"{path}.{name}" if path else name, seen, init_fn)
        self._post_order.append(module)

    # -- public ---------------------------------------------------------------------

    def parameters(self, named: Sequence[tuple[str, nn.Parameter]], seed: int) -> list[tuple[str, nn.Parameter]]:
        """Materialise the meta parameters among ``named`` (one unit) under ``seed``; ``named`` with real tensors."""
        meta = [p for _, p in named if p.is_meta]
        if meta:
            self._job(meta, seed, "parameter")
        return [(name, self.root.get_parameter(name)) for name, _ in named]

    def buffers(self, seed: int) -> int:
        """Materialise every buffer still on meta, one holding module per job (seeds ``seed``, ``seed + 1``, ...).

        Returns how many modules had meta buffers.
        """
        jobs = 0
        for module in self._pre_order:
            meta = [
                b for b in module._buffers.values()
                if b is not None and b.is_meta and self._holders[id(b)][0] is module
            ]
            if meta:
                self._job(meta, seed + jobs, "buffer")
                jobs += 1
        return jobs

    # -- one job ----------------------------------------------------------------------

    def _job(self, tensors: list[torch.Tensor], seed: int, kind: str) -> None:
        ids = [id(t) for t in tensors]
        scope = self._scope(ids)
        if self.init_fn is None and kind == "buffer":  # a value a load can write waits for it
            self._check_reset_parameters([i for i in ids if not self._loadable(i)])
        real = [self._allocate(t) for t in tensors]
        ids = [id(t) for t in real]
        hidden = self._hide_all_but(set(ids))
        try:
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(seed)
                holders = {id(self._holders[i][0]) for i in ids}
                for module in scope:  # the module's own first, as its constructor ran it
                    if id(module) in holders and hasattr(module, "reset_parameters"):
                        self._init(module, module.reset_parameters, "reset_parameters()")
                if self.init_fn is not None:
                    for module in scope:
                        self._init(module, lambda m=module: self._initializer[id(m)](m), "init_fn")
                self._init_parametrized(real)
        finally:
            for slots, name, t in hidden:
                slots[name] = t
        self._check_written(real, kind)

    def _scope(self, ids: Iterable[int]) -> list[nn.Module]:
        """Canonical holders of the tensors, and with ``init_fn`` all their ancestors; children first."""
        found: dict[int, nn.Module] = {}
        stack = [self._holders[i][0] for i in ids]
        while stack:
            module = stack.pop()
            if id(module) in found:
                continue
            found[id(module)] = module
            if self.init_fn is not None:
                stack.extend(self._modules[p] for p in self._parents[id(module)])
        return sorted(found.values(), key=lambda m: self._order[id(m)])

    def _allocate(self, t: torch.Tensor) -> torch.Tensor:
        """Storage for meta tensor ``t`` on the device, put in its place everywhere; returns the real tensor."""
        value = torch.empty_like(self._stand_in[id(t)], device=self.device)
        _sentinel_fill(value)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(value, requires_grad=t.requires_grad)
            new.__dict__.update(t.__dict__)
        else:
            new = value
        try:
            torch.utils.swap_tensors(t, new)  # the object stays; it also takes ``new``'s (copied) __dict__
            return t
        except RuntimeError as err:
            log.debug("zkernel.materialize.rebind", tensor=self._names[id(t)], reason=str(err))
        for slots, name in self._slots[id(t)]:
            slots[name] = new
        for table in (self._slots, self._holders, self._names, self._stand_in):
            table[id(new)] = table.pop(id(t))
        return new

    def _hide_all_but(self, keep: set[int]) -> list[tuple[_SlotMap, str, torch.Tensor]]:
        """Meta stand-ins in every slot with storage but the canonical slots of ``keep``; what to put back."""
        hidden = []
        for i, slots_of in self._slots.items():
            for k, (slots, name) in enumerate(slots_of):
                if k == 0 and i in keep:
                    continue
                t = slots[name]
                if t is not None and not t.is_meta:
                    hidden.append((slots, name, t))
                    slots[name] = self._stand_in[i]
        return hidden

    def _init(self, module: nn.Module, initialise: Callable[[], object], label: str) -> None:
        try:
            initialise()
        except Exception as err:
            raise RuntimeError(
                f"zero3 could not initialise {_describe(self._path[id(module)], module)} while materialising "
                f"a model built on the meta device: {label} raised {type(err).__name__}: {err}"
            ) from err

    def _init_parametrized(self, tensors: list[torch.Tensor]) -> None:
        """Originals of parametrizations the initialiser left unset, from their module's own initialisation
        through ``right_inverse`` ([Note: parametrized tensors])."""
        lists = {}
        for t in tensors:
            holder = self._holders[id(t)][0]
            if isinstance(holder, parametrize.ParametrizationList) and bool(_unwritten(t)):
                lists[id(holder)] = holder
        for plist in lists.values():
            path = self._path[id(plist)]
            owner_path, _, name = ("." + path).rpartition(".parametrizations.")
            owner = self.root.get_submodule(owner_path.lstrip("."))
            plain = next((c for c in type(owner).__mro__ if not getattr(c, "__module__", "").endswith("parametrize")), None)
            if plain is None or not hasattr(plain, "reset_parameters"):
                continue  # left unset: _check_written names it
            value = torch.empty_like(plist(), device=self.device)
            proxy = plain.__new__(plain)
            proxy.__dict__.update(owner.__dict__)
            stand_in = {k: torch.empty_like(v, device="meta") for k, v in owner._parameters.items() if v is not None}
            proxy.__dict__.update(_parameters={**stand_in, name: nn.Parameter(value)}, _modules={},
                                  _buffers={k: torch.empty_like(v, device="meta") for k, v in owner._buffers.items()
                                            if v is not None})  # fmt: skip
            plain.reset_parameters(proxy)
            plist.right_inverse(value)

    def _check_reset_parameters(self, ids: list[int]) -> None:
        """Non-persistent buffers ``ids`` must have a ``reset_parameters()`` to write them."""
        for i in ids:
            module = self._holders[i][0]
            if isinstance(module, parametrize.ParametrizationList):
                continue  # set from its module's own initialisation ([Note: parametrized tensors])
            if not hasattr(module, "reset_parameters"):
                raise ValueError(
                    f"zero3 cannot initialise meta-device non-persistent buffer `{self._names[i]}` (no "
                    "load could write it): its module "
                    f"{_describe(self._path[id(module)], module)} has no reset_parameters(). Pass "
                    "zkernel.initialize(..., init_fn=fn) where fn(module) initialises a module's "
                    "tensors (for a Hugging Face model: init_fn=model._init_weights), give the module "
                    "a reset_parameters(), or build it on a real device"
                )

    def _loadable(self, i: int) -> bool:
        """Whether a load can write tensor ``i``: a parameter, or a persistent buffer."""
        slots, name = self._slots[i][0]
        holder = self._holders[i][0]
        return slots is holder._parameters or name not in holder._non_persistent_buffers_set

    def _check_written(self, tensors: list[torch.Tensor], kind: str) -> None:
        flags = torch.stack([_unwritten(t) for t in tensors]).cpu()
        for t, bad in zip(tensors, flags.tolist()):
            if bad and self._loadable(id(t)):
                self.unset.add(self._names[id(t)])  # for a load to write ([Note: values left unset])
            elif bad:
                module = self._holders[id(t)][0]
                how = "init_fn" if self.init_fn is not None else "reset_parameters()"
                raise ValueError(
                    f"zero3 materialised meta-device {kind} `{self._names[id(t)]}` of "
                    f"{_describe(self._path[id(module)], module)}, but {how} left some of its values "
                    "unset. A non-persistent buffer's values must come from the initialiser (it is in no "
                    "state dict a load could write it from): for a Hugging Face model pass "
                    "init_fn=model._init_weights, where that leaves it unset a function that calls it and "
                    "also writes this buffer; otherwise build that module on a real device"
                )


def _family(init_fn: InitFn | None, root: nn.Module) -> tuple[str, type] | None:
    """(method name, the most basic class defining it) where ``init_fn`` is a method bound to ``root``."""
    if not inspect.ismethod(init_fn) or init_fn.__self__ is not root:
        return None
    name = init_fn.__func__.__name__
    definers = [cls for cls in type(root).__mro__ if name in vars(cls)]
    return (name, definers[-1]) if definers else None


def materialized_units(
    root: nn.Module,
    units: Sequence[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]],
    device: torch.device,
    seed: int,
    init_fn: InitFn | None = None,
    unset: set[str] | None = None,
) -> Iterator[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Yield ``units`` (zero3's ``module_units``) with their meta parameters materialised, one at a time.

    Unit *i* is built under ``seed + i`` only when the caller asks for it, so
    a caller that slices and frees each unit before the next holds one whole
    unit at a time. After the last unit, buffers still on meta are built under
    ``seed + len(units)``, ``seed + len(units) + 1``, ... A model with nothing
    on meta passes through untouched. The names of parameters the initialiser
    left unset are added to ``unset`` as each unit is yielded, those of buffers
    after the last.
    """
    has_meta = any(t.is_meta for t in root.parameters()) or any(b.is_meta for b in root.buffers())
    if not has_meta:
        yield from units
        return
    materializer = MetaMaterializer(root, device, init_fn, unset)
    meta_bytes = sum(p.numel() * p.element_size() for _, _, named in units for _, p in named if p.is_meta)
    with progress(meta_bytes, "building the model") as bar:
        for index, (unit_name, unit, named) in enumerate(units):
            nbytes = sum(p.numel() * p.element_size() for _, p in named if p.is_meta)
            yield unit_name, unit, materializer.parameters(named, seed + index)
            bar.update(nbytes)
    jobs = materializer.buffers(seed + len(units))
    log.debug("zkernel.materialize.done", units=len(units), buffer_modules=jobs, device=str(device))
