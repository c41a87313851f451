"""`ZKernelTrainer` against the real ``transformers.Trainer``.

On 2 gloo ranks (one run, module-scoped): the plain Trainer under DDP and ZKernelTrainer with a
DeepSpeed zero3 config whose optimizer state is on the CPU, on a random-init Llama with accumulation,
warm-up and clipping, log the same ``loss``/``grad_norm``/``learning_rate``; a run resumed from the
mid-run ``checkpoint-N`` logs the same later steps; ``save_model`` writes what ``from_pretrained`` loads,
equal to the plain Trainer's; evaluate() and predict() under zero3 give the plain Trainer's loss and
logits; a model built on the meta device with those weights loaded evaluates as the plain one.
With ``load_best_model_at_end`` (zero1, zero2 and zero3, the optimizer offloaded) the engine ends
holding an early best checkpoint's weights on every rank, and evaluate() and save_model() use them;
under zero3 the Trainer logs the model's whole parameter count.
In-process: a best checkpoint that cannot be loaded is an error; contradictions between the config and the arguments, and an optimizer zkernel cannot step,
are errors before training; "auto" values take the arguments'; a short last window steps; zero1, zero2
and offload placements train as the plain Trainer; a config's own schedule sets the rate and resumes; a process that
sees several GPUs drives one.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from tests.integrations.transformers import scenarios  # noqa: E402
from tests.support.harness import in_turn, run_ranks  # noqa: E402
from zkernel.errors import ConfigError  # noqa: E402
from zkernel.integrations.transformers import ZKernelTrainer  # noqa: E402
from zkernel.integrations.transformers.config import resolve  # noqa: E402

LATER = slice(scenarios.SAVE_AT, None)  # the steps after the mid-run checkpoint


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    """Both two-rank runs of this module in one spawn (the Trainer takes seconds to import per process):
    per rank, each run's results by name."""
    return run_ranks(2, in_turn, {"against ddp": (scenarios.trainer_against_ddp, str(tmp_path_factory.mktemp("trainer"))),
                                  "best at end": (scenarios.best_model_at_end, str(tmp_path_factory.mktemp("best")))})


@pytest.fixture(scope="module")
def against_ddp(spawned):
    return [rank["against ddp"] for rank in spawned]


@pytest.fixture(scope="module")
def best_at_end(spawned):
    return [rank["best at end"] for rank in spawned]


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_logs_the_plain_trainers_losses(against_ddp):
    for rank in against_ddp:
        plain, zk = rank["plain"], rank["zkernel"]
        assert [e["step"] for e in zk] == [e["step"] for e in plain] == list(range(1, scenarios.STEPS + 1))
        for p, z in zip(plain, zk):
            assert _close(z["loss"], p["loss"], 1e-4), (p, z)
            assert _close(z["grad_norm"], p["grad_norm"], 1e-4), (p, z)
            assert z["learning_rate"] == pytest.approx(p["learning_rate"], rel=1e-12, abs=0.0)
        assert max(e["grad_norm"] for e in plain) > scenarios.CLIP  # clipping changed the steps
        assert zk[-1]["loss"] < zk[0]["loss"] - 0.1  # it learned
        flos = rank["total_flos"]
        assert flos["zkernel"] == flos["plain"] > 0  # counted with zero3's released parameters whole
        assert rank["engine"] == {"partitioner": "zero3", "offload": "cpu", "optimizer": "cpu_adam",
                                  "no_weight_decay": rank["trainer_no_decay"]}
        assert rank["trainer_no_decay"]  # the norms' weights: the groups are part of what is compared


def test_resumed_run_logs_the_same_later_steps(against_ddp):
    for rank in against_ddp:
        assert "zkernel" in rank["checkpoint_files"] and "trainer_state.json" in rank["checkpoint_files"]
        assert "scheduler.pt" in rank["checkpoint_files"]
        resumed, full = rank["resumed"][LATER], rank["zkernel"][LATER]
        assert [e["step"] for e in resumed] == [e["step"] for e in full]
        for r, f in zip(resumed, full):
            assert _close(r["loss"], f["loss"], 1e-6), (r, f)
            assert r["learning_rate"] == f["learning_rate"]


def test_saved_model_loads_and_equals_the_plain_trainers(against_ddp):
    plain, zk = against_ddp[0]["plain_weights"], against_ddp[0]["zkernel_weights"]
    assert zk.pop("tied") and plain.pop("tied")
    assert zk.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(zk[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_evaluation_and_prediction_under_zero3_and_from_meta(against_ddp):
    for rank in against_ddp:
        evals = rank["eval_loss"]
        assert _close(evals["zkernel"], evals["plain"], 1e-4), evals
        assert _close(evals["from_meta"], evals["plain"], 1e-5), evals
        assert rank["predicted_logits_diff"] <= 1e-4 * rank["predicted_logits_scale"]  # predict() under zero3


@pytest.mark.parametrize("run", list(scenarios.BEST_RUNS))
def test_the_best_checkpoint_is_loaded_at_the_end(best_at_end, run):
    limit = scenarios.BEST_RUNS[run][1]
    for rank in best_at_end:
        got = rank[run]
        evals = got["evals"]
        assert sorted(evals) == list(range(1, scenarios.STEPS + 1))
        assert max(evals.values()) == evals[1] > evals[scenarios.STEPS]  # the first checkpoint is the best
        assert got["best"] == "checkpoint-1"
        assert got["equals_best"]  # the engine's consolidated weights are checkpoint-1's, bit for bit
        assert got["equals_initial"] is False  # ... which one step moved
        assert got["eval_after"] == evals[1]  # evaluate() runs them
        if limit == 1:  # the Trainer's rotation kept the best alone
            assert got["checkpoints"] == ["checkpoint-1"]
        else:  # ... the best and the last
            assert got["checkpoints"] == ["checkpoint-1", f"checkpoint-{scenarios.STEPS}"]
            assert got["equals_last"] is False
    assert best_at_end[0][run]["saved_equals_best"]  # save_model() wrote them


def test_the_logged_parameter_count_is_the_whole_models(best_at_end):
    for rank in best_at_end:
        true_count = rank["true_count"]
        for run in scenarios.BEST_RUNS:
            got = rank[run]
            assert got["count_logged"] == [f"  Number of trainable parameters = {true_count:,}"], run
            assert got["count_engine"] == true_count and got["count_restored"], run
        assert rank["zero3_offload"]["numel_held"] < true_count  # zero3 released what the count still counts


# -- in one process -----------------------------------------------------------------------------------


def test_contradicting_values_are_an_error_before_training(tmp_path):
    args = scenarios.arguments(str(tmp_path))
    deepspeed = {
        **scenarios.DEEPSPEED_ZERO3_OFFLOAD,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": "auto"}},
    }
    with pytest.raises(ConfigError) as error:
        ZKernelTrainer(model=scenarios.tiny_llama(), args=args, zkernel_config=deepspeed)
    message = str(error.value)
    assert "gradient_accumulation_steps=4 vs TrainingArguments gradient_accumulation_steps=2" in message
    assert "optimizer.params.lr=0.01 vs TrainingArguments learning_rate=0.003" in message
    with pytest.raises(ConfigError, match=r"precision='bf16' vs TrainingArguments bf16\|fp16='fp32'"):
        ZKernelTrainer(model=scenarios.tiny_llama(), args=args, zkernel_config={"precision": "bf16"})
    with pytest.raises(ConfigError, match="unknown config key 'partitoner'"):
        ZKernelTrainer(model=scenarios.tiny_llama(), args=args, zkernel_config={"partitoner": "zero3"})


def test_an_optimizer_zkernel_cannot_step_is_an_error_before_training(tmp_path):
    trainer = ZKernelTrainer(model=scenarios.tiny_llama(), args=scenarios.arguments(str(tmp_path), optim="sgd"),
                             train_dataset=scenarios.dataset(), zkernel_config={"partitioner": "zero2"})
    with pytest.raises(ConfigError, match=r"torch.optim.sgd.SGD.*Adam/AdamW.*adamw_torch"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_auto_values_take_the_arguments(tmp_path):
    model = scenarios.tiny_llama()
    args = scenarios.arguments(str(tmp_path), warmup_steps=3, adam_beta2=0.95)
    rest = [p for n, p in model.named_parameters() if n != "model.norm.weight"]  # as the Trainer builds it
    adamw = torch.optim.AdamW([{"params": [model.model.norm.weight], "weight_decay": 0.0},
                               {"params": rest, "weight_decay": scenarios.WD}], lr=scenarios.LR, betas=(0.9, 0.95))
    deepspeed = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    config = resolve(deepspeed, args, model=model, world_size=1, num_training_steps=20, trainer_optimizer=adamw)
    assert config.optimizer.lr == scenarios.LR and config.optimizer.betas == (0.9, 0.95)
    assert config.optimizer.weight_decay == scenarios.WD and config.optimizer.no_weight_decay == ("model.norm.weight",)
    assert config.gradient_accumulation_steps == 2 and config.gradient_clipping == scenarios.CLIP
    assert config.partitioner_options["persistence_threshold"] == 10 * 32  # 10 x hidden_size, as the Trainer fills
    schedule = config.lr_schedule.options
    assert (schedule["total_num_steps"], schedule["warmup_num_steps"], schedule["warmup_max_lr"]) == (20, 3, scenarios.LR)
    with pytest.raises(ConfigError, match=r"total_num_steps.*known only in train\(\)"):
        resolve(deepspeed, args, model=model, world_size=1, num_training_steps=None, trainer_optimizer=adamw)


def test_a_short_last_window_steps_as_the_trainer_does(tmp_path):
    """6 micro-batches per epoch with 4 per window: the Trainer steps after 4, then after 2."""
    from transformers import Trainer

    data = scenarios.dataset()[:12]
    losses, steps = {}, {}
    for name in ("plain", "zkernel"):
        args = scenarios.arguments(str(tmp_path / name), gradient_accumulation_steps=4, max_steps=-1,
                                   num_train_epochs=2, save_strategy="no")
        kwargs = {"zkernel_config": {"partitioner": "zero3"}} if name == "zkernel" else {}
        trainer = (ZKernelTrainer if name == "zkernel" else Trainer)(
            model=scenarios.tiny_llama(), args=args, train_dataset=data, **kwargs)
        trainer.train()
        losses[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        steps[name] = trainer.state.global_step
    if scenarios.TRANSFORMERS_5:  # 4.x counts an epoch's windows differently (no short one here)
        assert steps["plain"] == 4
    assert steps["zkernel"] == steps["plain"]
    assert losses["zkernel"] == pytest.approx(losses["plain"], rel=1e-4)


def test_zero1_zero2_and_parameter_offload_train_as_the_plain_trainer(tmp_path):
    """One process (each partitioner's own collectives degenerate): the same losses through every partitioner
    and offload placement as the plain Trainer's; the zero3 one built on the meta device, the initial
    weights loaded into it from a save_pretrained directory."""
    from transformers import Trainer

    data = scenarios.dataset()
    scenarios.tiny_llama().save_pretrained(tmp_path / "initial")

    def losses(trainer) -> list[float]:
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    def args(name: str):
        return scenarios.arguments(str(tmp_path / name), max_steps=2, save_strategy="no")

    plain = losses(Trainer(model=scenarios.tiny_llama(), args=args("plain"), train_dataset=data))
    for config in (
        {"partitioner": "zero1"},
        {"partitioner": "zero2", "offload": {"optimizer": "cpu"}},
        {"partitioner": "zero3", "offload": {"optimizer": "cpu", "params": "cpu"}},
    ):
        name = config["partitioner"]
        if name == "zero3" and scenarios.TRANSFORMERS_5:  # 4.x's _init_weights leaves rotary buffers unset
            with torch.device("meta"):
                model = scenarios.tiny_llama()
            extra = {"zkernel_pretrained": str(tmp_path / "initial")}
        else:
            model, extra = scenarios.tiny_llama(), {}
        zk = losses(ZKernelTrainer(model=model, args=args(name), train_dataset=data, zkernel_config=config, **extra))
        assert zk == pytest.approx(plain, rel=1e-4), config


def test_a_config_schedule_sets_the_rate_and_resumes(tmp_path):
    """A DeepSpeed scheduler section: the engine's schedule sets each step's rate (filled from the arguments),
    the Trainer logs the rate each step used, and a resumed run continues the schedule."""
    import attrs

    deepspeed = {"zero_optimization": {"stage": 2},
                 "scheduler": {"type": "WarmupDecayLR", "params": {
                     "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                     "total_num_steps": "auto", "warmup_type": "linear"}}}
    data = scenarios.dataset()
    runs = []
    for resume in (None, str(tmp_path / f"checkpoint-{scenarios.SAVE_AT}")):
        trainer = ZKernelTrainer(model=scenarios.tiny_llama(), args=scenarios.arguments(str(tmp_path), warmup_steps=2),
                                 train_dataset=data, zkernel_config=deepspeed)
        trainer.train(resume_from_checkpoint=resume)
        runs.append([(e["learning_rate"], e["loss"]) for e in trainer.state.log_history if "loss" in e])
    engine = trainer.engine
    options = engine.config.lr_schedule.options
    assert (options["total_num_steps"], options["warmup_num_steps"]) == (scenarios.STEPS, 2)
    base = attrs.evolve(engine.pipeline.hyper, lr=engine.config.optimizer.lr)
    expected = [engine.lr_schedule.hyper(step, base).lr for step in range(scenarios.STEPS)]
    assert [rate for rate, _ in runs[0]] == pytest.approx(expected, rel=1e-12)
    assert max(expected) == pytest.approx(scenarios.LR)
    assert runs[1] == runs[0]


def test_a_best_checkpoint_that_cannot_be_loaded_is_an_error(tmp_path):
    """checkpoint-1 is the best but its engine checkpoint is gone by the end: train() raises, naming it,
    and the engine keeps the last step's weights whole (nothing partly loaded)."""
    import shutil

    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from zkernel.checkpoint import CheckpointError

    class RemoveFirstEngineCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                shutil.rmtree(tmp_path / "checkpoint-1" / "zkernel")

    data = scenarios.dataset()
    args = scenarios.arguments(str(tmp_path), max_steps=2, eval_strategy="steps", eval_steps=1, save_steps=1,
                               load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    trainer = ZKernelTrainer(model=scenarios.tiny_llama(), args=args, train_dataset=data, eval_dataset=data[:4],
                             zkernel_config={"partitioner": "zero2"}, callbacks=[RemoveFirstEngineCheckpoint()])
    with pytest.raises(CheckpointError, match=r"load_best_model_at_end: .*checkpoint-1/zkernel holds no engine"):
        trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    last = load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    state = trainer.engine.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in last.items())


def test_best_model_at_end_with_save_only_model_is_an_error(tmp_path):
    args = scenarios.arguments(str(tmp_path), eval_strategy="steps", eval_steps=1, save_steps=1,
                               load_best_model_at_end=True, save_only_model=True)
    with pytest.raises(ConfigError, match=r"save_only_model=True.*checkpoint-N/zkernel/.*valid: save_only_model=False"):
        ZKernelTrainer(model=scenarios.tiny_llama(), args=args, eval_dataset=scenarios.dataset()[:4],
                       zkernel_config={"partitioner": "zero2"})


def test_a_process_that_sees_several_gpus_drives_one(tmp_path):
    """One process on a machine with two GPUs (no launcher): the plain Trainer would count both (DataParallel,
    twice the batch, the loss scaled by two); ZKernelTrainer drives one device, as under DeepSpeed."""
    from transformers import Trainer

    data = scenarios.dataset()[:8]
    losses = {}
    for name in ("plain", "zkernel"):
        args = scenarios.arguments(str(tmp_path / name), max_steps=2, save_strategy="no")
        if name == "zkernel":
            assert args.n_gpu == 0  # (sets the devices up on this CPU machine) ...
            args._n_gpu = 2  # ... as they are set up where two GPUs are visible
        kwargs = {"zkernel_config": {"partitioner": "zero3"}} if name == "zkernel" else {}
        trainer = (ZKernelTrainer if name == "zkernel" else Trainer)(
            model=scenarios.tiny_llama(), args=args, train_dataset=data, **kwargs)
        trainer.train()
        losses[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses["zkernel"] == pytest.approx(losses["plain"], rel=1e-4)
    assert args.n_gpu == 1 and args.train_batch_size == args.per_device_train_batch_size
