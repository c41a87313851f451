"""Where DeepSpeed's checkpoints allow what zkernel's once refused: a save inside an accumulation window
(the last applied step is saved: [Note: a save inside an accumulation window] in `zkernel.checkpoint.save`)
and a load from a directory with no checkpoint (a WARNING and None), on 2 gloo ranks against plain torch."""

from __future__ import annotations

import pytest
import torch

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses

STEPS, SAVE_AT, ACCUM, MICRO, SEED = 4, 2, 2, 3, 21
LR, WD, CLIP = 2e-2, 0.1, 0.5
CONFIGS = {
    "zero2": {"partitioner": "zero2", "partitioner_options": {"bucket_size": 300}},
    "zero3": {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}},
}


def _config(base: dict) -> dict:
    return {
        **base,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"name": "adamw", "lr": LR, "weight_decay": WD},
    }


def _job(tasks):
    from tests.support.checkpoint_scenarios import job

    return job(tasks)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("rules")
    tasks = []
    for name, base in CONFIGS.items():
        (root / name).mkdir()
        tasks.append(("save_mid_window", (_config(base), str(root / name / "ckpt"), STEPS, SAVE_AT, ACCUM, MICRO, SEED)))
    return run_ranks(2, _job, tasks)


def _reference() -> list[float]:
    torch.manual_seed(SEED)
    return reference_losses(TrickyNet(), batches(SEED + 1, STEPS, ACCUM, 2, MICRO), LR, WD, CLIP)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=list(CONFIGS))
def test_a_save_inside_a_window_keeps_the_last_step_and_resumes_at_the_windows_start(results, index):
    expected = _reference()
    for rank, per_rank in enumerate(results):
        r = per_rank[index]
        # The save disturbed nothing: the run went on as torch's.
        for i, (a, b) in enumerate(zip(r["losses"], expected, strict=True)):
            assert abs(a - b) <= 1e-4 * abs(b), (rank, i, a, b)
        assert r["warnings"] == [("zkernel.checkpoint.mid_window", 1, SAVE_AT)], rank
        assert r["tag"] == f"step{SAVE_AT}"
        assert r["counters"] == (SAVE_AT, SAVE_AT * ACCUM), "the last applied step's counters"
        assert r["saved_counters"] == (STEPS, STEPS * ACCUM)
        # Resumed at the window's first micro-batch, it trains loss for loss as the uninterrupted run.
        for i, (a, b) in enumerate(zip(r["resumed"], r["losses"][SAVE_AT:], strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, SAVE_AT + i, a, b)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=list(CONFIGS))
def test_a_directory_with_no_checkpoint_warns_and_loads_nothing_on_every_rank(results, index):
    for rank, per_rank in enumerate(results):
        r = per_rank[index]
        assert r["nothing"] == [None, None], rank
        assert r["nothing_warnings"] == [("zkernel.checkpoint.none_to_load", "warning")] * 2, rank
        assert r["unchanged"] and r["counters_after_nothing"] == (0, 0)


def test_a_save_between_a_backward_and_its_step_is_refused_and_a_named_tag_or_damage_still_raises(tmp_path):
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), {"gradient_accumulation_steps": 2})
    tokens, targets = batches(3, 1, 1, 1, 4)[0][0][0]
    engine.backward(engine(tokens, targets))
    with pytest.raises(zkernel.CheckpointError, match="between a backward and its engine.step()"):
        engine.save_checkpoint(tmp_path / "ckpt")
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt", tag="a")  # inside the window: taken
    engine.backward(engine(tokens, targets))
    engine.step()
    with pytest.raises(zkernel.CheckpointError, match="no checkpoint 'zz'"):
        engine.load_checkpoint(tmp_path / "empty", tag="zz")  # a tag asked for by name must be there
    (tmp_path / "ckpt" / "latest").write_text("not a tag!")
    with pytest.raises(zkernel.CheckpointError, match="damaged"):
        engine.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(zkernel.CheckpointError, match="no 'latest' file"):
        zkernel.consolidate(tmp_path / "empty")  # no engine to leave as it is: nothing to return
    engine.close()
