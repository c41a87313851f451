"""`ZKernelTrainer` on a PEFT (LoRA) model against the real ``transformers.Trainer`` on the same model.

On 2 gloo ranks (one run, module-scoped; `peft_scenarios`): under zero1, zero2 with the optimizer on the
CPU, and zero3 with parameters and optimizer on the CPU, a LoRA Llama logs the plain Trainer's (DDP)
losses, gradient norms and rates; the frozen base stays bit for bit as it was (partitioned under zero3,
no optimizer state for it); ``save_model`` and each ``checkpoint-N`` hold the adapter the plain Trainer
writes, which ``PeftModel.from_pretrained`` loads to the engine's weights; the engine's checkpoint holds
no frozen value and resumes to the same later steps; ``load_best_model_at_end`` ends on checkpoint-1's
adapter; "Number of trainable parameters" is the adapter's, ``total_flos`` the plain Trainer's; ranks that
disagree on whether peft keeps base weights all gather the whole model. In-process:
which models are adapter models; an adapter on the embeddings, whose base weights peft saves too, is
saved as the plain Trainer saves it; a resized vocabulary also makes save_model gather the base.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

import torch  # noqa: E402

from tests.integrations.transformers import peft_scenarios, scenarios  # noqa: E402
from tests.support.harness import run_ranks  # noqa: E402
from zkernel.integrations.transformers.adapters import is_adapter_model, saves_base_weights  # noqa: E402

RUNS = list(peft_scenarios.PEFT_RUNS)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    return run_ranks(2, peft_scenarios.lora_against_ddp, str(root))


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("run", RUNS)
def test_the_adapter_trains_as_under_the_plain_trainer(lora, run):
    for rank in lora:
        plain, got = rank["plain"], rank[run]
        assert [e["step"] for e in got["logged"]] == list(range(1, scenarios.STEPS + 1))
        for p, z in zip(plain["logged"], got["logged"], strict=True):
            assert _close(z["loss"], p["loss"], 1e-5), (p, z)
            assert _close(z["grad_norm"], p["grad_norm"], 1e-4), (p, z)
            assert z["learning_rate"] == pytest.approx(p["learning_rate"], rel=1e-12, abs=0.0)
        for step, loss in plain["evals"].items():
            assert _close(got["evals"][step], loss, 1e-5), (step, plain["evals"], got["evals"])
        assert got["evals"][scenarios.STEPS] < got["evals"][1] - 0.02  # the adapter learned
    last_plain, last = lora[0]["plain"]["last_adapter"], lora[0][run]["last_adapter"]
    assert last.keys() == last_plain.keys() and all("lora_" in k for k in last)
    for name, value in last_plain.items():  # the adapter after 4 steps, as the plain Trainer saved it
        torch.testing.assert_close(last[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("run", RUNS)
def test_the_base_stays_frozen_and_holds_no_optimizer_state(lora, run):
    adapter, base = lora[0]["adapter_count"], lora[0]["base_count"]
    for rank in lora:
        got = rank[run]
        assert got["base_unchanged"] and got["adapter_moved"]
    # Adam's two fp32 moments of the adapter alone, split over the ranks (a few elements of padding).
    state_bytes = sum(rank[run]["optimizer_state_bytes"] for rank in lora)
    assert 8 * adapter <= state_bytes <= 8 * (adapter + 64) < 8 * base
    if run.startswith("zero3"):  # the frozen base partitioned: released between uses on every rank
        assert all(rank[run]["frozen_numel_held"] == 0 for rank in lora)
    else:
        assert all(rank[run]["frozen_numel_held"] == base for rank in lora)


@pytest.mark.parametrize("run", RUNS)
def test_save_model_writes_the_adapter_the_plain_trainer_writes(lora, run):
    plain, got = lora[0]["plain"], lora[0][run]
    assert got["final_files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                  "training_args.bin"]
    assert got["loaded_equals_engine"]  # PeftModel.from_pretrained(base, dir) gives the engine's weights
    final = got["final_adapter"]
    assert final.keys() == plain["final_adapter"].keys()
    for name, value in plain["final_adapter"].items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-6, msg=name)
    for rank in lora:
        files = rank[run]["checkpoint_files"]
        assert {"adapter_model.safetensors", "adapter_config.json", "zkernel", "scheduler.pt"} <= set(files)
        assert "model.safetensors" not in files


@pytest.mark.parametrize("run", RUNS)
def test_the_engine_checkpoint_holds_no_frozen_value(lora, run):
    names = lora[0][run]["checkpoint_tensors"]
    assert names and all("lora_" in name for name in names), sorted(names)[:5]


def test_a_resumed_run_logs_the_same_later_steps(lora):
    later = slice(2, None)  # after checkpoint-2
    for rank in lora:
        resumed, full = rank["resumed"][later], rank[peft_scenarios.RESUMED]["logged"][later]
        assert [e["step"] for e in resumed] == [e["step"] for e in full] == [3, 4]
        for r, f in zip(resumed, full):
            assert _close(r["loss"], f["loss"], 1e-6), (r, f)
            assert r["learning_rate"] == f["learning_rate"]


def test_the_ranks_agree_on_what_save_model_gathers(lora):
    assert [rank["adapter_alone"] for rank in lora] == [True, True]
    assert [rank["adapter_alone_one_rank_unsure"] for rank in lora] == [False, False]


@pytest.mark.parametrize("run", RUNS)
def test_the_best_adapter_is_loaded_at_the_end(lora, run):
    for rank in lora:
        got = rank[run]
        assert got["best"] == rank["plain"]["best"] == "checkpoint-1"
        assert got["eval_after"] == got["evals"][1]
    got = lora[0][run]
    best, final = got["best_adapter"], got["final_adapter"]
    assert final.keys() == best.keys() and all(torch.equal(final[k], best[k]) for k in best)
    assert not all(torch.equal(final[k], got["last_adapter"][k]) for k in best)


def test_the_logged_parameter_count_is_the_adapters(lora):
    for rank in lora:
        adapter = rank["adapter_count"]
        assert rank["plain"]["count_logged"] == [f"  Number of trainable parameters = {adapter:,}"]
        for run in RUNS:
            assert rank[run]["count_logged"] == rank["plain"]["count_logged"], run
            assert rank[run]["count_engine"] == adapter, run
            # total_flos: 6 x tokens x the whole model outside its embeddings, the adapter's weights included
            assert rank[run]["total_flos"] == rank["plain"]["total_flos"] > 0, run


def test_which_models_are_adapter_models():
    from peft import LoraConfig, get_peft_model

    assert is_adapter_model(peft_scenarios.lora_llama())
    assert not is_adapter_model(scenarios.tiny_llama())
    assert not saves_base_weights(peft_scenarios.lora_llama())
    targets_embedding = get_peft_model(scenarios.tiny_llama(),
                                       LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"]))
    assert saves_base_weights(targets_embedding)
    by_pattern = get_peft_model(scenarios.tiny_llama(), LoraConfig(r=2, target_modules=r".*(q_proj|lm_head)$"))
    assert saves_base_weights(by_pattern)


def test_a_resized_vocabulary_saves_the_base_weights(tmp_path):
    """peft saves the base embeddings where the vocabulary differs from the base model's config.json; a base
    whose config cannot be read here counts as resized (the whole model is gathered)."""
    from peft import LoraConfig, get_peft_model

    scenarios.tiny_llama().config.save_pretrained(tmp_path / "base")
    for resize, expected in ((None, False), (scenarios.VOCAB + 8, True)):
        base = scenarios.tiny_llama()
        if resize is not None:
            base.resize_token_embeddings(resize)
        model = get_peft_model(base, LoraConfig(r=2, target_modules=peft_scenarios.LORA_TARGETS))
        model.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")  # as from_pretrained sets it
        assert saves_base_weights(model) is expected, resize
    unreadable = get_peft_model(scenarios.tiny_llama(), LoraConfig(r=2, target_modules=peft_scenarios.LORA_TARGETS))
    for nowhere in (str(tmp_path / "nowhere"), "zkernel-tests/a-hub-model-not-in-the-cache"):
        unreadable.peft_config["default"].base_model_name_or_path = nowhere
        assert saves_base_weights(unreadable), nowhere


def test_an_adapter_on_the_embeddings_saves_what_the_plain_trainer_saves(tmp_path):
    """peft saves the base embeddings beside an adapter that targets them: save_model then gathers the
    whole model (`saves_base_weights`), and the files hold the plain Trainer's keys and values."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer

    from zkernel.integrations.transformers import ZKernelTrainer

    def model():
        return get_peft_model(scenarios.tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"]))

    data = scenarios.dataset()[:8]
    saved = {}
    for name in ("plain", "zkernel"):
        args = scenarios.arguments(str(tmp_path / name), max_steps=1, gradient_accumulation_steps=1,
                                   save_strategy="no")
        kwargs = {"zkernel_config": {"partitioner": "zero2"}} if name == "zkernel" else {}
        trainer = (ZKernelTrainer if name == "zkernel" else Trainer)(model=model(), args=args, train_dataset=data,
                                                                     **kwargs)
        trainer.train()
        trainer.save_model(str(tmp_path / name / "final"))
        saved[name] = scenarios._safetensors(str(tmp_path / name / "final" / peft_scenarios.ADAPTER_FILE))
    assert any("lora_" not in k for k in saved["plain"])  # the base embedding is among them
    assert saved["zkernel"].keys() == saved["plain"].keys()
    for key, value in saved["plain"].items():
        torch.testing.assert_close(saved["zkernel"][key], value, rtol=1e-4, atol=1e-6, msg=key)
