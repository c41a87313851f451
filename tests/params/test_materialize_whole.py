"""Meta-device models under the partitioners that keep parameters whole (none, zero1, zero2).

[Note: a meta-device model kept whole] in `zkernel_plugins.partitioners._whole`:
they build the model as zero3 does (same units, same seeds), so it starts from
the same values under every builtin partitioner, and trains like torch from them.
A partitioner that does not materialise one is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zkernel
from tests.params.test_materialize import CLIP, LR, MICRO, MODELS, SEED, STEPS, Rotary, _on_meta, _zero3
from tests.support.harness import run_ranks
from tests.support.models import batches, reference_losses
from tests.support.scenarios import _train_steps
from zkernel.spec import hookimpl
from zkernel_plugins.partitioners._flat import module_units
from zkernel_plugins.partitioners._materialize import materialized_units
from zkernel_plugins.partitioners.zero1 import Zero1

ACCUM = 2


def _whole(partitioner: str) -> dict:
    return {
        "partitioner": partitioner,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"lr": LR, "weight_decay": 0.0},
        "partitioner_options": {"init_seed": 5, "bucket_size": 300},
    }


def _zero3_values(name: str) -> dict[str, torch.Tensor]:
    engine = zkernel.initialize(_on_meta(MODELS[name]), _zero3())
    try:
        return {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()


def _expected_losses(name: str, device: torch.device, world: int) -> list[float]:
    reference = _on_meta(MODELS[name])
    for _ in materialized_units(reference, module_units(reference), device, 5):
        pass
    return reference_losses(reference.cpu(), batches(SEED + 1, STEPS, ACCUM, world, MICRO), LR, 0.0, CLIP)


def _assert_matches(losses, expected, label):
    assert expected[-1] < expected[0]
    for i, (a, b) in enumerate(zip(losses, expected, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{label} step {i}: {a!r} vs torch {b!r}"


@pytest.mark.parametrize("name", ["embed_first", "shared_blocks"])
@pytest.mark.parametrize("partitioner", ["none", "zero1", "zero2"])
def test_a_meta_model_starts_as_under_zero3_and_trains_like_torch(partitioner, name):
    expected_values = _zero3_values(name)
    model = _on_meta(MODELS[name])
    engine = zkernel.initialize(model, _whole(partitioner))
    try:
        assert model.head.weight is model.embed.weight and not any(p.is_meta for p in model.parameters())
        if name == "shared_blocks":
            assert model.blocks[2].weight is model.blocks[0].weight
        values = engine.state_dict()
        assert values.keys() == expected_values.keys()
        for key, value in values.items():
            assert torch.equal(value, expected_values[key]), key
        losses = _train_steps(engine, STEPS, ACCUM, MICRO, SEED)
    finally:
        engine.close()
    _assert_matches(losses, _expected_losses(name, torch.device("cpu"), 1), partitioner)


def _train_meta_on_ranks(partitioner: str) -> list[float]:
    engine = zkernel.initialize(_on_meta(MODELS["embed_first"]), _whole(partitioner))
    try:
        return _train_steps(engine, STEPS, ACCUM, MICRO, SEED)
    finally:
        engine.close()


@pytest.mark.parametrize("partitioner", ["zero1", "zero2"])
def test_a_meta_model_trains_like_torch_on_two_ranks(partitioner):
    expected = _expected_losses("embed_first", torch.device("cpu"), 2)
    for rank, losses in enumerate(run_ranks(2, _train_meta_on_ranks, partitioner)):
        _assert_matches(losses, expected, f"rank {rank} {partitioner}")


def test_meta_buffers_are_built_under_a_whole_partitioner():
    model = nn.Sequential(nn.Linear(16, 16))
    with torch.device("meta"):
        model.append(Rotary(with_reset=True))
    engine = zkernel.initialize(model, {"partitioner": "zero2"})
    try:
        assert torch.equal(model[1].inv_freq.cpu(), Rotary.compute())
    finally:
        engine.close()


class _NoBuilder:
    """A third party's whole-parameter partitioner that does not declare it materialises a meta model."""

    @hookimpl
    def zkernel_register_partitioners(self, registry):
        registry.add("unbuilt", Zero1)


def test_a_partitioner_that_does_not_build_a_meta_model_is_refused_naming_those_that_do():
    model = _on_meta(MODELS["embed_first"])
    with pytest.raises(ValueError) as info:
        zkernel.initialize(model, {"partitioner": "unbuilt"}, plugins=[_NoBuilder()])
    message = str(info.value)
    assert "parameter 'embed.weight' is on the meta device and partitioner 'unbuilt' does not materialise" in message
    assert "valid: a partitioner that does (none, zero1, zero2, zero3), or the model built on a real device" in message
    assert isinstance(info.value, zkernel.ConfigError)
    assert model.embed.weight.is_meta  # nothing was built


def test_a_meta_buffer_left_by_a_partitioner_is_an_error_naming_those_that_build_one():
    """What the kernel says of a buffer a third party's partitioner left on the meta device."""
    from zkernel.kernel.bootstrap import _move_buffers

    model = nn.Sequential(nn.Linear(16, 16))
    with torch.device("meta"):
        model.append(Rotary(with_reset=True))
    with pytest.raises(ValueError, match=r"buffer '1\.inv_freq' of Rotary is on the meta device: only the zero1 or zero3 partitioner"):
        _move_buffers(model, torch.device("cpu"), torch.float32, ["zero1", "zero3"])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_hugging_face_model_built_on_meta_under_zero2_starts_as_under_zero3(arch):
    """Its own initialiser (``model._init_weights``), its tie and Llama's rotary buffer, as zero3 builds them."""
    pytest.importorskip("transformers", minversion="5.0")
    from tests.support import hf_scenarios as hf

    values = {}
    for partitioner in ("zero3", "zero2"):
        model = hf.build_on_meta(arch, 32, 2)
        config = {"partitioner": partitioner, "partitioner_options": {"init_seed": 3}}
        engine = zkernel.initialize(model, config, init_fn=model._init_weights)
        try:
            values[partitioner] = {k: v.clone() for k, v in engine.state_dict().items()}
            head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
            assert head is embedding
            assert not any(b.is_meta for b in model.buffers())
        finally:
            engine.close()
    assert values["zero2"].keys() == values["zero3"].keys()
    for key, value in values["zero2"].items():
        assert torch.equal(value, values["zero3"][key]), key
