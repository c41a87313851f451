"""`ZKernelTrainer` on a PEFT (LoRA) model on a GPU: bf16, zero3 with parameters and optimizer on the CPU.

Run on the GPU machine: ``python -m pytest -q tests/integrations/transformers/test_peft_cuda.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402

from tests.integrations.transformers import peft_scenarios, scenarios  # noqa: E402

pytestmark = pytest.mark.cuda


def test_bf16_lora_under_zero3_offload_trains_near_the_fp32_trainer(tmp_path):
    """The losses are the plain fp32 Trainer's within bf16's error; the frozen base is held in bf16 (the
    compute dtype, as DeepSpeed casts the model) and never changes: the engine's base is the initial one
    rounded to bf16, bit for bit; the saved adapter loads into a fresh base with the engine's values."""
    from peft import PeftModel
    from transformers import Trainer

    from zkernel.integrations.transformers import ZKernelTrainer

    data = scenarios.dataset()
    initial = {k: v.clone() for k, v in peft_scenarios.lora_llama().state_dict().items()}
    overrides = dict(learning_rate=peft_scenarios.LORA_LR, save_strategy="no")
    plain = Trainer(model=peft_scenarios.lora_llama(), args=scenarios.arguments(str(tmp_path / "plain"), **overrides),
                    train_dataset=data)
    plain.train()
    config = {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0},
              "offload": {"optimizer": "cpu", "params": "cpu"}}
    zk = ZKernelTrainer(model=peft_scenarios.lora_llama(),
                        args=scenarios.arguments(str(tmp_path / "zk"), bf16=True, **overrides),
                        train_dataset=data, zkernel_config=config)
    zk.train()
    assert zk.engine.config.precision == "bf16" and zk.engine.device.type == "cuda"
    expected = [e["loss"] for e in plain.state.log_history if "loss" in e]
    got = [e["loss"] for e in zk.state.log_history if "loss" in e]
    assert got == pytest.approx(expected, rel=2e-2)  # bf16 compute against fp32
    state = zk.engine.state_dict()
    for name, value in initial.items():
        if "lora_" not in name:
            assert torch.equal(state[name], value.to(torch.bfloat16).to(value.dtype)), name
    assert any(not torch.equal(state[k], initial[k]) for k in initial if "lora_B" in k)
    zk.save_model(str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(scenarios.tiny_llama(), str(tmp_path / "adapter")).state_dict()
    for name in (k for k in state if "lora_" in k):
        assert torch.equal(loaded[name], state[name]), name
