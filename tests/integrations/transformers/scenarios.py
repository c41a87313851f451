"""What the ZKernelTrainer tests run on their gloo ranks: the real Trainer and ZKernelTrainer on one tiny Llama.

One global set-up for both: a random-init LlamaForCausalLM (tied embeddings, hidden size 32, two layers),
token sequences of a fixed bigram rule, two micro-batches of two per optimizer step (accumulation), a
linear schedule with warm-up, weight decay with the Trainer's no-decay groups, and clipping that bites.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from zkernel.integrations.transformers import ZKernelTrainer  # noqa: E402

hf_logging.set_verbosity_error()

# transformers 5's _init_weights computes Llama's rotary buffers, which a meta-built model needs (4.x's does not).
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

VOCAB, SEQ, SAMPLES = 64, 16, 32
STEPS, SAVE_AT = 4, 2
LR, WD, CLIP = 3e-3, 0.1, 0.5

# The DeepSpeed JSON a Hugging Face user already has: stage 3, the optimizer's state on the CPU,
# its values "auto" (filled from the TrainingArguments); no scheduler (the Trainer's runs).
DEEPSPEED_ZERO3_OFFLOAD = {
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "stage3_param_persistence_threshold": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    """Sequences x[t+1] = (5 x[t] + 3) mod VOCAB from random starts: learnable within a few steps."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(SAMPLES):
        ids = torch.empty(SEQ, dtype=torch.long)
        ids[0] = torch.randint(0, VOCAB, (1,), generator=g)
        for t in range(1, SEQ):
            ids[t] = (5 * ids[t - 1] + 3) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def arguments(output_dir: str, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=LR, warmup_steps=1, weight_decay=WD, max_grad_norm=CLIP, logging_steps=1,
        save_steps=SAVE_AT, save_strategy="steps", report_to=[], seed=0, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # zkernel takes the GPU where one is visible: so does the Trainer
        dataloader_num_workers=0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def _logged(trainer) -> list[dict[str, float]]:
    return [{k: e[k] for k in ("step", "loss", "grad_norm", "learning_rate")} for e in trainer.state.log_history
            if "loss" in e]


def _logits(prediction) -> torch.Tensor:
    """The logits ``trainer.predict`` gathered from every rank."""
    logits = prediction.predictions
    return torch.as_tensor(logits[0] if isinstance(logits, tuple) else logits)


def _weights(directory: str) -> dict[str, torch.Tensor]:
    model = LlamaForCausalLM.from_pretrained(directory)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"tied": tied, **{k: v.clone() for k, v in model.state_dict().items()}}


def trainer_against_ddp(root: str) -> dict:
    """On each rank: the plain Trainer (DDP), ZKernelTrainer (zero3, optimizer on the CPU), and a
    ZKernelTrainer resumed from the latter's mid-run checkpoint; their logs, and (rank 0) the saved models."""
    import torch.distributed as dist

    data = dataset()
    plain = Trainer(model=tiny_llama(), args=arguments(f"{root}/plain"), train_dataset=data, eval_dataset=data[:8])
    plain.train()
    plain_eval = plain.evaluate()["eval_loss"]
    plain_logits = _logits(plain.predict(data[:4]))
    plain.save_model(f"{root}/plain/final")

    zk = ZKernelTrainer(model=tiny_llama(), args=arguments(f"{root}/zk"), train_dataset=data,
                        eval_dataset=data[:8], zkernel_config=DEEPSPEED_ZERO3_OFFLOAD)
    zk.train()
    evaluated = zk.evaluate()["eval_loss"]
    logits_diff = (_logits(zk.predict(data[:4])) - plain_logits).abs().max().item()
    zk.save_model(f"{root}/zk/final")

    resumed = ZKernelTrainer(model=tiny_llama(), args=arguments(f"{root}/zk"), train_dataset=data,
                             zkernel_config=DEEPSPEED_ZERO3_OFFLOAD)
    resumed.train(resume_from_checkpoint=f"{root}/zk/checkpoint-{SAVE_AT}")

    # A model built on the meta device, materialised in shards by zero3, the plain run's weights loaded
    # into it file by file: it evaluates as the plain trained model does.
    with torch.device("meta" if TRANSFORMERS_5 else "cpu"):
        meta_model = tiny_llama()
    from_meta = ZKernelTrainer(model=meta_model, args=arguments(f"{root}/meta"), eval_dataset=data[:8],
                               zkernel_config={"partitioner": "zero3"}, zkernel_pretrained=f"{root}/plain/final")
    meta_eval = from_meta.evaluate()["eval_loss"]
    dist.barrier()
    out = {
        "plain": _logged(plain), "zkernel": _logged(zk), "resumed": _logged(resumed),
        "eval_loss": {"plain": plain_eval, "zkernel": evaluated, "from_meta": meta_eval},
        "total_flos": {"plain": plain.state.total_flos, "zkernel": zk.state.total_flos},
        "predicted_logits_diff": logits_diff, "predicted_logits_scale": plain_logits.abs().max().item(),
        "engine": {"partitioner": zk.engine.config.partitioner, "offload": zk.engine.config.offload.optimizer,
                   "optimizer": zk.engine.config.optimizer.name,
                   "no_weight_decay": sorted(zk.engine.config.optimizer.no_weight_decay)},
        # The Trainer's own no-decay group (its rule differs between transformers releases).
        "trainer_no_decay": sorted({n for n, _ in plain.model.named_parameters()}
                                   - set(plain.get_decay_parameter_names(plain.model))),
        "checkpoint_files": sorted(os.listdir(f"{root}/zk/checkpoint-{SAVE_AT}")),
    }
    if dist.get_rank() == 0:
        out["plain_weights"] = _weights(f"{root}/plain/final")
        out["zkernel_weights"] = _weights(f"{root}/zk/final")
    return out


# -- load_best_model_at_end -----------------------------------------------------------------------------

# Each partitioner, the optimizer in device memory or offloaded; save_total_limit 1 or 2 (the Trainer keeps
# the best checkpoint either way, and with 1 deletes the others when training ends).
BEST_RUNS = {
    "zero1": ({"partitioner": "zero1"}, 1),
    "zero2_offload": ({"partitioner": "zero2", "offload": {"optimizer": "cpu"}}, 2),
    "zero3_offload": (DEEPSPEED_ZERO3_OFFLOAD, 2),
}
TRAINER_LOGGER = "transformers.trainer"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _equal(state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> bool:
    """Whether every tensor ``saved`` holds is in ``state``, bit for bit (``save_pretrained`` stores a tied
    weight once: the state dict has it under each name)."""
    return saved.keys() <= state.keys() and all(torch.equal(state[k], saved[k]) for k in saved)


def best_model_at_end(root: str) -> dict:
    """On each rank, per `BEST_RUNS` entry: ZKernelTrainer evaluating and saving every step with
    ``load_best_model_at_end`` and ``metric_for_best_model="loss"``, ``greater_is_better=True`` (the run
    learns, so checkpoint-1's eval loss is the largest: an early checkpoint is the best); what the engine
    holds after ``train()`` against the checkpoints' saved weights, what ``evaluate()`` and ``save_model()``
    give then, which checkpoints are left; and the Trainer's logged parameter count."""
    import torch.distributed as dist
    from transformers import trainer_pt_utils

    data = dataset()
    true_count = sum(p.numel() for p in tiny_llama().parameters() if p.requires_grad)
    out: dict = {"true_count": true_count}
    for name, (config, limit) in BEST_RUNS.items():
        directory = f"{root}/{name}"
        # No warm-up: the first step moves the weights (its rate would be 0 with one warm-up step).
        args = arguments(directory, warmup_steps=0, eval_strategy="steps", eval_steps=1, save_steps=1,
                         save_total_limit=limit, load_best_model_at_end=True, metric_for_best_model="loss",
                         greater_is_better=True)
        trainer = ZKernelTrainer(model=tiny_llama(), args=args, train_dataset=data, eval_dataset=data[:8],
                                 zkernel_config=config)
        lines = _Lines()
        trainer_logger = logging.getLogger(TRAINER_LOGGER)
        level = trainer_logger.level
        trainer_logger.setLevel(logging.INFO)
        trainer_logger.addHandler(lines)
        try:
            trainer.train()
        finally:
            trainer_logger.removeHandler(lines)
            trainer_logger.setLevel(level)
        evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
        state = trainer.engine.state_dict()  # every rank: the consolidated weights the engine holds now
        best = os.path.basename(trainer.state.best_model_checkpoint)
        run = {
            "best": best,
            "evals": evals,
            "eval_after": trainer.evaluate()["eval_loss"],
            "equals_best": _equal(state, _safetensors(f"{directory}/{best}/model.safetensors")),
            "equals_initial": _equal(state, tiny_llama().state_dict()),
            "count_logged": [line for line in lines.lines if "Number of trainable parameters" in line],
            # Outside train() transformers' own function is back ([Note: counting released parameters]).
            "count_restored": trainer_pt_utils.get_model_param_count.__module__ == "transformers.trainer_pt_utils",
            "count_engine": trainer.engine.num_parameters(trainable_only=True),
            "numel_held": sum(p.numel() for p in trainer.model.parameters()),
        }
        last = f"{directory}/checkpoint-{STEPS}/model.safetensors"
        if os.path.exists(last):
            run["equals_last"] = _equal(state, _safetensors(last))
        trainer.save_model(f"{directory}/final")
        dist.barrier()
        run["checkpoints"] = sorted(d for d in os.listdir(directory) if d.startswith("checkpoint-"))
        if dist.get_rank() == 0:
            run["saved_equals_best"] = _equal(_safetensors(f"{directory}/final/model.safetensors"),
                                              _safetensors(f"{directory}/{best}/model.safetensors"))
        out[name] = run
    return out


# -- the Trainer's own gradient checkpointing ---------------------------------------------------------

CHECKPOINTED_RUNS = {
    "zero1": {"partitioner": "zero1"},
    "zero2_offload": {"partitioner": "zero2", "offload": {"optimizer": "cpu"}},
    "zero3_offload": {"partitioner": "zero3", "offload": {"optimizer": "cpu", "params": "cpu"}},
}
MICRO_BATCHES = STEPS * 2  # per rank: gradient_accumulation_steps=2 in `arguments`


def _layer_calls(trainer) -> list[int]:
    """A counter of the first decoder layer's MLP forward calls (its recomputations in backward included:
    transformers 5 checkpoints inside the layer's ``forward``, so the layer's own hooks fire once)."""
    calls = [0]

    def count(_module, _args):
        calls[0] += 1

    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    model.model.layers[0].mlp.register_forward_pre_hook(count)
    return calls


def _saved(directory: str, lora: bool) -> dict:
    """What ``save_model`` wrote: the adapter's tensors (a LoRA model), else the model `from_pretrained` loads."""
    return _safetensors(f"{directory}/adapter_model.safetensors") if lora else _weights(directory)


def gradient_checkpointing_against_ddp(root: str, use_reentrant: bool, lora: bool = False) -> dict:
    """On each rank: the plain Trainer (DDP) and ZKernelTrainer per `CHECKPOINTED_RUNS` entry (with ``lora``:
    the LoRA model of `peft_scenarios` and its `PEFT_RUNS`), all with ``TrainingArguments(
    gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": ...})``; their logs, how
    often the first layer's MLP ran forward, and (rank 0) what each ``save_model`` wrote.

    With LoRA the embeddings are frozen, so a reentrant checkpoint's input requires grad only through the
    hook the Trainer's ``gradient_checkpointing_enable`` puts on them (``enable_input_require_grads``); the
    plain Trainer runs with ``ddp_find_unused_parameters=False`` there, as DDP marks the adapter's
    parameters twice otherwise."""
    import torch.distributed as dist

    if lora:
        from tests.integrations.transformers import peft_scenarios

        build, runs = peft_scenarios.lora_llama, peft_scenarios.PEFT_RUNS
        extra = dict(learning_rate=peft_scenarios.LORA_LR)
    else:
        build, runs, extra = tiny_llama, CHECKPOINTED_RUNS, {}
    data = dataset()
    checkpointing = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
                         save_strategy="no", **extra)
    plain = Trainer(model=build(), args=arguments(f"{root}/plain", ddp_find_unused_parameters=False if lora else None,
                                                  **checkpointing), train_dataset=data)
    calls = _layer_calls(plain)
    plain.train()
    plain.save_model(f"{root}/plain/final")
    out: dict = {"plain": {"logged": _logged(plain), "layer_calls": calls[0],
                           "checkpointing": plain.model.is_gradient_checkpointing}}
    for name, config in runs.items():
        trainer = ZKernelTrainer(model=build(), args=arguments(f"{root}/{name}", **checkpointing),
                                 train_dataset=data, zkernel_config=config)
        calls = _layer_calls(trainer)
        trainer.train()
        trainer.save_model(f"{root}/{name}/final")
        out[name] = {"logged": _logged(trainer), "layer_calls": calls[0],
                     "checkpointing": trainer.model.is_gradient_checkpointing,
                     "modules": list(trainer.engine.config.activation_checkpointing.modules)}
    dist.barrier()
    if dist.get_rank() == 0:
        out["saved"] = {name: _saved(f"{root}/{name}/final", lora) for name in ("plain", *runs)}
    return out


def layer_with_its_own_parameter() -> dict[str, float]:
    """On each rank, reentrant and not: a stack of transformers' ``GradientCheckpointingLayer`` whose layers
    hold a parameter of their own beside a submodule's (transformers 5 checkpoints inside ``forward``, so the
    layer's own hooks do not fire in the recomputation), under zero3 with every parameter partitioned and
    released, one AdamW step against plain torch; the largest weight difference per kind."""
    import copy
    import functools

    from torch import nn
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    import zkernel

    class Layer(GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(32))
            self.proj = nn.Linear(32, 32)

        def forward(self, x):
            return torch.tanh(self.proj(x)) * self.scale + x

    out = {}
    for use_reentrant in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), Layer(), Layer(), nn.Linear(32, 1))
        for layer in model[1:3]:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=use_reentrant)
        reference = copy.deepcopy(model)
        x = torch.randn(4, 8)
        reference(x).pow(2).mean().backward()
        torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0).step()
        engine = zkernel.initialize(model, {"partitioner": "zero3", "precision": "fp32",
                                            "partitioner_options": {"persistence_threshold": 0},
                                            "optimizer": {"name": "adamw", "lr": 0.1, "weight_decay": 0.0}})
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        state = engine.state_dict()
        engine.close()
        out["reentrant" if use_reentrant else "non_reentrant"] = max(
            (state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return out
