"""What the PEFT tests run on their gloo ranks: the plain Trainer (DDP) and ZKernelTrainer on one LoRA model.

The model is `scenarios.tiny_llama` under ``peft.get_peft_model`` (rank-4 LoRA on the attention's q and v
projections; the base frozen). Every run evaluates and saves each step with ``load_best_model_at_end``
and ``greater_is_better=True`` on the eval loss, so the best checkpoint is the first (the run learns):
the runs log the plain Trainer's losses, and end holding checkpoint-1's adapter.
"""

from __future__ import annotations

import os

import torch

from tests.integrations.transformers import scenarios
from tests.integrations.transformers.scenarios import _Lines, _safetensors

LORA_TARGETS = ["q_proj", "v_proj"]
LORA_LR = 2e-2  # LoRA's B starts at zero: a larger rate than the full model's moves the loss in 4 steps
PEFT_RUNS = {
    "zero1": {"partitioner": "zero1"},
    "zero2_cpu_optimizer": {"partitioner": "zero2", "offload": {"optimizer": "cpu"}},
    # persistence_threshold 0: every parameter partitioned, the tiny model's too (none kept whole)
    "zero3_offload": {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0},
                      "offload": {"optimizer": "cpu", "params": "cpu"}},
}
RESUMED = "zero3_offload"  # the run resumed from its checkpoint-2
ADAPTER_FILE = "adapter_model.safetensors"


def lora_llama():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(scenarios.tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))


def _arguments(directory: str, **overrides):
    values = dict(learning_rate=LORA_LR, warmup_steps=0, eval_strategy="steps", eval_steps=1, save_steps=1,
                  load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    values.update(overrides)
    return scenarios.arguments(directory, **values)


def _train(trainer) -> list[str]:
    """``trainer.train()``; the Trainer's "Number of trainable parameters" log lines."""
    import logging

    lines = _Lines()
    logger = logging.getLogger(scenarios.TRAINER_LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        trainer.train()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return [line for line in lines.lines if "Number of trainable parameters" in line]


def _evals(trainer) -> dict[int, float]:
    return {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}


def _checkpoint_tensors(directory: str) -> set[str]:
    """The names of the tensors every rank's files of an engine checkpoint hold (alignment padding left out)."""
    from safetensors import safe_open

    names: set[str] = set()
    for root, _, files in os.walk(directory):
        for file in files:
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(root, file), "pt") as tensors:
                    names.update(k for k in tensors.keys() if not k.startswith("__pad__"))
    return names


def lora_against_ddp(root: str) -> dict:
    """On each rank: the plain Trainer and, per `PEFT_RUNS` entry, ZKernelTrainer on the same LoRA model and
    data; their logs, evaluations, saved adapters, checkpoints and counts; a ZKernelTrainer resumed from
    `RESUMED`'s checkpoint-2."""
    import torch.distributed as dist
    from peft import PeftModel
    from transformers import Trainer

    from zkernel.integrations.transformers import ZKernelTrainer

    data = scenarios.dataset()
    initial = {k: v.clone() for k, v in lora_llama().state_dict().items()}
    base_keys = sorted(k for k in initial if "lora_" not in k)
    adapter_count = sum(p.numel() for p in lora_llama().parameters() if p.requires_grad)
    base_count = sum(p.numel() for p in lora_llama().parameters() if not p.requires_grad)

    plain = Trainer(model=lora_llama(), args=_arguments(f"{root}/plain"), train_dataset=data, eval_dataset=data[:8])
    plain_count = _train(plain)
    plain.save_model(f"{root}/plain/final")
    out: dict = {"plain": {"logged": scenarios._logged(plain), "evals": _evals(plain), "count_logged": plain_count,
                           "total_flos": plain.state.total_flos,
                           "best": os.path.basename(plain.state.best_model_checkpoint)},
                 "adapter_count": adapter_count, "base_count": base_count}

    for name, config in PEFT_RUNS.items():
        directory = f"{root}/{name}"
        trainer = ZKernelTrainer(model=lora_llama(), args=_arguments(directory), train_dataset=data,
                                 eval_dataset=data[:8], zkernel_config=config)
        count_logged = _train(trainer)
        engine = trainer.engine
        state = engine.state_dict()  # every rank: the weights the engine holds after the best was loaded
        report = engine.memory_report()
        trainer.save_model(f"{directory}/final")
        dist.barrier()
        run = {
            "logged": scenarios._logged(trainer),
            "evals": _evals(trainer),
            "eval_after": trainer.evaluate()["eval_loss"],
            "best": os.path.basename(trainer.state.best_model_checkpoint),
            "base_unchanged": all(torch.equal(state[k], initial[k]) for k in base_keys),
            "adapter_moved": any(not torch.equal(state[k], initial[k]) for k in initial if "lora_B" in k),
            "count_logged": count_logged,
            "count_engine": engine.num_parameters(trainable_only=True),
            "total_flos": trainer.state.total_flos,
            "frozen_numel_held": sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad),
            # The optimizer's state on this rank: Adam's two moments, fp32, of this rank's adapter shard.
            "optimizer_state_bytes": sum(report.get("optimizer_state", {}).values()),
            "checkpoint_files": sorted(os.listdir(f"{directory}/checkpoint-2")),
            "checkpoint_tensors": _checkpoint_tensors(f"{directory}/checkpoint-2/zkernel"),
            "final_files": sorted(os.listdir(f"{directory}/final")),
        }
        if dist.get_rank() == 0:
            # The saved adapter loads into a fresh base: the whole model is then the engine's, bit for bit.
            loaded = PeftModel.from_pretrained(scenarios.tiny_llama(), f"{directory}/final").state_dict()
            run["loaded_equals_engine"] = loaded.keys() == state.keys() and all(
                torch.equal(loaded[k], state[k]) for k in state)
            run["final_adapter"] = _safetensors(f"{directory}/final/{ADAPTER_FILE}")
            run["best_adapter"] = _safetensors(f"{directory}/checkpoint-1/{ADAPTER_FILE}")
            run["last_adapter"] = _safetensors(f"{directory}/checkpoint-{scenarios.STEPS}/{ADAPTER_FILE}")
        out[name] = run

    resumed = ZKernelTrainer(model=lora_llama(), args=_arguments(f"{root}/resumed"), train_dataset=data,
                             eval_dataset=data[:8], zkernel_config=PEFT_RUNS[RESUMED])
    resumed.train(resume_from_checkpoint=f"{root}/{RESUMED}/checkpoint-2")
    out["resumed"] = scenarios._logged(resumed)
    # Ranks that disagree on whether peft keeps base weights (rank 1 cannot read its base's config.json)
    # all gather the whole model.
    from zkernel.integrations.transformers.adapters import adapter_alone

    out["adapter_alone"] = adapter_alone(resumed.model, resumed.engine)
    if dist.get_rank() == 1:
        resumed.model.peft_config["default"].base_model_name_or_path = f"{root}/no-such-base"
    out["adapter_alone_one_rank_unsure"] = adapter_alone(resumed.model, resumed.engine)
    dist.barrier()
    if dist.get_rank() == 0:
        out["plain"]["final_adapter"] = _safetensors(f"{root}/plain/final/{ADAPTER_FILE}")
        out["plain"]["last_adapter"] = _safetensors(f"{root}/plain/checkpoint-{scenarios.STEPS}/{ADAPTER_FILE}")
    return out
