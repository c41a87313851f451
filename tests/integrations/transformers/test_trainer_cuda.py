"""`ZKernelTrainer` on a GPU: bf16 through a DeepSpeed config, zero3 with the optimizer on the CPU; with
``load_best_model_at_end`` the engine ends with the best checkpoint's weights; the Trainer's gradient
checkpointing with its ``offload`` (pinned host memory) and ``every_n_layers`` keys under zero3.

Run on the GPU machine: ``python -m pytest -q tests/integrations/transformers/test_trainer_cuda.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.integrations.transformers import scenarios  # noqa: E402

pytestmark = pytest.mark.cuda


def test_bf16_zero3_offload_trains_near_the_fp32_trainer(tmp_path):
    from transformers import LlamaForCausalLM, Trainer

    from zkernel.integrations.transformers import ZKernelTrainer

    data = scenarios.dataset()
    plain = Trainer(model=scenarios.tiny_llama(), args=scenarios.arguments(str(tmp_path / "plain"),
                                                                          save_strategy="no"), train_dataset=data)
    plain.train()
    config = {**scenarios.DEEPSPEED_ZERO3_OFFLOAD, "bf16": {"enabled": "auto"}}
    zk = ZKernelTrainer(model=scenarios.tiny_llama(), args=scenarios.arguments(str(tmp_path / "zk"),
                                                                              bf16=True), train_dataset=data,
                        zkernel_config=config)
    zk.train()
    assert zk.engine.config.precision == "bf16" and zk.engine.device.type == "cuda"
    expected = [e["loss"] for e in plain.state.log_history if "loss" in e]
    got = [e["loss"] for e in zk.state.log_history if "loss" in e]
    assert got == pytest.approx(expected, rel=2e-2)  # bf16 compute against fp32
    zk.save_model(str(tmp_path / "final"))
    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert all(torch.isfinite(p).all() for p in reloaded.parameters())
    resumed = ZKernelTrainer(model=scenarios.tiny_llama(), args=scenarios.arguments(str(tmp_path / "zk"),
                                                                                   bf16=True),
                             train_dataset=data, zkernel_config=config)
    resumed.train(resume_from_checkpoint=str(tmp_path / "zk" / f"checkpoint-{scenarios.SAVE_AT}"))
    later = [e["loss"] for e in resumed.state.log_history if "loss" in e][scenarios.SAVE_AT:]
    assert later == pytest.approx(got[scenarios.SAVE_AT:], rel=1e-3)


def test_bf16_zero3_offload_ends_with_the_best_checkpoint(tmp_path):
    """load_best_model_at_end on the GPU: the engine's parameters on the device come back from checkpoint-1
    (the best: greater_is_better on a falling loss), and the logged parameter count is the whole model's."""
    import logging

    from safetensors.torch import load_file

    from zkernel.integrations.transformers import ZKernelTrainer

    data = scenarios.dataset()
    args = scenarios.arguments(str(tmp_path), bf16=True, warmup_steps=0, eval_strategy="steps", eval_steps=1, save_steps=1,
                               save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="loss",
                               greater_is_better=True)
    trainer = ZKernelTrainer(model=scenarios.tiny_llama(), args=args, train_dataset=data, eval_dataset=data[:8],
                             zkernel_config={**scenarios.DEEPSPEED_ZERO3_OFFLOAD, "bf16": {"enabled": "auto"}})
    lines = scenarios._Lines()
    trainer_logger = logging.getLogger(scenarios.TRAINER_LOGGER)
    trainer_logger.setLevel(logging.INFO)
    trainer_logger.addHandler(lines)
    try:
        trainer.train()
    finally:
        trainer_logger.removeHandler(lines)
        trainer_logger.setLevel(logging.NOTSET)
    assert trainer.engine.device.type == "cuda"
    true_count = sum(p.numel() for p in scenarios.tiny_llama().parameters())
    assert [line for line in lines.lines if "Number of trainable" in line] == [
        f"  Number of trainable parameters = {true_count:,}"
    ]
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1") and evals[0] > evals[-1]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    saved = load_file(str(tmp_path / "checkpoint-1" / "model.safetensors"))
    state = trainer.engine.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[0], rel=1e-5)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_with_offload_and_every_n_layers(tmp_path, use_reentrant):
    """The Trainer's gradient checkpointing with its ``offload`` (saved activations in pinned host memory,
    which needs CUDA) and ``every_n_layers`` keys: zero3 with parameters and optimizer on the CPU logs the
    plain Trainer's losses and gradient norms (fp32, one process) and saves its weights."""
    from transformers import LlamaForCausalLM, Trainer

    from zkernel.integrations.transformers import ZKernelTrainer

    data = scenarios.dataset()
    checkpointing = dict(gradient_checkpointing=True, save_strategy="no",
                         gradient_checkpointing_kwargs={"use_reentrant": use_reentrant, "offload": True,
                                                        "every_n_layers": 2})
    plain = Trainer(model=scenarios.tiny_llama(), args=scenarios.arguments(str(tmp_path / "plain"), **checkpointing),
                    train_dataset=data)
    plain.train()
    plain.save_model(str(tmp_path / "plain" / "final"))
    zk = ZKernelTrainer(model=scenarios.tiny_llama(), args=scenarios.arguments(str(tmp_path / "zk"), **checkpointing),
                        train_dataset=data, zkernel_config=scenarios.CHECKPOINTED_RUNS["zero3_offload"])
    zk.train()
    zk.save_model(str(tmp_path / "zk" / "final"))
    assert zk.engine.device.type == "cuda" and zk.model.is_gradient_checkpointing
    for p, z in zip(scenarios._logged(plain), scenarios._logged(zk), strict=True):
        assert z["loss"] == pytest.approx(p["loss"], rel=1e-3), (p, z)
        assert z["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-3), (p, z)
    expected = LlamaForCausalLM.from_pretrained(str(tmp_path / "plain" / "final")).state_dict()
    got = LlamaForCausalLM.from_pretrained(str(tmp_path / "zk" / "final")).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-3, atol=1e-5, msg=name)
