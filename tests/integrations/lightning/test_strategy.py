"""ZKernelStrategy under the real Lightning Trainer on 2 gloo ranks, against strategy="ddp".

One run of `tests.integrations.lightning.scenario` runs every configuration in the same two
processes, forked after importing Lightning (which costs most of the time), once for the module;
a slow test lets Lightning's own launcher start the second rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO, python_path

pytest.importorskip("pytorch_lightning")

MODES = ("ddp", "zero3", "named", "short", "meta", "bf16", "sgd")
TOLERANCE = 1e-4


def _scenario(out, *args: str, accelerator: str = "cpu", package: str = "pytorch_lightning") -> list[dict]:
    env = {**os.environ, "PYTHONPATH": python_path(), "ZKERNEL_SCENARIO_ACCELERATOR": accelerator,
           "ZKERNEL_SCENARIO_LIGHTNING": package}
    done = subprocess.run(
        [sys.executable, "-m", "tests.integrations.lightning.scenario", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out.parent / f"{out.name}.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("lightning") / "run"
    return _scenario(out, str(out), *MODES)


def _close(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (len(got), len(want))
    return max(abs(a - b) for a, b in zip(got, want))


def test_reference_trains(runs):
    for rank in runs:
        ddp = rank["ddp"]
        assert len(ddp["losses"]) == 16 and ddp["global_step"] == 8  # 2 epochs of 8 micro-batches, accumulating 2
        first, second = ddp["val_losses"][:2], ddp["val_losses"][2:]  # each epoch's 2 validation batches
        assert sum(second) < sum(first) - 0.2  # it learns: the comparisons below are not of a constant


def test_zero3_offload_and_resume_match_ddp(runs):
    # Epoch 1 by one Trainer, trainer.save_checkpoint, epoch 2 by a new Trainer, strategy and module
    # resumed with fit(ckpt_path=...): every micro-batch and validation loss is DDP's uninterrupted run's.
    for rank in runs:
        ddp, zero3 = rank["ddp"], rank["zero3"]
        assert zero3["strategy"] == "ZKernelStrategy" and zero3["partitioner"] == "zero3"
        assert _close(zero3["losses"], ddp["losses"]) < TOLERANCE
        assert _close(zero3["val_losses"], ddp["val_losses"]) < TOLERANCE
        assert zero3["global_step"] == ddp["global_step"] and zero3["epoch"] == ddp["epoch"]
        assert zero3["lr"] == pytest.approx(ddp["lr"])  # the restored scheduler drove the torch groups alike
        # A fresh Trainer's test(ckpt_path=...) of the epoch-1 checkpoint sees DDP's epoch-1 validation losses.
        assert _close(zero3["test_losses"], ddp["val_losses"][:2]) < TOLERANCE


def test_registered_name_matches_ddp(runs):
    for rank in runs:
        named = rank["named"]
        assert named["strategy"] == "ZKernelStrategy" and named["partitioner"] == "zero3"
        assert named["strategy_package"] == "pytorch_lightning"
        assert named["validated"] == named["val_losses"][-2:]  # trainer.validate after fit: the trained weights
        assert _close(named["losses"], rank["ddp"]["losses"]) < TOLERANCE
        assert _close(named["val_losses"], rank["ddp"]["val_losses"]) < TOLERANCE


def test_a_short_last_window_steps_like_ddp(runs):
    # 7 micro-batches an epoch with accumulate_grad_batches=2: Lightning steps the 7th alone (its loss
    # still divided by 2); zero2 steps it there too, and epoch 2's losses are DDP's.
    for rank in runs:
        short = rank["short"]
        assert short["global_step"] == 8 and len(short["losses"]) == 14
        assert _close(short["losses"], short["ddp"]) < TOLERANCE
        assert short["lr"] == pytest.approx(short["ddp_lr"])


def test_configure_model_builds_on_meta_under_zero3(runs):
    # Layers made in configure_model are built on the meta device and materialised by the engine
    # (each module's reset_parameters(), so not DDP's values): they train and validate.
    for rank in runs:
        meta = rank["meta"]
        assert meta["built_on_meta"] is True and meta["partitioner"] == "zero3"
        assert len(meta["losses"]) == 16 and meta["global_step"] == 8
        assert sum(meta["val_losses"][2:]) < sum(meta["val_losses"][:2]) - 0.05


def test_bf16_mixed_trains_in_bf16(runs):
    # Trainer(precision="bf16-mixed") reaches the engine as precision = "bf16": bf16 parameters and
    # compute, fp32 masters; the losses stay near the fp32 run's (bf16 has 8 bits of mantissa).
    for rank in runs:
        bf16, ddp = rank["bf16"], rank["ddp"]
        assert bf16["precision"] == "bf16" and bf16["partitioner"] == "zero3"
        assert _close(bf16["losses"], ddp["losses"]) < 0.05
        assert sum(bf16["val_losses"][2:]) < sum(bf16["val_losses"][:2]) - 0.2


def test_unsupported_optimizer_is_an_error_before_training(runs):
    for rank in runs:
        sgd = rank["sgd"]
        assert sgd["losses"] == []
        assert sgd["error"].startswith("ConfigError") and "optimizer SGD" in sgd["error"]
        assert "torch.optim.AdamW or torch.optim.Adam" in sgd["error"]


@pytest.mark.slow
def test_lightning_launcher_starts_the_second_rank(tmp_path):
    # As `python train.py` runs it: one process, Lightning's launcher starts rank 1 at the first fit.
    out = tmp_path / "run"
    for rank in _scenario(out, "--launch", str(out), "ddp", "named"):
        assert _close(rank["named"]["losses"], rank["ddp"]["losses"]) < TOLERANCE


@pytest.mark.slow
def test_the_unified_lightning_package(tmp_path):
    # `lightning.pytorch` (pip install lightning): its own strategy class and registry entries.
    pytest.importorskip("lightning")
    out = tmp_path / "run"
    for rank in _scenario(out, str(out), "ddp", "zero3", "named", package="lightning.pytorch"):
        for mode in ("zero3", "named"):
            assert rank[mode]["strategy_package"] == "lightning.pytorch"
            assert _close(rank[mode]["losses"], rank["ddp"]["losses"]) < TOLERANCE, mode


@pytest.mark.cuda
def test_on_two_gpus_zkernel_matches_ddp(tmp_path):
    # Trainer(accelerator="gpu", devices=2): NCCL ranks, the engine's tiers on the GPU and pinned host memory.
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "run"  # Lightning's launcher starts rank 1 (no fork of a process that may have touched CUDA)
    for rank in _scenario(out, "--launch", str(out), "ddp", "zero3", "named", "bf16", accelerator="gpu"):
        for mode in ("zero3", "named"):
            assert _close(rank[mode]["losses"], rank["ddp"]["losses"]) < TOLERANCE, mode
            assert _close(rank[mode]["val_losses"], rank["ddp"]["val_losses"]) < TOLERANCE, mode
        assert _close(rank["bf16"]["losses"], rank["ddp"]["losses"]) < 0.05
