"""`ZKernelTrainer` with the Trainer's own ``gradient_checkpointing=True``.

On 2 gloo ranks, reentrant and non-reentrant checkpointing: zero1, zero2 with the optimizer on the CPU,
and zero3 with parameters and optimizer on the CPU log the plain Trainer's (DDP, same checkpointing)
losses and gradient norms, a decoder layer's MLP runs its forward again in backward as under the plain
Trainer, and ``save_model`` writes the plain Trainer's weights. In-process: the Trainer's checkpointing
together with the config's ``[activation_checkpointing] modules`` is a `ConfigError` when the trainer
is built ([Note: the Trainer's gradient checkpointing] in `zkernel.integrations.transformers.trainer`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from tests.integrations.transformers import scenarios  # noqa: E402
from tests.support.harness import run_ranks  # noqa: E402
from zkernel.errors import ConfigError  # noqa: E402
from zkernel.integrations.transformers import ZKernelTrainer  # noqa: E402


@pytest.fixture(scope="module", params=[False, True], ids=["non_reentrant", "reentrant"])
def checkpointed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpointed")
    return run_ranks(2, scenarios.gradient_checkpointing_against_ddp, str(root), request.param)


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("run", list(scenarios.CHECKPOINTED_RUNS))
def test_logs_the_plain_trainers_losses_and_norms(checkpointed, run):
    for rank in checkpointed:
        plain, zk = rank["plain"], rank[run]
        assert [e["step"] for e in zk["logged"]] == list(range(1, scenarios.STEPS + 1))
        for p, z in zip(plain["logged"], zk["logged"], strict=True):
            assert _close(z["loss"], p["loss"], 1e-4), (p, z)
            assert _close(z["grad_norm"], p["grad_norm"], 1e-4), (p, z)
            assert z["learning_rate"] == pytest.approx(p["learning_rate"], rel=1e-12, abs=0.0)
        assert zk["logged"][-1]["loss"] < zk["logged"][0]["loss"] - 0.1  # it learned


@pytest.mark.parametrize("run", list(scenarios.CHECKPOINTED_RUNS))
def test_layers_are_recomputed_once_in_backward(checkpointed, run):
    for rank in checkpointed:
        plain, zk = rank["plain"], rank[run]
        assert plain["checkpointing"] and zk["checkpointing"]
        # One forward and one recomputation per micro-batch, as under the plain Trainer.
        assert zk["layer_calls"] == plain["layer_calls"] == 2 * scenarios.MICRO_BATCHES
        assert zk["modules"] == []  # the engine checkpoints nothing itself


@pytest.mark.parametrize("run", list(scenarios.CHECKPOINTED_RUNS))
def test_saved_model_equals_the_plain_trainers(checkpointed, run):
    weights = checkpointed[0]["weights"]
    plain, zk = dict(weights["plain"]), dict(weights[run])
    assert zk.pop("tied") and plain.pop("tied")
    assert zk.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(zk[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(plain["model.norm.weight"], torch.ones_like(plain["model.norm.weight"]))  # trained


@pytest.mark.parametrize("argument", ["gradient_checkpointing", "activation_checkpointing"])
def test_trainer_and_config_checkpointing_together_is_an_error(tmp_path, argument):
    if argument == "activation_checkpointing" and not scenarios.TRANSFORMERS_5:
        pytest.skip("TrainingArguments(activation_checkpointing=...) is transformers 5's name")
    args = scenarios.arguments(str(tmp_path), **{argument: True})
    config = {"partitioner": "zero3", "activation_checkpointing": {"modules": ["LlamaDecoderLayer"]}}
    with pytest.raises(ConfigError, match=r"both checkpoint.*valid: one of them"):
        ZKernelTrainer(model=scenarios.tiny_llama(), args=args, train_dataset=scenarios.dataset(),
                       zkernel_config=config)
    # Either one alone is accepted.
    ZKernelTrainer(model=scenarios.tiny_llama(), args=scenarios.arguments(str(tmp_path)),
                   train_dataset=scenarios.dataset(), zkernel_config=config)
    ZKernelTrainer(model=scenarios.tiny_llama(), args=args, train_dataset=scenarios.dataset(),
                   zkernel_config={"partitioner": "zero3"})
