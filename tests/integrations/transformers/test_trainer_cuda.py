"""`ZKernelTrainer` on a GPU: bf16 through a DeepSpeed config, zero3 with the optimizer on the CPU.

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
