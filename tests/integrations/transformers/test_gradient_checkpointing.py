"""`ZKernelTrainer` with the Trainer's own ``gradient_checkpointing=True``.

On 2 gloo ranks, reentrant and non-reentrant checkpointing: zero1, zero2 with the optimizer on the CPU,
and zero3 with parameters and optimizer on the CPU log the plain Trainer's (DDP, same checkpointing)
losses and gradient norms, a decoder layer's MLP runs its forward again in backward as under the plain
Trainer, and ``save_model`` writes the plain Trainer's weights. The same for a LoRA model with reentrant
checkpointing, whose frozen embeddings give the checkpointed layers inputs that require grad only
through the hook the Trainer adds (``enable_input_require_grads``): the adapter trains and is saved as
under the plain Trainer. A checkpointed layer with a parameter of its own (used in the recomputation
without the layer's hooks) trains under zero3 as in plain torch. In-process: the Trainer's checkpointing
together with the config's ``[activation_checkpointing] modules`` (or a ``[planner] micro_batch``, with
which the planner may checkpoint too) is a `ConfigError` when the trainer is built ([Note: the Trainer's
gradient checkpointing] in `zkernel.integrations.transformers.trainer`).
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from tests.integrations.transformers import scenarios  # noqa: E402
from tests.support.harness import in_turn, run_ranks  # noqa: E402
from zkernel.errors import ConfigError  # noqa: E402
from zkernel.integrations.transformers import ZKernelTrainer  # noqa: E402

FULL_MODEL = [(reentrant, run) for reentrant in ("non_reentrant", "reentrant") for run in scenarios.CHECKPOINTED_RUNS]
LORA_RUNS = ["zero1", "zero2_cpu_optimizer", "zero3_offload"]  # peft_scenarios.PEFT_RUNS, which imports peft


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    """Every two-rank run of this module in one spawn (the Trainer takes seconds to import per process):
    per rank, each run's results by name; the LoRA run where peft is installed."""
    calls = {kind: (scenarios.gradient_checkpointing_against_ddp, str(tmp_path_factory.mktemp(kind)), kind == "reentrant")
             for kind in ("non_reentrant", "reentrant")}  # fmt: skip
    if importlib.util.find_spec("peft") is not None:
        calls["lora"] = (scenarios.gradient_checkpointing_against_ddp, str(tmp_path_factory.mktemp("lora")), True, True)
    calls["own parameter"] = (scenarios.layer_with_its_own_parameter,)
    return run_ranks(2, in_turn, calls)


@pytest.fixture(scope="module")
def checkpointed(spawned):
    """Per checkpointing kind, each rank's results of `scenarios.gradient_checkpointing_against_ddp`."""
    return {kind: [rank[kind] for rank in spawned] for kind in ("non_reentrant", "reentrant")}


@pytest.fixture(scope="module")
def checkpointed_lora(spawned):
    pytest.importorskip("peft")
    from tests.integrations.transformers import peft_scenarios

    assert list(peft_scenarios.PEFT_RUNS) == LORA_RUNS
    return [rank["lora"] for rank in spawned]


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _check_logs(ranks: list[dict], run: str, learned: float) -> None:
    for rank in ranks:
        plain, zk = rank["plain"], rank[run]
        assert [e["step"] for e in zk["logged"]] == list(range(1, scenarios.STEPS + 1))
        for p, z in zip(plain["logged"], zk["logged"], strict=True):
            assert _close(z["loss"], p["loss"], 1e-4), (p, z)
            assert _close(z["grad_norm"], p["grad_norm"], 1e-4), (p, z)
            assert z["learning_rate"] == pytest.approx(p["learning_rate"], rel=1e-12, abs=0.0)
        assert zk["logged"][-1]["loss"] < zk["logged"][0]["loss"] - learned
        assert plain["checkpointing"] and zk["checkpointing"]
        # One forward and one recomputation per micro-batch, as under the plain Trainer.
        assert zk["layer_calls"] == plain["layer_calls"] == 2 * scenarios.MICRO_BATCHES
        assert zk["modules"] == []  # the engine checkpoints nothing itself


@pytest.mark.parametrize(("kind", "run"), FULL_MODEL)
def test_logs_and_recomputation_are_the_plain_trainers(checkpointed, kind, run):
    _check_logs(checkpointed[kind], run, learned=0.1)


@pytest.mark.parametrize(("kind", "run"), FULL_MODEL)
def test_saved_model_equals_the_plain_trainers(checkpointed, kind, run):
    saved = checkpointed[kind][0]["saved"]
    plain, zk = dict(saved["plain"]), dict(saved[run])
    assert zk.pop("tied") and plain.pop("tied")
    assert zk.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(zk[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(plain["model.norm.weight"], torch.ones_like(plain["model.norm.weight"]))  # trained


@pytest.mark.parametrize("run", LORA_RUNS)
def test_lora_with_reentrant_checkpointing_trains_its_adapter(checkpointed_lora, run):
    _check_logs(checkpointed_lora, run, learned=0.0)
    saved = checkpointed_lora[0]["saved"]
    plain, zk = saved["plain"], saved[run]
    assert zk.keys() == plain.keys() and any("lora_B" in name for name in plain)
    for name in plain:
        torch.testing.assert_close(zk[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)
        if "lora_B" in name:  # LoRA's B starts at zero: the adapter received gradients
            assert zk[name].abs().max() > 0, name


def _llama_trainer(args, config: dict) -> ZKernelTrainer:
    """A ZKernelTrainer over a tiny Llama and the scenarios' dataset."""
    return ZKernelTrainer(model=scenarios.tiny_llama(), args=args, train_dataset=scenarios.dataset(), zkernel_config=config)


@pytest.mark.parametrize("argument", ["gradient_checkpointing", "activation_checkpointing"])
def test_trainer_and_config_checkpointing_together_is_an_error(tmp_path, argument):
    if argument == "activation_checkpointing" and not scenarios.TRANSFORMERS_5:
        pytest.skip("TrainingArguments(activation_checkpointing=...) is transformers 5's name")
    args = scenarios.arguments(str(tmp_path), **{argument: True})
    config = {"partitioner": "zero3", "activation_checkpointing": {"modules": ["LlamaDecoderLayer"]}}
    with pytest.raises(ConfigError, match=r"both checkpoint.*valid: one of them"):
        _llama_trainer(args, config)
    # Either one alone is accepted.
    _llama_trainer(scenarios.arguments(str(tmp_path)), config)
    _llama_trainer(args, {"partitioner": "zero3"})


def test_trainer_checkpointing_with_a_planned_micro_batch_is_an_error(tmp_path):
    """With ``[planner] micro_batch`` the planner may select the blocks for checkpointing on top of the Trainer's."""
    config = {"partitioner": "auto", "planner": {"micro_batch": 2}}
    args = scenarios.arguments(str(tmp_path), gradient_checkpointing=True)
    with pytest.raises(ConfigError, match=r"\[planner\] micro_batch=2.*valid: gradient_checkpointing=False"):
        _llama_trainer(args, config)
    _llama_trainer(scenarios.arguments(str(tmp_path)), config)
    _llama_trainer(args, {"partitioner": "auto"})


def test_a_checkpointed_layers_own_parameter_under_zero3(spawned):
    """transformers 5 checkpoints inside the layer's ``forward``: a parameter the layer holds itself is used in
    the recomputation without the layer's hooks firing, and still gets its gradient (an AdamW step of 0.1 moves
    every weight by about 0.1, so a missing gradient shows)."""
    for rank in (ranks["own parameter"] for ranks in spawned):
        assert rank["non_reentrant"] < 1e-5 and rank["reentrant"] < 1e-5, rank
