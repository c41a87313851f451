"""Hugging Face causal LMs built on the meta device under zero3 (run inside spawned ranks or in-process).

Tiny GPT-2 and Llama configurations with tied input/output embeddings, random
init, no hub access. Each step trains on the same global batch of bigram
sequences, so ten steps lower the loss well clear of noise. The `ZOO` of other
architectures (encoder-decoder, shared layers, mixtures of experts, vision) is
built eagerly and trained against torch AdamW on random batches.
"""

from __future__ import annotations

import copy
import logging
import os
import resource
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import zkernel  # noqa: E402
from zkernel_plugins.partitioners._flat import module_units  # noqa: E402
from zkernel_plugins.partitioners._materialize import materialized_units  # noqa: E402

hf_logging.set_verbosity_error()

VOCAB = 256
SEQ = 16
ARCHS = ("gpt2", "llama")


def build(arch: str, width: int, depth: int, attention: str | None = None) -> torch.nn.Module:
    """A tied-embedding causal LM of ``arch``, ``depth`` layers of ``width`` (under the caller's device
    context), with the ``attention`` implementation given (Hugging Face's default: None)."""
    common = {"vocab_size": VOCAB, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}
    if attention is not None:
        common["attn_implementation"] = attention
    if arch == "gpt2":
        cfg = GPT2Config(
            n_layer=depth, n_embd=width, n_head=4, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **common,
        )
        return GPT2LMHeadModel(cfg)
    if arch == "llama":
        cfg = LlamaConfig(
            num_hidden_layers=depth, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, **common,
        )
        return LlamaForCausalLM(cfg)
    raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHS}")


def build_on_meta(arch: str, width: int, depth: int, attention: str | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        return build(arch, width, depth, attention)


def materialize_whole(
    model: torch.nn.Module, seed: int = 0, units: str = "modules", device: torch.device = torch.device("cpu")
) -> torch.nn.Module:
    """What zero3 does to a meta model, unit by unit with the same seeds, but kept whole on one process
    (on ``device``: its random numbers are the device's, as zero3's are on the ranks' devices)."""
    for _ in materialized_units(model, module_units(model, units), device, seed, model._init_weights):
        pass
    return model


def token_batches(seed: int, steps: int, world: int, micro: int) -> list[list[torch.Tensor]]:
    """[step][rank] -> token ids ``(micro, SEQ)``, one global batch repeated: x[t+1] = (5 x[t] + 3) mod VOCAB."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(world * micro, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (world * micro,), generator=g)
    for t in range(1, SEQ):
        ids[:, t] = (5 * ids[:, t - 1] + 3) % VOCAB
    return [[ids[r * micro : (r + 1) * micro] for r in range(world)] for _ in range(steps)]


def _world_rank() -> tuple[int, int]:
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _labels_loss(engine, ids: torch.Tensor) -> torch.Tensor:
    return engine(input_ids=ids, labels=ids).loss


def train_engine(engine, data, loss_of=_labels_loss) -> list[float]:
    """This rank's share of each step through ``engine`` (``loss_of(engine, ids)``: the model's own
    ``labels=`` loss by default); the global mean loss per step."""
    world, rank = _world_rank()
    losses = []
    for step in data:
        loss = loss_of(engine, step[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def train_reference(model: torch.nn.Module, data, lr: float, clip: float) -> list[float]:
    """Plain single-process torch AdamW over the whole global batch of each step: the oracle."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in data:
        ids = torch.cat(step).to(model.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def zero3_config(lr: float, clip: float = 0.0) -> dict:
    return {
        "partitioner": "zero3",
        "optimizer": {"name": "adamw", "lr": lr, "weight_decay": 0.0},
        "gradient_clipping": clip,
        "partitioner_options": {"persistence_threshold": 0},
    }


def tie_report(engine, lm: torch.nn.Module | None = None) -> dict:
    """Whether the output head and the input embedding of ``lm`` (by default the engine's module)
    are one parameter, and where it sits in the groups."""
    model = engine.module
    lm = model if lm is None else lm
    head, embed = lm.get_output_embeddings().weight, lm.get_input_embeddings().weight
    grouped = [p for g in engine.groups for p in g.params]
    return {
        "same_object": head is embed,
        "on_meta": head.is_meta,
        "groups_holding_it": sum(1 for g in engine.groups for p in g.params if p is embed),
        "grouped_params": len(grouped),
        "distinct_grouped_params": len({id(p) for p in grouped}),
        "model_params": len(list(model.parameters())),
        "meta_left": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
        "external": sorted(g.name for g in engine.groups if g.index in engine.scheduler.external),
    }


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def meta_build(arch: str, width: int, depth: int, first: bool) -> dict:
    """Build ``arch`` on meta and let zero3 materialise it; the peak RSS growth while it does."""
    # Warm-up: imports, plugin loading and one-time kernel set-up are not what is measured.
    warm = build_on_meta(arch, 64, 1)
    zkernel.initialize(warm, zero3_config(1e-3), init_fn=warm._init_weights)
    measured = _reset_peak_rss() or first  # without a reset only the first measurement in a process is valid
    before = _peak_rss()
    model = build_on_meta(arch, width, depth)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    engine = zkernel.initialize(model, zero3_config(1e-3), init_fn=model._init_weights)
    init_growth = _peak_rss() - before
    held = sum(sum(v.values()) for v in engine.memory_report().values())
    return {
        "full_bytes": full_bytes,
        "init_growth": init_growth if measured else None,
        "held_bytes": held,
        "params_bytes": sum(engine.memory_report()["params"].values()),
        "ties": tie_report(engine),
    }


def parity(arch: str, width: int, depth: int, steps: int) -> dict:
    """zero3 over a meta-built model on every rank; on rank 0 also the torch oracle on the same materialised model."""
    lr, clip = 1e-2, 1.0
    world, rank = _world_rank()
    data = token_batches(11, steps, world, 2)
    model = build_on_meta(arch, width, depth)
    engine = zkernel.initialize(model, zero3_config(lr, clip), init_fn=model._init_weights)
    result = {"losses": train_engine(engine, data), "ties": tie_report(engine)}
    if rank == 0:
        reference = materialize_whole(build_on_meta(arch, width, depth), device=engine.device)
        assert reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
        result["reference"] = train_reference(reference, data, lr, clip)
    return result


class TiledLossLM(torch.nn.Module):
    """A causal LM whose head and shifted next-token loss go through `zkernel.tiled_cross_entropy`
    (the logits never whole), as a user writes it around a Hugging Face model."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.base_model(input_ids=input_ids).last_hidden_state
        head = self.lm.get_output_embeddings().weight
        return zkernel.tiled_cross_entropy(hidden[:, :-1], head, input_ids[:, 1:], tiles=3)


def tiled_loss_parity(arch: str, width: int, depth: int, steps: int) -> dict:
    """`parity`'s run with the loss through `TiledLossLM`: its oracle is `parity`'s reference."""
    lr, clip = 1e-2, 1.0
    world, _ = _world_rank()
    data = token_batches(11, steps, world, 2)
    lm = build_on_meta(arch, width, depth)
    engine = zkernel.initialize(TiledLossLM(lm), zero3_config(lr, clip), init_fn=lm._init_weights)
    losses = train_engine(engine, data, loss_of=lambda engine, ids: engine(ids))
    return {"losses": losses, "ties": tie_report(engine, lm)}


LAYER_CLASS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def checkpointed_layers(arch: str, width: int, depth: int, steps: int) -> dict:
    """`parity`'s run with every decoder layer checkpointed by zkernel (``use_cache`` left on, as a user
    leaves it: the layers are handed the model's key/value cache); then an evaluation forward with
    gradients on, which fills the cache, and its backward. Eager attention: under SDPA a cache
    holding each key twice happens to give the same outputs."""
    lr, clip = 1e-2, 1.0
    world, rank = _world_rank()
    data = token_batches(11, steps, world, 2)
    model = build_on_meta(arch, width, depth, attention="eager")
    config = {**zero3_config(lr, clip), "activation_checkpointing": {"modules": [LAYER_CLASS[arch]]}}
    handler = _Messages()
    logging.getLogger("zkernel").addHandler(handler)
    try:
        engine = zkernel.initialize(model, config, init_fn=model._init_weights)
        losses = train_engine(engine, data)
        ids = data[0][rank].to(engine.device)
        engine.module.eval()
        with torch.no_grad():
            plain = engine(input_ids=ids, use_cache=False).logits
        out = engine(input_ids=ids, use_cache=True)  # gradients on: the layers run without checkpointing
        # A backward in evaluation (gradients of the inputs' score, say): a checkpointed layer would
        # be recomputed now, adding its keys and values to the cache again.
        engine.backward(out.logits.float().logsumexp(-1).mean())
        engine.step()
        engine.module.train()
    finally:
        logging.getLogger("zkernel").removeHandler(handler)
    return {
        "losses": losses,
        "cache_warnings": sum("zkernel.activation.cache_dropped" in m for m in handler.messages),
        "eval_logits_equal": torch.equal(out.logits.detach(), plain),
        "eval_cache_length": out.past_key_values.get_seq_length(),
    }


def generate(arch: str, width: int, depth: int) -> dict:
    """Greedy ``generate`` under zero3, each rank its own prompts and its own number of new tokens
    (``synced_gpus=True``, as under DeepSpeed's ZeRO-3: a rank that is done keeps running forwards
    until every rank is), then a training step; rank 0 also generates every prompt with a whole copy."""
    world, rank = _world_rank()
    torch.manual_seed(0)
    model = build(arch, width, depth)
    whole = copy.deepcopy(model) if rank == 0 else None
    prompts = torch.randint(1, VOCAB, (2 * world, 5), generator=torch.Generator().manual_seed(3))
    engine = zkernel.initialize(model, zero3_config(1e-3))
    mine, new = prompts[2 * rank : 2 * rank + 2].to(engine.device), 3 + 2 * rank  # generate keeps them where they are
    engine.module.eval()
    with torch.no_grad():
        out = engine.module.generate(mine, max_new_tokens=new, do_sample=False, pad_token_id=0, synced_gpus=True)
    engine.module.train()
    train_engine(engine, token_batches(5, 1, world, 2))
    result = {"tokens": out.tolist()}
    if rank == 0:
        with torch.no_grad():
            result["reference"] = [
                whole.generate(prompts[2 * r : 2 * r + 2], max_new_tokens=3 + 2 * r, do_sample=False, pad_token_id=0)
                .tolist()
                for r in range(world)
            ]
    return result


def seq2seq_generate() -> dict:
    """T5's greedy ``generate`` under zero3 (every module split), after a training step: ``generate``
    runs the encoder alone (``get_encoder()``), outside the model's forward, before the decoder's
    steps; each rank its own prompts. Rank 0 also generates every rank's prompts with a whole copy."""
    import transformers

    _, _, kwargs, _ = ZOO["t5"]
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=128, **kwargs))
    whole = copy.deepcopy(model)
    engine = zkernel.initialize(model, {"partitioner": "zero3", **_SPLIT_ALL, "precision": "fp32", "optimizer": {"lr": 0.0}})
    world, rank = _world_rank()
    prompts = torch.randint(3, 128, (2 * world, 8), generator=torch.Generator().manual_seed(1))
    mine = prompts[2 * rank : 2 * rank + 2].to(engine.device)
    loss = engine(input_ids=mine, labels=mine[:, :4].contiguous()).loss
    engine.backward(loss)
    engine.step()  # a rate of 0: the weights stay the whole copy's
    engine.module.eval()
    with torch.no_grad():
        out = engine.module.generate(mine, max_new_tokens=4, do_sample=False, synced_gpus=True)
    engine.close()
    result = {"tokens": out.tolist()}
    if rank == 0:
        with torch.no_grad():
            whole.eval()
            result["reference"] = [
                whole.generate(prompts[2 * r : 2 * r + 2], max_new_tokens=4, do_sample=False).tolist() for r in range(world)
            ]
    return result


def blip2_generate() -> dict:
    """BLIP-2's greedy ``generate`` under zero3 (every module split), each rank its own images and prompts:
    its ``generate`` reads the root's ``query_tokens`` between the vision tower's and the language model's
    forwards ([Note: reads inside generate]). Rank 0 also generates every rank's with a whole copy; after
    ``close`` the model's own ``generate`` is back."""
    import transformers

    hidden, vocab = 32, 64
    image = vocab - 1
    layers = {"hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = transformers.Blip2Config(
        vision_config={**layers, "intermediate_size": 64, "image_size": 16, "patch_size": 4},
        qformer_config={**layers, "intermediate_size": 64, "encoder_hidden_size": hidden, "vocab_size": vocab},
        text_config={**layers, "model_type": "opt", "vocab_size": vocab, "ffn_dim": 64, "word_embed_proj_dim": hidden,
                     "max_position_embeddings": 64, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        num_query_tokens=4, image_token_index=image,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Blip2ForConditionalGeneration(config).eval()
    whole = copy.deepcopy(model)
    engine = zkernel.initialize(model, {"partitioner": "zero3", **_SPLIT_ALL, "precision": "fp32"})
    world, rank = _world_rank()
    g = torch.Generator().manual_seed(1)
    prompts = torch.cat([torch.full((2 * world, 4), image), torch.randint(3, vocab - 2, (2 * world, 5), generator=g)], 1)
    pixels = torch.randn(2 * world, 3, 16, 16, generator=g)
    mine = slice(2 * rank, 2 * rank + 2)
    with torch.no_grad():
        out = engine.module.generate(
            input_ids=prompts[mine].to(engine.device), pixel_values=pixels[mine].to(engine.device),
            max_new_tokens=3 + 2 * rank, do_sample=False, synced_gpus=True,
        )  # fmt: skip
    engine.close()
    result = {"tokens": out.tolist(), "own_generate_back": "generate" not in vars(model)}
    if rank == 0:
        with torch.no_grad():
            result["reference"] = [
                whole.generate(input_ids=prompts[2 * r : 2 * r + 2], pixel_values=pixels[2 * r : 2 * r + 2],
                               max_new_tokens=3 + 2 * r, do_sample=False).tolist()
                for r in range(world)
            ]  # fmt: skip
    return result


# -- other architectures through the public API ------------------------------------------------

_ZOO_TEXT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 64}
# name: (model class, config type, config keywords, inputs). Chosen for what they do to an engine: an
# encoder-decoder with a shared embedding and a relative-position bias only the first block owns (T5);
# one layer's parameters run at every depth (ALBERT); routers whose experts some ranks' tokens skip
# (Mixtral, Qwen2-MoE with a shared expert); a masked-LM head tied across modules (BERT); a vision
# transformer with a classifier (ViT); a Linear on a constant 4-d table whose output (a view) the next
# module rectifies in place (Swinv2's position-bias MLP).
ZOO = {
    "t5": ("AutoModelForSeq2SeqLM", "t5", {"num_layers": 2, "num_decoder_layers": 2, "d_model": 32, "d_ff": 64,
                                           "num_heads": 4, "d_kv": 8, "dropout_rate": 0.0, "decoder_start_token_id": 0},
           "seq2seq"),
    "albert": ("AutoModelForMaskedLM", "albert", {"num_hidden_layers": 3, "hidden_size": 32, "embedding_size": 16,
                                                  "intermediate_size": 64, "num_attention_heads": 4, **_ZOO_TEXT}, "text"),
    "bert": ("AutoModelForMaskedLM", "bert", {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                                              "num_attention_heads": 4, **_ZOO_TEXT}, "text"),
    "mixtral": ("AutoModelForCausalLM", "mixtral", {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                                                    "num_attention_heads": 4, "num_key_value_heads": 2,
                                                    "num_local_experts": 4, "num_experts_per_tok": 2}, "text"),
    "qwen2_moe": ("AutoModelForCausalLM", "qwen2_moe", {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                                                        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
                                                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
                                                        "num_experts_per_tok": 2}, "text"),
    "vit": ("AutoModelForImageClassification", "vit", {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                                                       "num_attention_heads": 4, "image_size": 16, "patch_size": 4,
                                                       "num_labels": 5, "hidden_dropout_prob": 0.0,
                                                       "attention_probs_dropout_prob": 0.0}, "image"),
    "swinv2": ("AutoModelForImageClassification", "swinv2", {"image_size": 16, "patch_size": 2, "embed_dim": 16,
                                                             "depths": [1, 1], "num_heads": [2, 2], "window_size": 2,
                                                             "drop_path_rate": 0.0, "hidden_dropout_prob": 0.0,
                                                             "attention_probs_dropout_prob": 0.0, "num_labels": 5}, "image"),
}  # fmt: skip
# zero3 splits every module of these small models (the default threshold keeps modules under 100,000
# elements whole on every rank: all of them here).
_SPLIT_ALL = {"partitioner_options": {"persistence_threshold": 0}}
ZOO_CONFIGS = {
    "zero3": {"partitioner": "zero3", **_SPLIT_ALL},
    "zero3 params+optimizer cpu": {"partitioner": "zero3", "offload": {"params": "cpu", "optimizer": "cpu"}, **_SPLIT_ALL},
    "zero2 accumulation 2": {"partitioner": "zero2", "gradient_accumulation_steps": 2},
}


def zoo_model(name: str) -> torch.nn.Module:
    import transformers

    cls, kind, kwargs, _ = ZOO[name]
    config = transformers.AutoConfig.for_model(kind, vocab_size=VOCAB, attn_implementation="eager", **kwargs)
    torch.manual_seed(0)
    return getattr(transformers, cls).from_config(config)


def zoo_batches(name: str, steps: int, world: int, micro: int = 2) -> list[list[dict]]:
    """[step][rank] -> keyword inputs with ``labels``; each step a fresh random global batch."""
    inputs = ZOO[name][3]
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        n = world * micro
        if inputs == "image":
            whole = {"pixel_values": torch.randn(n, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (n,), generator=g)}
        elif inputs == "seq2seq":
            whole = {"input_ids": torch.randint(1, VOCAB, (n, SEQ), generator=g),
                     "labels": torch.randint(1, VOCAB, (n, SEQ // 2), generator=g)}  # fmt: skip
        else:
            ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
            whole = {"input_ids": ids, "labels": ids}
        out.append([{k: v[r * micro : (r + 1) * micro] for k, v in whole.items()} for r in range(world)])
    return out


def zoo_parity(name: str, config_name: str, steps: int) -> dict:
    """One architecture under one configuration through the public API (fp32, clipping); rank 0 also
    trains the same model with torch AdamW on each optimizer step's whole batch."""
    lr, clip = 1e-2, 1.0
    world, rank = _world_rank()
    config = {**copy.deepcopy(ZOO_CONFIGS[config_name]), "precision": "fp32", "gradient_clipping": clip,
              "optimizer": {"name": "adamw", "lr": lr, "weight_decay": 0.0}}  # fmt: skip
    accum = config.get("gradient_accumulation_steps", 1)
    data = zoo_batches(name, steps * accum, world)
    engine = zkernel.initialize(zoo_model(name), config)
    losses = []
    for micro_batches in data:
        loss = engine(**{k: v.to(engine.device) for k, v in micro_batches[rank].items()}).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    result = {"losses": [sum(losses[i : i + accum]) / accum for i in range(0, len(losses), accum)],
              "state": {k: v.float() for k, v in engine.state_dict().items()}, "device": engine.device.type}  # fmt: skip
    engine.close()
    if rank == 0:
        model = zoo_model(name)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        reference = []
        for i in range(0, len(data), accum):
            batch = {k: torch.cat([part[k] for step in data[i : i + accum] for part in step]) for k in data[i][0]}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            reference.append(loss.item())
        result["reference"] = reference
        result["reference_state"] = {k: v.float() for k, v in model.state_dict().items()}
    return result


def hf_suite(big: tuple[int, int], small: tuple[int, int], steps: int) -> dict:
    """Everything the Hugging Face tests check, in one spawn (importing transformers costs seconds per process)."""
    torch.manual_seed(0)
    out = {}
    for i, arch in enumerate(ARCHS):
        out[f"{arch}:build"] = meta_build(arch, *big, first=i == 0)
    for arch in ARCHS:
        out[f"{arch}:parity"] = parity(arch, *small, steps)
        out[f"{arch}:tiled loss"] = tiled_loss_parity(arch, *small, steps)
        out[f"{arch}:generate"] = generate(arch, *small)
        try:  # a failure here fails its own test, not the whole module's fixture
            out[f"{arch}:checkpointed"] = checkpointed_layers(arch, *small, steps)
        except Exception as exc:  # noqa: BLE001
            out[f"{arch}:checkpointed"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        out["t5:generate"] = seq2seq_generate()
    except Exception as exc:  # noqa: BLE001
        out["t5:generate"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        out["blip2:generate"] = blip2_generate()
    except Exception as exc:  # noqa: BLE001
        out["blip2:generate"] = {"error": f"{type(exc).__name__}: {exc}"}
    for name in ZOO:
        for cfg in ZOO_CONFIGS:
            try:
                out[f"zoo:{name}:{cfg}"] = zoo_parity(name, cfg, 3)
            except Exception as exc:  # noqa: BLE001
                out[f"zoo:{name}:{cfg}"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
