"""Hugging Face models: GPT-2 and Llama built on the meta device under zero3; T5, ALBERT, BERT,
Mixtral, Qwen2-MoE, ViT and Swinv2 trained on two ranks against torch."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", minversion="5.0")

import torch  # noqa: E402

from tests.support import hf_scenarios as hf  # noqa: E402
from tests.support.harness import run_ranks  # noqa: E402

WORLD = 2
BIG = (384, 6)  # 43 MB (GPT-2) / 32 MB (Llama) of fp32 parameters: large against a rank's noise, built in a second
SMALL = (64, 2)
STEPS = 10


@pytest.fixture(scope="module")
def suite() -> list[dict]:
    """One spawn of 2 gloo ranks runs every scenario (transformers takes seconds to import per process)."""
    return run_ranks(WORLD, hf.hf_suite, BIG, SMALL, STEPS)


@pytest.mark.parametrize("arch", hf.ARCHS)
def test_meta_built_model_is_never_whole_on_a_rank(suite, arch):
    for rank, results in enumerate(suite):
        r = results[f"{arch}:build"]
        if r["init_growth"] is None:
            pytest.skip("the peak RSS cannot be reset in this process, so only the first model was measured")
        # A rank keeps what memory_report() counts (its half of the parameters and the optimizer
        # state allocated up front), plus one unit while it is built. Building the whole model
        # first would need all of it on top.
        transient = r["init_growth"] - r["held_bytes"]
        assert transient < 0.75 * r["full_bytes"], (
            f"rank {rank} {arch}: grew {r['init_growth']} B ({r['held_bytes']} B held after init) "
            f"while zero3 built a {r['full_bytes']} B model"
        )
        assert r["params_bytes"] <= r["full_bytes"] / WORLD + 64 * 1024


@pytest.mark.parametrize("arch", hf.ARCHS)
@pytest.mark.parametrize("scenario", ["build", "parity"])
def test_tied_embeddings_stay_one_parameter(suite, arch, scenario):
    for rank, results in enumerate(suite):
        ties = results[f"{arch}:{scenario}"]["ties"]
        assert ties["same_object"], f"rank {rank} {arch}: the head and the embedding became two parameters"
        assert not ties["on_meta"] and ties["meta_left"] == []
        assert ties["groups_holding_it"] == 1
        # Every parameter of the model is in exactly one group.
        assert ties["grouped_params"] == ties["distinct_grouped_params"] == ties["model_params"]
    if scenario == "parity":
        # The head reads the embedding's group outside the embedding's own forward: the guard fetched it.
        embedding = {"gpt2": "transformer.wte", "llama": "model.embed_tokens"}[arch]
        assert all(r[f"{arch}:parity"]["ties"]["external"] == [embedding] for r in suite)


@pytest.mark.parametrize("arch", hf.ARCHS)
def test_zero3_matches_torch_on_the_same_materialised_model(suite, arch):
    """Rank 0's oracle materialises the same meta model the way zero3 does, whole, and trains it with torch AdamW."""
    expected = suite[0][f"{arch}:parity"]["reference"]
    assert expected[-1] < 0.6 * expected[0], f"the reference itself should learn: {expected}"
    for rank, results in enumerate(suite):
        losses = results[f"{arch}:parity"]["losses"]
        assert len(losses) == len(expected) == STEPS
        for i, (a, b) in enumerate(zip(losses, expected)):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} {arch} step {i}: zero3 {a!r} vs torch {b!r}"


@pytest.mark.parametrize("arch", hf.ARCHS)
def test_tiled_loss_around_a_hugging_face_model_matches_its_own_loss(suite, arch):
    """The base model's hidden states through zkernel.tiled_cross_entropy with the tied head:
    the same losses as the model's own ``labels=`` loss in torch, one tied parameter."""
    expected = suite[0][f"{arch}:parity"]["reference"]
    embedding = {"gpt2": "lm.transformer.wte", "llama": "lm.model.embed_tokens"}[arch]
    for rank, results in enumerate(suite):
        r = results[f"{arch}:tiled loss"]
        for i, (a, b) in enumerate(zip(r["losses"], expected, strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} {arch} step {i}: tiled {a!r} vs torch {b!r}"
        assert r["ties"]["same_object"] and r["ties"]["groups_holding_it"] == 1
        assert r["ties"]["external"] == [embedding]


@pytest.mark.parametrize("arch", hf.ARCHS)
def test_generate_with_ranks_of_different_lengths_matches_the_whole_model(suite, arch):
    """HF ``generate(..., synced_gpus=True)`` through zero3's gathers (key-value cache, eval mode,
    no_grad), each rank stopping at its own length, gives the whole model's tokens; training goes on."""
    expected = suite[0][f"{arch}:generate"]["reference"]
    for rank, results in enumerate(suite):
        assert results[f"{arch}:generate"]["tokens"] == expected[rank], f"rank {rank} {arch}"


def test_encoder_decoder_generate_under_zero3_matches_the_whole_model(suite):
    """T5's ``generate`` runs its encoder alone, not through the model's forward: that call is a pass of
    its own ([Note: forward entry]), whose shared embedding (tied, read outside its own module) is
    fetched; before, it raised `ReleasedParameterError` on ``shared.weight``."""
    expected = suite[0]["t5:generate"].get("reference")
    for rank, results in enumerate(suite):
        got = results["t5:generate"]
        assert "error" not in got, got
        assert got["tokens"] == expected[rank], f"rank {rank}"


def test_a_generate_that_reads_parameters_between_forwards_matches_the_whole_model(suite):
    """BLIP-2's own ``generate`` reads the root's ``query_tokens`` outside any forward; while it runs such
    a read fetches the parameter ([Note: reads inside generate]); before, it raised
    `ReleasedParameterError`. Ranks generate different numbers of tokens (``synced_gpus``)."""
    expected = suite[0]["blip2:generate"].get("reference")
    for rank, results in enumerate(suite):
        got = results["blip2:generate"]
        assert "error" not in got, got
        assert got["tokens"] == expected[rank], f"rank {rank}"
        assert got["own_generate_back"]


@pytest.mark.parametrize("arch", hf.ARCHS)
def test_checkpointed_decoder_layers_with_the_cache_on_train_like_torch(suite, arch):
    """zkernel's activation checkpointing of every decoder layer while the model passes its key/value
    cache (``use_cache`` on, the default): the recomputation in backward must not add the layer's keys
    and values a second time (it did: the attention then ran over twice the sequence and failed)."""
    expected = suite[0][f"{arch}:parity"]["reference"]
    for rank, results in enumerate(suite):
        r = results[f"{arch}:checkpointed"]
        assert "error" not in r, f"rank {rank} {arch}: {r.get('error')}"
        for i, (a, b) in enumerate(zip(r["losses"], expected, strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} {arch} step {i}: checkpointed {a!r} vs torch {b!r}"
        assert r["cache_warnings"] == 1  # once per engine, not once per layer and step
        # Evaluation with gradients on runs the layers whole: after its forward and backward the
        # cache holds each position once.
        assert r["eval_logits_equal"] and r["eval_cache_length"] == hf.SEQ


@pytest.mark.parametrize("config", list(hf.ZOO_CONFIGS))
@pytest.mark.parametrize("arch", list(hf.ZOO))
def test_other_architectures_train_like_torch_on_two_ranks(suite, arch, config):
    """T5, ALBERT, BERT, Mixtral, Qwen2-MoE, ViT and Swinv2 from Hugging Face, eager-built, through the public API
    on two ranks: each step's loss as torch AdamW on the whole batch (relative 1e-5), and the trained
    state (a parameter whose gradient is only rounding noise, such as an attention key bias, moves by
    Adam's noise-sized steps: atol 1e-4 against a learning rate of 1e-2, 1e-3 where the ranks ran on
    GPUs against the CPU oracle; a gradient missing a rank's part moves a weight by about 1e-2)."""
    for rank, results in enumerate(suite):
        r = results[f"zoo:{arch}:{config}"]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        expected = suite[0][f"zoo:{arch}:{config}"]["reference"]
        for i, (a, b) in enumerate(zip(r["losses"], expected, strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {i}: {a!r} vs torch {b!r}"
        want = suite[0][f"zoo:{arch}:{config}"]["reference_state"]
        assert r["state"].keys() == want.keys()
        atol = 1e-3 if r["device"] == "cuda" else 1e-4
        for name, value in want.items():
            torch.testing.assert_close(r["state"][name], value, rtol=0, atol=atol, msg=name)


def _init_stats(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    return {n: (p.mean().item(), p.std().item()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", hf.ARCHS)
def test_materialised_init_is_the_models_own(arch):
    """Each tensor gets the distribution Hugging Face's own init gives it, and recomputed buffers are exact.

    GPT-2's attention and MLP modules scale their child ``c_proj.weight`` by 1/sqrt(2 n_layer): an
    init run on a parent after its children, which unit-by-unit materialisation must reproduce.
    """
    torch.manual_seed(0)
    eager = hf.build(arch, 128, 2)
    meta = hf.materialize_whole(hf.build_on_meta(arch, 128, 2))
    assert meta.get_output_embeddings().weight is meta.get_input_embeddings().weight
    got, want = _init_stats(meta), _init_stats(eager)
    assert got.keys() == want.keys()
    for name in want:
        (m_got, s_got), (m_want, s_want) = got[name], want[name]
        assert abs(m_got - m_want) < 2e-3 + 0.05 * abs(m_want), f"{name}: mean {m_got} vs {m_want}"
        assert abs(s_got - s_want) <= 0.06 * s_want + 1e-7, f"{name}: std {s_got} vs {s_want}"
    if arch == "gpt2":
        assert abs(got["transformer.h.0.attn.c_proj.weight"][1] - 0.02 / 4**0.5) < 5e-4
    eager_buffers = dict(eager.named_buffers())
    for name, buf in meta.named_buffers():
        assert torch.equal(buf, eager_buffers[name]), name


def test_module_without_reset_parameters_is_named_and_refused_at_the_first_forward():
    """GPT-2's Conv1D has no reset_parameters(): without init_fn its weights wait for a load ([Note: values
    left unset]), and a forward before one says to pass the model's own initialiser."""
    model = hf.build_on_meta("gpt2", 64, 1)
    import zkernel

    engine = zkernel.initialize(model, hf.zero3_config(1e-3))
    ids = hf.token_batches(0, 1, 1, 2)[0][0]
    with pytest.raises(ValueError, match=r"`transformer\.h\.0\.attn\.c_attn\.weight`.*init_fn=model\._init_weights"):
        engine(input_ids=ids)
    engine.close()


def test_checkpointed_recurrent_layers_get_no_cache_in_training():
    """RecurrentGemma's recurrent layers keep their state on the module when asked to cache (``use_cache``
    passed by position): recomputed in backward they started from the state the forward left, and
    the recomputation's shapes did not match. Checkpointed, they are asked not to cache in training,
    and train like the whole model in torch."""
    import transformers

    import zkernel
    from tests.support.models import VOCAB

    def build():
        config = transformers.AutoConfig.for_model(
            "recurrent_gemma", vocab_size=VOCAB, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, lru_width=32, attention_window_size=8,
            block_types=["recurrent", "attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)

    g = torch.Generator().manual_seed(3)
    data = [torch.randint(3, VOCAB, (2, 8), generator=g) for _ in range(3)]
    config = {**hf.zero3_config(1e-2), "activation_checkpointing": {"modules": ["RecurrentGemmaDecoderLayer"]}}
    engine = zkernel.initialize(build(), config)
    losses = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for ids, got in zip(data, losses, strict=True):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(got - loss.item()) <= 1e-5 * abs(loss.item()), (got, loss.item())


@pytest.mark.parametrize("arch", hf.ARCHS)
def test_pretrained_weights_load_file_by_file_into_a_meta_built_model(tmp_path, arch):
    """The recipe of docs/guide/construction.md: a model built on the meta device, zero3 with the model's own init, then a
    pretrained model's sharded safetensors files given one by one to `Engine.load_state_dict`."""
    import zkernel
    from safetensors.torch import load_file

    torch.manual_seed(1)
    pretrained = hf.build(arch, 64, 2)
    pretrained.save_pretrained(tmp_path, max_shard_size="40KB")
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(files) > 2
    model = hf.build_on_meta(arch, 64, 2)
    engine = zkernel.initialize(model, {**hf.zero3_config(1e-3), "precision": "fp32"}, init_fn=model._init_weights)
    given = set()
    for file in files:
        part = load_file(file)
        given |= set(part)
        missing, unexpected = engine.load_state_dict(part, strict=False)
        assert unexpected == []
    expected = pretrained.state_dict()
    assert set(expected) - given <= {"lm_head.weight"}  # saved once, under the embedding's name
    got = engine.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    ids = hf.token_batches(0, 1, 1, 2)[0][0]
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.cpu()  # on the engine's device
        assert torch.allclose(logits, pretrained(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    engine.close()


def test_a_composite_model_built_on_the_meta_device_takes_each_sub_models_own_init():
    """LLaVA (a CLIP vision tower and a Llama under one root): ``init_fn=model._init_weights`` initialises
    the tower's modules with CLIP's own ``_init_weights`` ([Note: sub-models' own initialisers]); the
    root's alone leaves CLIP's position ids unset."""
    import transformers as T

    import zkernel

    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=16, patch_size=4)  # fmt: skip
    text = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config = T.LlavaConfig(vision_config=vision, text_config=text, image_token_index=63)
    with torch.device("meta"):
        model = T.LlavaForConditionalGeneration(config)
    cfg = {**hf.zero3_config(1e-3), "precision": "fp32"}
    engine = zkernel.initialize(model, cfg, init_fn=model._init_weights)
    state = engine.state_dict()
    engine.close()
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    embed = state["model.vision_tower.embeddings.class_embedding"]
    assert 0.5 * 32**-0.5 < embed.std() < 2 * 32**-0.5  # CLIP's rule (std = width ** -0.5), not a constant
    with torch.device("meta"):
        model = T.LlavaForConditionalGeneration(config)
    with pytest.raises(ValueError, match="buffer `model.vision_tower.embeddings.position_ids`"):
        zkernel.initialize(model, cfg, init_fn=lambda module: model._init_weights(module))


def test_clip_built_on_the_meta_device_takes_its_constructor_only_value_from_the_pretrained_weights():
    """CLIP's ``logit_scale`` is set only in its constructor and no ``_init_weights`` writes it: built on
    the meta device it is left unset ([Note: values left unset]) until the pretrained weights arrive."""
    import transformers as T

    import zkernel

    config = T.CLIPConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "vocab_size": 64, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 16, "patch_size": 4},
        projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(2)
    pretrained = T.CLIPModel(config).eval()
    with torch.device("meta"):
        model = T.CLIPModel(config)
    engine = zkernel.initialize(model, {**hf.zero3_config(1e-3), "precision": "fp32"}, init_fn=model._init_weights)
    engine.eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), pytest.raises(ValueError, match="`logit_scale` unset"):
        engine(input_ids=ids, pixel_values=pixels)
    assert tuple(engine.load_state_dict(pretrained.state_dict())) == ([], [])
    with torch.no_grad():
        got = engine(input_ids=ids.to(engine.device), pixel_values=pixels.to(engine.device)).logits_per_image.cpu()
        torch.testing.assert_close(got, pretrained(input_ids=ids, pixel_values=pixels).logits_per_image)
    engine.close()


def test_wav2vec2_built_on_the_meta_device_gets_its_weight_normed_convolution():
    """wav2vec2's positional convolution is weight-normed: its ``original0/1`` come from ``Conv1d``'s own
    initialisation through ``right_inverse`` ([Note: parametrized tensors]), where HF's ``_init_weights``
    write to ``conv.weight`` cannot reach them."""
    import transformers as T

    import zkernel

    config = T.Wav2Vec2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                              num_conv_pos_embedding_groups=4, vocab_size=16)  # fmt: skip
    with torch.device("meta"):
        model = T.Wav2Vec2ForCTC(config)
    engine = zkernel.initialize(model, {**hf.zero3_config(1e-3), "precision": "fp32"}, init_fn=model._init_weights)
    state = engine.state_dict()
    audio = torch.randn(2, 400, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = engine(input_values=audio.to(engine.device)).logits
    engine.close()
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original0" in state
    assert torch.isfinite(logits).all()
