"""zero3's partitioned construction of meta-device models: ties, initialisers, buffers, errors (world size 1)."""

from __future__ import annotations

import weakref

import pytest
import torch
from structlog.testing import capture_logs
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.models import VOCAB, batches, reference_losses
from tests.support.scenarios import _train_steps
from zkernel_plugins.partitioners._flat import module_units
from zkernel_plugins.partitioners._materialize import MetaMaterializer, materialized_units

DIM = 16
STEPS, ACCUM, MICRO, SEED = 4, 1, 3, 21
LR, CLIP = 2e-2, 1.0


class TiedLM(nn.Module):
    """Embedding and output head sharing one weight; the head may be registered first."""

    def __init__(self, head_first: bool = False) -> None:
        super().__init__()
        if head_first:
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.embed = nn.Embedding(VOCAB, DIM)
        else:
            self.embed = nn.Embedding(VOCAB, DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


class SharedBlocks(TiedLM):
    """Also a weight shared by two blocks: the tie crosses units under either unit policy."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[2].weight = self.blocks[0].weight


MODELS = {"embed_first": TiedLM, "head_first": lambda: TiedLM(head_first=True), "shared_blocks": SharedBlocks}


def _on_meta(factory):
    with torch.device("meta"):
        return factory()


def _zero3(units: str = "modules") -> dict:
    return {
        "partitioner": "zero3",
        "gradient_clipping": CLIP,
        "optimizer": {"lr": LR, "weight_decay": 0.0},
        "partitioner_options": {"persistence_threshold": 0, "units": units, "init_seed": 5},
    }


@pytest.mark.parametrize("units", ["modules", "blocks"])
@pytest.mark.parametrize("name", list(MODELS))
def test_ties_survive_and_train_like_torch(name, units):
    model = _on_meta(MODELS[name])
    engine = zkernel.initialize(model, _zero3(units))
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta
    if name == "shared_blocks":
        assert model.blocks[2].weight is model.blocks[0].weight
    grouped = [p for g in engine.groups for p in g.params]
    assert len(grouped) == len({id(p) for p in grouped}) == len(list(model.parameters()))
    losses = _train_steps(engine, STEPS, ACCUM, MICRO, SEED)

    # The oracle: the same meta model materialised the same way (same units, same seeds, the engine's
    # device: its random generator), kept whole and trained on the CPU.
    reference = _on_meta(MODELS[name])
    for _ in materialized_units(reference, module_units(reference, units), engine.device, 5):
        pass
    reference = reference.cpu()
    assert reference.head.weight is reference.embed.weight
    expected = reference_losses(reference, batches(SEED + 1, STEPS, ACCUM, 1, MICRO), LR, 0.0, CLIP)
    assert expected[-1] < expected[0]
    for i, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: zero3 {a!r} vs torch {b!r}"


def _marking_init(model: nn.Module):
    """An initialiser that writes, into each tensor of a module, that module's index in ``model.modules()``."""
    index = {id(m): float(i) for i, m in enumerate(model.modules())}

    def init(module: nn.Module) -> None:
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            t.fill_(index[id(module)])

    return init, index


@pytest.mark.parametrize("head_first", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_a_tie_is_written_through_its_first_holder_whatever_the_unit_order(head_first, reverse):
    model = _on_meta(lambda: TiedLM(head_first=head_first))
    init, index = _marking_init(model)
    materializer = MetaMaterializer(model, torch.device("cpu"), init)
    units = module_units(model)
    for i, (_, _, named) in enumerate(reversed(units) if reverse else units):
        materializer.parameters(named, seed=i)
    first = model.head if head_first else model.embed
    assert model.head.weight is model.embed.weight
    assert torch.all(model.embed.weight == index[id(first)])
    for block in model.blocks:
        assert torch.all(block.weight == index[id(block)]) and torch.all(block.bias == index[id(block)])


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))


class Parent(nn.Module):
    """Like GPT-2's attention: its own init rescales one child's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Child(), Child()


def _parent_scales_child_b(module: nn.Module) -> None:
    if isinstance(module, Child):
        module.weight.fill_(1.0)
    elif isinstance(module, Parent):
        module.b.weight.fill_(0.5)


def test_an_ancestor_init_runs_after_its_children_and_writes_only_the_unit_being_built():
    with torch.device("meta"):
        model = nn.Sequential(Parent(), Parent())
    loaded = torch.full((4, 4), 7.0)
    model[1].b.weight = nn.Parameter(loaded.clone())  # built on a real device by the user: left alone
    for _, _, named in materialized_units(model, module_units(model), torch.device("cpu"), 0, _parent_scales_child_b):
        # While one unit is built, the others are either still on meta or already materialised.
        assert all(not p.is_meta for _, p in named)
    assert torch.all(model[0].a.weight == 1.0) and torch.all(model[1].a.weight == 1.0)
    assert torch.all(model[0].b.weight == 0.5)
    assert torch.equal(model[1].b.weight, loaded)


class Gain(nn.Module):
    """A module with a parameter and no reset_parameters (like Hugging Face's Conv1D)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


@pytest.mark.usefixtures("zkernel_debug_logs")
def test_a_parameter_whose_module_has_no_reset_parameters_waits_for_a_load():
    """Without init_fn, such a parameter is left unset ([Note: values left unset]): named at initialize,
    refused at the first forward, given by a load (accelerate's ``init_empty_weights`` flow)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Sequential(nn.Tanh(), Gain()))
    with capture_logs() as logs:
        engine = zkernel.initialize(model, _zero3())
    (warning,) = [e for e in logs if e["event"] == "zkernel.initialize.values_unset"]
    assert warning["values"] == ["1.1.gain"]
    x = torch.randn(3, DIM)
    with pytest.raises(ValueError, match=r"left `1\.1\.gain` unset.*reset_parameters\(\).*init_fn=model\._init_weights"):
        engine(x)
    engine.load_state_dict({"1.1.gain": torch.full((DIM,), 0.5)}, strict=False)
    weights = engine.state_dict()
    torch.testing.assert_close(engine(x).cpu(), torch.tanh(F.linear(x, weights["0.weight"], weights["0.bias"])) * 0.5)
    engine.close()


class Scale(nn.Module):
    """A non-persistent buffer and no reset_parameters: only an initialiser can give it values."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(DIM), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Table(nn.Module):
    """A constructor-computed non-persistent buffer and a parameter no reset_parameters() writes, as
    diffusers' PixArt (``scale_shift_table``) and its sinusoidal position tables."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.table = nn.Parameter(torch.randn(DIM) / DIM**0.5)
        self.register_buffer("pos", torch.sin(torch.arange(DIM, dtype=torch.float32)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.table + self.pos


def test_a_model_with_empty_weights_needs_no_initialiser_before_its_weights_are_loaded():
    """accelerate's ``init_empty_weights()``: parameters on meta, buffers real. zero3 leaves the parameters
    unset, keeps the buffer, and a load of the pretrained state dict gives the pretrained model's output."""
    torch.manual_seed(3)
    pretrained = Table()
    empty = Table()
    for module in empty.modules():
        for name, p in list(module._parameters.items()):
            module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    engine = zkernel.initialize(empty, _zero3())
    assert tuple(engine.load_state_dict(pretrained.state_dict())) == ([], [])
    x = torch.randn(3, DIM)
    with torch.no_grad():
        torch.testing.assert_close(engine(x).cpu(), pretrained(x))
    engine.close()


class Positions(nn.Module):
    """Persistent buffers only the constructor computes, as SD3's sinusoidal ``pos_embed``: on meta, nothing
    but a load can give them values (one float, one integer: both sentinels)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.register_buffer("table", torch.sin(torch.arange(DIM, dtype=torch.float32)))
        self.register_buffer("order", torch.arange(DIM).flip(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x[..., self.order] + self.table)


@pytest.mark.usefixtures("zkernel_debug_logs")
def test_a_persistent_buffer_only_the_constructor_sets_waits_for_a_load(tmp_path):
    """[Note: values left unset]: a persistent buffer is in the state dict, so like a parameter it waits for
    `load_state_dict` or `load_checkpoint` instead of failing initialize; until then a forward raises."""
    torch.manual_seed(5)
    pretrained = Positions()
    model = _on_meta(Positions)
    with capture_logs() as logs:
        engine = zkernel.initialize(model, _zero3())
    (warning,) = [e for e in logs if e["event"] == "zkernel.initialize.values_unset"]
    assert warning["values"] == ["table", "order"]
    x = torch.randn(3, DIM)
    with pytest.raises(ValueError, match=r"left `table`, `order` unset and no load has written them since"):
        engine(x)
    engine.load_state_dict({"table": pretrained.table}, strict=False)
    with pytest.raises(ValueError, match=r"left `order` unset"):
        engine.state_dict()
    engine.load_state_dict(pretrained.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(engine(x).cpu(), pretrained(x))
    assert torch.equal(engine.state_dict()["order"], pretrained.order)
    engine.save_checkpoint(tmp_path)
    engine.close()

    again = zkernel.initialize(_on_meta(Positions), _zero3())
    again.load_checkpoint(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(x).cpu(), pretrained(x))
    again.close()


def test_a_buffer_whose_module_has_no_reset_parameters_is_an_error_naming_its_path():
    """No load could write a non-persistent buffer: refused at initialize."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Sequential(nn.Tanh(), Scale()))
    with pytest.raises(ValueError, match=r"buffer `1\.1\.scale`.*`1\.1` \(Scale\) has no reset_parameters\(\).*init_fn="):
        zkernel.initialize(model, _zero3())


def test_init_fn_initialises_modules_without_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM), Gain())

    def init(module: nn.Module) -> None:
        if isinstance(module, Gain):
            module.gain.fill_(2.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    engine = zkernel.initialize(model, _zero3(), init_fn=init)
    with engine.gathered_parameters():
        assert torch.all(model[1].gain == 2.0)
        assert model[0].weight.abs().max() <= DIM**-0.5


def test_init_fn_runs_after_each_modules_own_reset_parameters_so_modules_it_skips_are_not_unset():
    """As eager construction (each layer's constructor runs its reset_parameters) followed by a
    parent's initialiser that knows only its Linear layers: the LayerNorm and the Embedding keep their
    own initialisation, the Linear layers take the initialiser's values."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.LayerNorm(DIM), Gain())

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.fill_(0.25)
            module.bias.zero_()
        elif isinstance(module, Gain):
            module.gain.fill_(2.0)

    with capture_logs() as logs:
        engine = zkernel.initialize(model, _zero3(), init_fn=init)
    assert not [e for e in logs if e["event"] == "zkernel.initialize.values_unset"]
    weights = engine.state_dict()
    assert torch.all(weights["1.weight"] == 0.25) and torch.all(weights["1.bias"] == 0.0), "the init_fn's, after"
    assert torch.all(weights["2.weight"] == 1.0) and torch.all(weights["2.bias"] == 0.0), "LayerNorm's own"
    assert weights["0.weight"].isfinite().all() and weights["0.weight"].std() > 0.5, "Embedding's own N(0, 1)"
    assert torch.all(weights["3.gain"] == 2.0)
    engine.close()


class Pretrained(nn.Module):
    """A model family with its own initialiser, as Hugging Face's ``PreTrainedModel``; ``value`` stands for
    a sub-model's config."""

    value = 1.0

    def _init_weights(self, module: nn.Module) -> None:
        for tensor in module.parameters(recurse=False):
            tensor.fill_(self.value)


class Tower(Pretrained):
    value = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.gain = Gain()


class Composite(Pretrained):
    def __init__(self) -> None:
        super().__init__()
        self.tower = Tower()
        self.head = nn.Linear(DIM, DIM)
        self.embed = nn.Parameter(torch.empty(DIM))


@pytest.mark.parametrize("bound", [True, False], ids=["model._init_weights", "a plain function"])
def test_a_sub_model_of_the_family_is_initialised_by_its_own_method(bound):
    """[Note: sub-models' own initialisers]: the root's bound ``_init_weights`` hands a sub-model's modules
    to that sub-model's own, as Hugging Face's ``initialize_weights`` does; a plain function runs as given."""
    model = _on_meta(Composite)
    init = model._init_weights if bound else (lambda module: Composite._init_weights(model, module))
    engine = zkernel.initialize(model, _zero3(), init_fn=init)
    with engine.gathered_parameters():
        assert torch.all(model.head.weight == 1.0) and torch.all(model.embed == 1.0)
        tower = [model.tower.proj.weight, model.tower.proj.bias, model.tower.gain.gain]
        assert all(torch.all(t == (2.0 if bound else 1.0)) for t in tower)
    engine.close()


class WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(DIM, DIM, 3, padding=1), dim=2)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x.transpose(1, 2)).transpose(1, 2))


@pytest.mark.parametrize("with_init_fn", [False, True], ids=["reset_parameters", "init_fn writing conv.weight"])
def test_weight_norm_originals_come_from_the_modules_own_initialisation(with_init_fn):
    """[Note: parametrized tensors]: ``conv.parametrizations.weight.original0/1`` are set through
    ``right_inverse`` from ``Conv1d``'s own initialisation; an init_fn's write to ``conv.weight`` is a no-op,
    as in Hugging Face's wav2vec2, and its write to the bias stays."""
    model = _on_meta(WeightNormed)

    def init(module: nn.Module) -> None:
        if isinstance(module, WeightNormed):
            module.conv.weight.normal_()  # lands on a computed temporary
            module.conv.bias.fill_(0.25)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    engine = zkernel.initialize(model, _zero3(), init_fn=init if with_init_fn else None)
    with engine.gathered_parameters():
        g = model.conv.parametrizations.weight.original0.detach().clone()
        v = model.conv.parametrizations.weight.original1.detach().clone()
        weight = model.conv.weight.detach().clone()
        bias = model.conv.bias.detach().clone()
    assert torch.isfinite(g).all() and torch.isfinite(v).all()
    torch.testing.assert_close(g, v.norm(dim=(0, 1), keepdim=True))  # weight_norm's decomposition of v
    assert 0 < weight.abs().max() <= (DIM * 3) ** -0.5  # Conv1d's own bound, 1 / sqrt(fan_in)
    if with_init_fn:
        assert torch.all(bias == 0.25)
    x = torch.randn(2, 5, DIM)
    assert torch.isfinite(engine(x)).all()
    engine.close()


@pytest.mark.usefixtures("zkernel_debug_logs")
def test_a_parameter_the_init_fn_leaves_unset_waits_for_a_load_and_is_never_used_unset(tmp_path):
    """[Note: values left unset]: initialize names it in a warning; every use of the values raises
    naming it until a load (load_state_dict, load_checkpoint) has written it."""

    def build() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(DIM, DIM), Gain())

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    model = build()
    with capture_logs() as logs:
        engine = zkernel.initialize(model, _zero3(), init_fn=init)
    (warning,) = [e for e in logs if e["event"] == "zkernel.initialize.values_unset"]
    assert warning["values"] == ["1.gain"] and warning["count"] == 1
    x = torch.randn(3, DIM)

    def gather() -> None:
        with engine.gathered_parameters():
            pass

    uses = [lambda: engine(x), lambda: model(x), engine.state_dict, lambda: engine.save_checkpoint(tmp_path), gather]
    unset = r"left `1\.gain` unset and no load has written them since"
    for use in uses:
        with pytest.raises(ValueError, match=unset):
            use()
    assert not list(tmp_path.iterdir()), "no checkpoint of unset values"
    engine.load_state_dict({"0.bias": torch.zeros(DIM)}, strict=False)  # another key: still unset
    with pytest.raises(ValueError, match=unset):
        engine(x)
    gain = torch.linspace(0.5, 1.5, DIM)
    engine.load_state_dict({"1.gain": gain}, strict=False)
    weights = engine.state_dict()
    assert torch.equal(weights["1.gain"], gain) and torch.equal(weights["0.bias"], torch.zeros(DIM))
    torch.testing.assert_close(engine(x).cpu(), F.linear(x, weights["0.weight"]) * gain)  # from the engine's device
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.save_checkpoint(tmp_path, tag="trained")
    trained = engine.state_dict()
    engine.close()

    again = zkernel.initialize(build(), _zero3(), init_fn=init)
    with pytest.raises(ValueError, match=unset):
        again(x)
    again.load_checkpoint(tmp_path, tag="trained")
    torch.testing.assert_close(again(x).cpu(), F.linear(x, trained["0.weight"], trained["0.bias"]) * trained["1.gain"])
    again.close()

    never = build()
    engine = zkernel.initialize(never, _zero3(), init_fn=init)
    with capture_logs() as logs:
        engine.close()  # never loaded: the model gets the value back as the initialiser left it, with a warning
    (warning,) = [e for e in logs if e["event"] == "zkernel.close.values_unset"]
    assert warning["values"] == ["1.gain"] and never[1].gain.isnan().all()


def test_init_fn_that_leaves_a_buffer_unset_is_an_error_naming_it():
    """A buffer is not deferred: a non-persistent one is in no state dict a load could write."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM), Scale())

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    with pytest.raises(ValueError, match=r"buffer `1\.scale` of `1` \(Scale\), but init_fn left some of its values unset"):
        zkernel.initialize(model, _zero3(), init_fn=init)


def test_init_fn_that_raises_names_the_module():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM))

    def init(module: nn.Module) -> None:
        raise KeyError("no rule")

    with pytest.raises(RuntimeError, match=r"could not initialise `0` \(Linear\).*KeyError: 'no rule'"):
        zkernel.initialize(model, _zero3(), init_fn=init)


def test_init_fn_must_be_callable():
    with pytest.raises(TypeError, match="init_fn"):
        zkernel.initialize(nn.Linear(2, 2), _zero3(), init_fn="reset_parameters")


class Rotary(nn.Module):
    """A parameterless module with a non-persistent buffer computed from its config (like HF's rotary embedding)."""

    def __init__(self, with_reset: bool) -> None:
        super().__init__()
        self.register_buffer("inv_freq", self.compute(), persistent=False)
        if with_reset:
            self.reset_parameters = lambda: self.inv_freq.copy_(self.compute())

    @staticmethod
    def compute() -> torch.Tensor:
        return 1.0 / (10_000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq.repeat(2)


@pytest.mark.parametrize("with_reset", [True, False])
def test_meta_buffers_are_built_by_their_modules_init(with_reset):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM), Rotary(with_reset), nn.BatchNorm1d(DIM))
    assert model[1].inv_freq.is_meta and model[2].running_var.is_meta
    if not with_reset:
        with pytest.raises(ValueError, match=r"buffer `1\.inv_freq`.*`1` \(Rotary\) has no reset_parameters\(\)"):
            zkernel.initialize(model, _zero3())
        return
    zkernel.initialize(model, _zero3())
    assert torch.equal(model[1].inv_freq.cpu(), Rotary.compute())
    assert torch.all(model[2].running_var == 1) and torch.all(model[2].running_mean == 0)
    assert model[2].num_batches_tracked.item() == 0


def test_a_weak_reference_to_a_tied_parameter_does_not_break_the_tie(zkernel_debug_logs):
    model = _on_meta(TiedLM)
    watcher = weakref.ref(model.embed.weight)  # swap_tensors refuses tensors with weak references
    with capture_logs() as logs:
        engine = zkernel.initialize(model, _zero3())
    assert any(e["event"] == "zkernel.materialize.rebind" for e in logs), "the fallback path must have run"
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta
    del watcher
    losses = _train_steps(engine, 2, 1, MICRO, SEED)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_model_with_nothing_on_meta_is_untouched():
    torch.manual_seed(0)
    model = TiedLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    units = module_units(model)
    assert list(materialized_units(model, units, torch.device("cpu"), 0)) == units
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
