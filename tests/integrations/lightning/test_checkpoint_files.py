"""Single-file Lightning checkpoints and ZKernelStrategy, under the real Trainer on 2 gloo ranks.

A checkpoint directory the strategy saved, converted by `convert_checkpoint` into one ordinary
Lightning file, loads with ``load_from_checkpoint`` in this process (no process group, no engine)
with the engine's weights bit for bit, and resumes under ``strategy="ddp"``; a file plain DDP saved
loads into ZKernelStrategy and trains on as DDP resumed with fresh optimizer moments does.
One run of `tests.integrations.lightning.scenario` ("convert", "file") serves the module.
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations.lightning.test_strategy import TOLERANCE, _close, _scenario

pytest.importorskip("pytorch_lightning")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("lightning_files") / "run"


@pytest.fixture(scope="module")
def runs(out) -> list[dict]:
    return _scenario(out, str(out), "convert", "file")


def test_converted_file_loads_the_engine_weights_without_zkernel(runs, out):
    from tests.integrations.lightning.scenario import TinyGPT

    converted = f"{out}.converted.ckpt"
    checkpoint = torch.load(converted, weights_only=True)  # plain torch: no zkernel class in the file
    assert checkpoint["epoch"] == 1 and checkpoint["global_step"] == 4  # after one epoch of 4 optimizer steps
    assert checkpoint["lr_schedulers"] and checkpoint["loops"]["fit_loop"]
    optimizer = checkpoint["optimizer_states"][0]
    assert optimizer["state"] == {} and [g["weight_decay"] for g in optimizer["param_groups"]] == [0.1, 0.0]
    module = TinyGPT.load_from_checkpoint(converted)
    assert module.hparams.tag == "converted"
    engine = torch.load(f"{out}.engine.pt", weights_only=True)  # the engine's state_dict() after epoch 1
    weights = module.state_dict()
    assert weights.keys() == engine.keys() == checkpoint["state_dict"].keys()
    for key, value in engine.items():
        assert value.dtype == weights[key].dtype == torch.float32, key
        assert torch.equal(weights[key], value), key


def test_ddp_and_zkernel_resume_alike_from_the_converted_file(runs):
    for rank in runs:
        convert = rank["convert"]
        ddp, zk = convert["ddp_resumed"], convert["zkernel_resumed"]
        assert ddp["global_step"] == zk["global_step"] == 8 and len(ddp["losses"]) == 8
        assert _close(zk["losses"], ddp["losses"]) < TOLERANCE
        assert _close(zk["val_losses"], ddp["val_losses"]) < TOLERANCE
        assert zk["lr"] == pytest.approx(ddp["lr"])  # the scheduler resumed, on both
        # The resumed run starts from epoch 1's end: its first validation beats epoch 1's.
        assert sum(ddp["val_losses"]) < sum(convert["val_losses"]) - 0.1


def test_a_ddp_file_resumes_under_zkernel_with_fresh_moments(runs):
    for rank in runs:
        file = rank["file"]
        fresh, zk = file["ddp_fresh"], file["zkernel_resumed"]
        assert fresh["global_step"] == zk["global_step"] == 8 and len(zk["losses"]) == 8
        assert _close(zk["losses"], fresh["losses"]) < TOLERANCE
        assert _close(zk["val_losses"], fresh["val_losses"]) < TOLERANCE
        assert zk["lr"] == pytest.approx(fresh["lr"])
        # test(ckpt_path=file) under ZKernelStrategy sees DDP's epoch-1 weights.
        assert _close(file["test_losses"], file["val_losses"]) < TOLERANCE


def test_bad_ckpt_paths_are_clear_errors_on_every_rank(runs):
    for rank in runs:
        file = rank["file"]
        assert file["missing"].startswith("FileNotFoundError") and "does not exist" in file["missing"]
        assert "a Lightning checkpoint file" in file["missing"]
        assert file["garbage"].startswith("CheckpointError") and "could not be read" in file["garbage"]


def test_convert_refuses_what_is_no_lightning_checkpoint_directory(runs, out, tmp_path):
    from zkernel.checkpoint.format import CheckpointError
    from zkernel.integrations.lightning import convert_checkpoint

    target = tmp_path / "model.ckpt"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_checkpoint(tmp_path / "nowhere", target)
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        convert_checkpoint(f"{out}.converted.ckpt", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint directory written by trainer.save_checkpoint"):
        convert_checkpoint(tmp_path / "empty", target)
    with pytest.raises(CheckpointError, match="without Lightning's state"):
        convert_checkpoint(f"{out}.bare", target)  # engine.save_checkpoint with no client state
    with pytest.raises(IsADirectoryError, match="give a file name"):
        convert_checkpoint(f"{out}.ckpt", tmp_path)
    assert not target.exists() and not list(tmp_path.glob(".*partial"))


def test_the_command_line_writes_the_same_file(runs, out, tmp_path):
    from zkernel.integrations.lightning.convert import main

    written = main([f"{out}.ckpt", str(tmp_path / "cli.ckpt")])
    again, first = torch.load(written, weights_only=True), torch.load(f"{out}.converted.ckpt", weights_only=True)
    assert again.keys() == first.keys()
    assert all(torch.equal(again["state_dict"][k], v) for k, v in first["state_dict"].items())
    assert again["loops"] == first["loops"] and again["hyper_parameters"] == first["hyper_parameters"]


@pytest.mark.cuda
def test_on_two_gpus_files_load_and_convert(tmp_path):
    # Trainer(accelerator="gpu", devices=2): NCCL ranks; the file's weights reach the engine from rank 0.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from tests.integrations.lightning.scenario import TinyGPT

    out = tmp_path / "run"  # Lightning's launcher starts rank 1 (no fork of a process that may have touched CUDA)
    for rank in _scenario(out, "--launch", str(out), "convert", "file", accelerator="gpu"):
        convert, file = rank["convert"], rank["file"]
        assert _close(convert["zkernel_resumed"]["losses"], convert["ddp_resumed"]["losses"]) < TOLERANCE
        assert _close(file["zkernel_resumed"]["losses"], file["ddp_fresh"]["losses"]) < TOLERANCE
    module = TinyGPT.load_from_checkpoint(f"{out}.converted.ckpt", map_location="cpu")
    engine = torch.load(f"{out}.engine.pt", weights_only=True)
    assert all(torch.equal(module.state_dict()[key], value) for key, value in engine.items())
