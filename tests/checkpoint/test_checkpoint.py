"""Checkpoints: resume loss for loss in new processes, re-sharding, consolidation, faults, the zero3 trap."""

from __future__ import annotations

from tests.support.paths import REPO
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zkernel
from tests.support.checkpoint_scenarios import resume, run_steps
from zkernel.spec import hookimpl
from zkernel.spec.groups import OptimizerDeclaration, StateSpec
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses
from zkernel.checkpoint.format import INCOMPLETE, LATEST, LATEST_CHECKSUM, MANIFEST

STEPS, SAVE_AT, ACCUM, MICRO, SEED = 6, 3, 2, 3, 77
LR, WD, CLIP = 2e-2, 0.1, 0.5
REPO = REPO


def config(stage: str, tier: str = "none", params: str = "none", **extra) -> dict:
    """``nvme`` tiers get their ``nvme_path`` from `placed` (the fixture's directory)."""
    cfg = {
        "partitioner": stage,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"name": "cpu_adam" if tier == "cpu" else "adamw", "lr": LR, "weight_decay": WD},
        "offload": {"optimizer": tier, "params": params},
        "partitioner_options": {"persistence_threshold": 0} if stage == "zero3" else {"bucket_size": 300},
    }
    cfg.update(extra)
    return cfg


def placed(cfg: dict, root: Path) -> dict:
    """``cfg`` with its nvme tiers' swap files under ``root/nvme`` (one directory for every run)."""
    if "nvme" not in (cfg["offload"]["optimizer"], cfg["offload"]["params"]):
        return cfg
    (root / "nvme").mkdir(exist_ok=True)
    return {**cfg, "offload": {**cfg["offload"], "nvme_path": str(root / "nvme")}}


# Resumed exactly: same world size and config, dropout on (RNG states must come back).
EXACT = {
    "zero1": config("zero1"),
    "zero2": config("zero2"),
    "zero3": config("zero3"),
    "zero1-cpu": config("zero1", "cpu"),
    "zero2-cpu": config("zero2", "cpu"),
    "zero3-cpu": config("zero3", "cpu"),
    "zero3-bf16": config("zero3", precision="bf16"),
    "zero2-fp16": config("zero2", precision="fp16", initial_loss_scale=1024.0, loss_scale_window=2),
    "zero2-nvme": config("zero2", "nvme"),
    "zero3-nvme-both": config("zero3", "nvme", "nvme", optimizer={"name": "cpu_adam", "lr": LR, "weight_decay": WD}),
    "zero3-cpu-params-nvme": config("zero3", "cpu", "nvme"),
    "zero3-nvme-spill": config("zero3", "nvme", "cpu"),
}
EXACT["zero3-nvme-spill"]["offload"]["optimizer_options"] = {"host_share": 0.5}  # half in host memory, half on disk
# Saved on 2 ranks without dropout, resumed elsewhere and compared with plain torch.
SOURCES = {"zero2": config("zero2"), "zero3": config("zero3"), "zero1": config("zero1"), "zero2-cpu": config("zero2", "cpu")}
# Every Linear tiled (the frozen one too): block.0 (37 x 13) in 2 row tiles, block.2 (13 x 37) in 2 column tiles.
TILED = ["block.0", "block.2", "frozen_proj"]
SOURCES["zero3-tiled"] = config("zero3", tiling={"modules": TILED, "tiles": 2})
# Loaded across tilings ([Note: loading across compositions]): tiles into the untiled layers, untiled
# layers into tiles cut along the inputs (a tile's rows are runs apart), 2 tiles into 3 cut the other way.
ACROSS_TILINGS = {
    "zero3 tiled 2 -> zero2 untiled": ("src-zero3-tiled", config("zero2")),
    "zero2 untiled -> zero3 tiled 3 (inputs)": ("src-zero2", config("zero3", tiling={"modules": TILED, "tiles": 3, "split": "input"})),
    "zero3 tiled 2 -> zero3 + cpu tiled 3 (outputs)": (
        "src-zero3-tiled", config("zero3", "cpu", "cpu", tiling={"modules": TILED, "tiles": 3, "split": "output"})
    ),
}


def reference(steps: int = STEPS) -> tuple[list[float], TrickyNet]:
    torch.manual_seed(SEED)
    model = TrickyNet()
    data = batches(SEED + 1, steps, ACCUM, 2, MICRO)  # the global batch: 6 sequences per micro-batch
    return reference_losses(model, data, LR, WD, CLIP), model


def assert_close(losses, expected, rel, label):
    assert len(losses) == len(expected), label
    for i, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= rel * abs(b), f"{label}: step {i}: {a!r} vs {b!r}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 2-rank job: every source run, saved at step SAVE_AT, plus the zero3 released-read checks."""
    root = tmp_path_factory.mktemp("ckpt")
    tasks = [("train_and_save", ("drop", placed(cfg, root), str(root / f"exact-{name}"), STEPS, SAVE_AT, ACCUM,
                                 MICRO, SEED)) for name, cfg in EXACT.items()]  # fmt: skip
    tasks += [("train_and_save", ("tricky", cfg, str(root / f"src-{name}"), STEPS, SAVE_AT, ACCUM, MICRO, SEED))
              for name, cfg in SOURCES.items()]  # fmt: skip
    tasks.append(("released_reads", (config("zero3"), SAVE_AT, ACCUM, MICRO, SEED)))
    results = run_ranks(2, _job, tasks)
    return root, results


def _job(tasks):
    from tests.support.checkpoint_scenarios import job

    return job(tasks)


@pytest.fixture(scope="module")
def resumed(saved):
    """A second 2-rank job in new processes: exact resumes and 2 -> 2 re-sharding."""
    root, _ = saved
    tasks = [("resume", ("drop", placed(cfg, root), str(root / f"exact-{name}"), STEPS, SAVE_AT, ACCUM, MICRO, SEED))
             for name, cfg in EXACT.items()]  # fmt: skip
    blocks = config("zero3", partitioner_options={"persistence_threshold": 200, "units": "blocks"})
    tasks += [
        ("resume", ("tricky", blocks, str(root / "src-zero2"), STEPS, SAVE_AT, ACCUM, MICRO, SEED)),
        ("resume", ("tricky", config("zero1", partitioner_options={"bucket_size": 50}), str(root / "src-zero3"),
                    STEPS, SAVE_AT, ACCUM, MICRO, SEED)),  # fmt: skip
        ("resume", ("tricky", config("zero1", "cpu"), str(root / "src-zero1"), STEPS, SAVE_AT, ACCUM, MICRO, SEED)),
        ("resume", ("tricky", placed(config("zero3", "nvme", "nvme"), root), str(root / "src-zero2-cpu"), STEPS, SAVE_AT,
                    ACCUM, MICRO, SEED)),  # fmt: skip
    ]
    tasks += [("resume", ("tricky", cfg, str(root / source), STEPS, SAVE_AT, ACCUM, MICRO, SEED))
              for source, cfg in ACROSS_TILINGS.values()]  # fmt: skip
    damaged = root / "damaged"  # a flipped byte in rank 1's file: only rank 1 reads it
    shutil.copytree(root / "src-zero2", damaged)
    rank1 = damaged / f"step{SAVE_AT}" / "rank00001.safetensors"
    offset = json.loads((rank1.parent / MANIFEST).read_text())["files"][rank1.name]["data_offset"]
    raw = bytearray(rank1.read_bytes())
    raw[offset + 64] ^= 1
    rank1.write_bytes(bytes(raw))
    tasks.append(("failed_load", (config("zero2"), str(damaged))))
    tasks.append(("save_to_per_rank_directories", (config("zero3"), str(root / "per-rank"))))
    return run_ranks(2, _job, tasks)


def test_resume_in_new_processes_continues_loss_for_loss(saved, resumed):
    _, before = saved
    for rank in range(2):
        for i, name in enumerate(EXACT):
            uninterrupted = before[rank][i]["losses"]
            after = resumed[rank][i]
            assert after["tag"] == f"step{SAVE_AT}"
            assert after["counters"] == (SAVE_AT, SAVE_AT * ACCUM)
            assert_close(after["losses"], uninterrupted[SAVE_AT:], 1e-6, f"{name} rank {rank}")


def test_reshard_across_partitioners_and_tiers_matches_torch(saved, resumed):
    _, before = saved
    expected, _ = reference()
    n = len(EXACT)
    for rank in range(2):
        for i, name in enumerate(SOURCES):
            assert_close(before[rank][n + i]["losses"], expected, 1e-5, f"source {name}")
        for i, label in enumerate(("zero2 -> zero3 (blocks, threshold 200)", "zero3 -> zero1 (bucket 50)",
                                   "zero1 -> zero1 + cpu offload", "zero2 + cpu -> zero3 + nvme (both roles)")):  # fmt: skip
            assert_close(resumed[rank][n + i]["losses"], expected[SAVE_AT:], 1e-5, label)


def test_checkpoints_load_across_tilings(saved, resumed):
    """A tiled model's checkpoint resumes untiled or tiled another way, and the other way round, as torch."""
    expected, _ = reference()
    n = len(EXACT) + 4
    for rank in range(2):
        for i, label in enumerate(ACROSS_TILINGS):
            assert_close(resumed[rank][n + i]["losses"], expected[SAVE_AT:], 1e-5, label)


def test_a_damaged_file_on_one_rank_fails_the_load_on_every_rank(saved, resumed):
    root, _ = saved
    for rank in range(2):
        message = resumed[rank][-2]
        assert "rank 1: checksum mismatch in checkpoint file" in message, message
        assert str(root / "damaged" / f"step{SAVE_AT}" / "rank00001.safetensors") in message


def test_ranks_saving_to_different_directories_fail_together_and_leave_nothing(saved, resumed):
    """Rank 1 cannot see the directory rank 0 created: both raise, naming the cause, and no file is left."""
    root, _ = saved
    for rank in range(2):
        message = resumed[rank][-1]
        assert "rank 1:" in message and "every rank must pass the same directory" in message, message
    assert [str(p.relative_to(root / "per-rank")) for p in (root / "per-rank").rglob("*")] == ["mine0"]


def test_reshard_to_three_ranks(saved):
    root, _ = saved
    tasks = [
        ("resume", ("tricky", config("zero2", partitioner_options={"bucket_size": 120}), str(root / "src-zero2"),
                    STEPS, SAVE_AT, ACCUM, 2, SEED)),  # fmt: skip
        ("resume", ("tricky", config("zero3", "cpu"), str(root / "src-zero3"), STEPS, SAVE_AT, ACCUM, 2, SEED)),
    ]
    results = run_ranks(3, _job, tasks)
    expected, _ = reference()
    for rank_results in results:
        assert_close(rank_results[0]["losses"], expected[SAVE_AT:], 1e-5, "zero2 2 ranks -> zero2 3 ranks")
        assert_close(rank_results[1]["losses"], expected[SAVE_AT:], 1e-5, "zero3 2 ranks -> zero3 + cpu 3 ranks")


def test_reshard_to_one_rank(saved):
    root, _ = saved
    expected, _ = reference()
    one = resume("tricky", config("zero1"), str(root / "src-zero3"), STEPS, SAVE_AT, ACCUM, 2 * MICRO, SEED)
    assert_close(one["losses"], expected[SAVE_AT:], 1e-5, "zero3 2 ranks -> zero1 1 rank")
    none = resume("tricky", config("none", "cpu"), str(root / "src-zero2"), STEPS, SAVE_AT, ACCUM, 2 * MICRO, SEED)
    assert_close(none["losses"], expected[SAVE_AT:], 1e-5, "zero2 2 ranks -> none + cpu 1 rank")
    blocks = config("zero3", partitioner_options={"units": "blocks", "persistence_threshold": 100})
    back = resume("tricky", blocks, str(root / "src-zero2-cpu"), STEPS, SAVE_AT, ACCUM, 2 * MICRO, SEED)
    assert_close(back["losses"], expected[SAVE_AT:], 1e-5, "zero2 + cpu 2 ranks -> zero3 (no offload) 1 rank")
    tiled = config("none", tiling={"modules": TILED, "tiles": 4})
    four = resume("tricky", tiled, str(root / "src-zero3-tiled"), STEPS, SAVE_AT, ACCUM, 2 * MICRO, SEED)
    assert_close(four["losses"], expected[SAVE_AT:], 1e-5, "zero3 tiled 2, 2 ranks -> none tiled 4, 1 rank")


def _cuts(shape: tuple[int, ...], rows: list[int], cols: list[int], prefix: str) -> list:
    from zkernel.params.param_map import Piece

    return [Piece(f"{prefix}{i}.{j}", (slice(r0, r1), slice(c0, c1)))
            for i, (r0, r1) in enumerate(zip(rows, rows[1:])) for j, (c0, c1) in enumerate(zip(cols, cols[1:]))]  # fmt: skip


def test_element_ranges_translate_between_any_two_cuttings():
    """[Note: loading across compositions]: every element range of a piece cut one way, read from pieces
    cut another way (or whole), is the user tensor's elements; contiguous reads stay one range."""
    from zkernel.checkpoint.recompose import _merged, _Region, _translate
    from zkernel.params.param_map import Piece

    shape = (7, 11, 3)
    user = torch.arange(7 * 11 * 3).reshape(shape)
    cuttings = {
        "whole": [Piece("w", ())],
        "rows": _cuts(shape, [0, 3, 7], [0, 11], "r"),
        "cols": _cuts(shape, [0, 7], [0, 4, 5, 11], "c"),
        "grid": _cuts(shape, [0, 2, 7], [0, 6, 11], "g"),
        "lead": [Piece("l0", (slice(0, 1),)), Piece("l1", (slice(1, 7),))],
    }
    g = torch.Generator().manual_seed(0)
    for source_name, source in cuttings.items():
        stored = [_Region(shape, p) for p in source]
        values = {p.name: user[p.index].flatten() for p in source}
        for target_name, target in cuttings.items():
            for piece in target:
                mine = _Region(shape, piece)
                want = user[piece.index].flatten()
                for start, end in [(0, mine.numel), *(sorted(torch.randint(0, mine.numel + 1, (2,), generator=g).tolist()) for _ in range(5))]:
                    got = torch.full((end - start,), -1)
                    ranges = list(_merged(_translate(mine, stored, start, end)))
                    for name, at, offset, length in ranges:
                        got[offset : offset + length] = values[name][at : at + length]
                    assert torch.equal(got, want[start:end]), (source_name, target_name, piece, start, end)
                    if source_name == "whole" and target_name in ("whole", "rows", "lead") and end > start:
                        assert len(ranges) == 1, (target_name, piece, ranges)


def test_consolidate_equals_torch_and_loads_strictly(saved, tmp_path, restore_zkernel_logger):
    root, _ = saved
    _, model = reference(SAVE_AT)
    for source in ("src-zero3", "src-zero2"):
        full = zkernel.consolidate(root / source)
        plain = TrickyNet()
        plain.load_state_dict(full, strict=True)
        assert list(full) == list(model.state_dict())
        for key, value in model.state_dict().items():
            assert full[key].dtype == torch.float32 and full[key].shape == value.shape, key
            assert torch.allclose(full[key], value, rtol=1e-4, atol=1e-6), f"{source}: {key}"
    out = tmp_path / "model.safetensors"
    from zkernel.cli.commands import main

    assert main(["consolidate", str(root / "src-zero3"), str(out)]) == 0
    from_file = load_file(out)
    assert list(from_file) == list(full) or set(from_file) == set(full)
    for key, value in zkernel.consolidate(root / "src-zero3").items():
        assert torch.equal(from_file[key], value), key


def test_zero3_released_parameters_raise_and_state_dict_is_full(saved):
    _, results = saved
    _, model = reference(SAVE_AT)
    plain = model.state_dict()
    for rank in range(2):
        r = results[rank][-1]
        for what, message in r["errors"].items():
            assert message is not None, f"{what} on a released parameter did not raise"
            assert "engine.gathered_parameters()" in message and "engine.state_dict()" in message, message
            if what in ("norm", "data"):
                assert "'block.0.weight'" in message, message
        assert list(r["state_dict"]) == list(plain)
        for key, value in plain.items():
            got = r["state_dict"][key]
            assert got.shape == value.shape and got.dtype == value.dtype, key
            assert torch.allclose(got, value, rtol=1e-4, atol=1e-6), key
        TrickyNet().load_state_dict(r["state_dict"], strict=True)
        assert r["closed_norm"] > 0


# -- faults (one process) ------------------------------------------------------------------------


def _small_checkpoint(directory: Path, tags=("a",), stage="zero2") -> zkernel.Engine:
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), {"partitioner": stage, "optimizer": {"lr": 1e-2}})
    data = batches(3, len(tags), 1, 1, 4)
    for tag, step in zip(tags, data):
        run_steps(engine, [step], 1)
        engine.save_checkpoint(directory, tag=tag)
    return engine


def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path):
    good = tmp_path / "good"
    engine = _small_checkpoint(good)
    rank_file = good / "a" / "rank00000.safetensors"
    manifest = json.loads((good / "a" / MANIFEST).read_text())
    data_offset = manifest["files"]["rank00000.safetensors"]["data_offset"]

    def damaged(name: str, damage) -> Path:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        damage(copy / "a")
        return copy

    def flip(offset):
        def apply(tag_dir):
            raw = bytearray((tag_dir / rank_file.name).read_bytes())
            raw[offset] ^= 0x10
            (tag_dir / rank_file.name).write_bytes(bytes(raw))

        return apply

    cases = {
        "data byte": (flip(data_offset + 100), "checksum mismatch in checkpoint file"),
        "header byte": (flip(20), "checksum mismatch in the header of checkpoint file"),
        "truncated manifest": (lambda d: (d / MANIFEST).write_bytes((d / MANIFEST).read_bytes()[:200]), "truncated"),
        "unknown version": (lambda d: (d / MANIFEST).write_text(
            json.dumps({**json.loads((d / MANIFEST).read_text()), "version": 99})), "format version 99"),  # fmt: skip
        "missing file": (lambda d: (d / rank_file.name).unlink(), "is missing"),
        "truncated file": (lambda d: os.truncate(d / rank_file.name, data_offset + 10), "truncated or replaced"),
    }
    for name, (damage, message) in cases.items():
        copy = damaged(name.replace(" ", "-"), damage)
        named = str(copy / "a" / (MANIFEST if "manifest" in name or "version" in name else rank_file.name))
        with pytest.raises(zkernel.CheckpointError, match=message) as info:
            engine.load_checkpoint(copy)
        assert named in str(info.value), (name, str(info.value))
        with pytest.raises(zkernel.CheckpointError, match=message):
            zkernel.consolidate(copy)
    assert engine.load_checkpoint(good).tag == "a"  # the intact one still loads
    with pytest.raises(zkernel.CheckpointError, match="no checkpoint 'zz'.*committed checkpoints there: \\['a'\\]"):
        engine.load_checkpoint(good, tag="zz")
    mid = zkernel.initialize(TrickyNet(), {"gradient_accumulation_steps": 2})
    tokens, targets = batches(3, 1, 1, 1, 4)[0][0][0]
    mid.backward(mid(tokens, targets))
    mid.step()
    with pytest.raises(zkernel.CheckpointError, match="accumulation boundary"):
        mid.load_checkpoint(good)  # a save there is taken ([Note: a save inside an accumulation window])
    engine.close()
    mid.close()


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    directory, pause = tmp_path / "ckpt", tmp_path / "pause"
    env = {**os.environ, "ZKERNEL_TEST_PAUSE_FILE": str(pause), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.checkpoint_scenarios", "save_then_stall", str(directory)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not Path(str(pause) + ".reached").exists():
        assert child.poll() is None, child.stderr.read().decode()
        assert time.monotonic() < deadline, "the child never reached the middle of its save"
        time.sleep(0.05)
    partial = list((directory / f"doomed{INCOMPLETE}").iterdir())
    assert partial, "the stalled save has started writing its rank file"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (directory / LATEST).read_text().strip() == "good"
    engine = zkernel.initialize(TrickyNet(), {"partitioner": "zero3", "optimizer": {"lr": 1e-2}})
    assert engine.load_checkpoint(directory).tag == "good"
    with pytest.raises(zkernel.CheckpointError, match="a save of it did not complete"):
        engine.load_checkpoint(directory, tag="doomed")
    engine.save_checkpoint(directory, tag="after")  # removes the leftover
    assert sorted(p.name for p in directory.iterdir()) == ["after", "good", LATEST, LATEST_CHECKSUM]
    engine.close()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0  # fmt: skip


def test_full_disk_fails_cleanly(tmp_path):
    disk = tmp_path / "disk"
    if _mount_tmpfs(disk, "1m"):
        try:
            engine = _small_checkpoint(disk / "ckpt", tags=("good",))
            free = shutil.disk_usage(disk).free
            with open(disk / "filler", "wb") as f:  # leave less room than a checkpoint needs
                os.posix_fallocate(f.fileno(), 0, max(0, free - 8192))
            with pytest.raises(zkernel.CheckpointError, match="No space left on device") as info:
                engine.save_checkpoint(disk / "ckpt", tag="big")
            assert str(disk / "ckpt" / f"big{INCOMPLETE}" / "rank00000.safetensors") in str(info.value)
            (disk / "filler").unlink()
            engine.close()
            _check_intact(disk / "ckpt")
        finally:
            subprocess.run(["umount", str(disk)], check=False)
    else:  # no tmpfs: cap the file size of a child process instead
        result = subprocess.run(
            [sys.executable, "-m", "tests.support.checkpoint_scenarios", "save_under_file_size_limit", str(disk / "ckpt"),
             "8192"], cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert "File too large" in result.stdout and "rank00000.safetensors" in result.stdout, result.stdout + result.stderr
        _check_intact(disk / "ckpt")


def _check_intact(directory: Path) -> None:
    left = sorted(p.name for p in directory.iterdir())
    assert left == ["good", LATEST, LATEST_CHECKSUM], "no temporary files are left"
    assert zkernel.consolidate(directory)  # verifies every checksum
    engine = zkernel.initialize(TrickyNet(), {"partitioner": "zero1"})
    assert engine.load_checkpoint(directory).tag == "good"
    engine.close()


# -- a third-party optimizer, tied weights, integer buffers ------------------------------------


class MomentumSGD:
    """A third-party optimizer with declared state of its own: a per-element momentum and an int64 count."""

    def __init__(self, context) -> None:
        self.lr = context.config.optimizer.lr

    @hookimpl
    def zkernel_declare_optimizer(self, numel):
        return OptimizerDeclaration(
            state=(StateSpec("momentum", torch.float32, (numel,)), StateSpec("count", torch.int64, ()))
        )

    @hookimpl
    def zkernel_step_optimizer(self, group, options):
        state = group.optim_state
        state["count"].add_(1)
        state["momentum"].mul_(0.9).add_(group.grad.to(group.master.device), alpha=options.grad_scale)
        group.master.add_(state["momentum"], alpha=-self.lr / float(state["count"]) ** 0.5)
        if group.copy_out is not None:
            group.copy_out.copy_(group.master)
        return True


class MomentumPlugin:
    @hookimpl
    def zkernel_register_optimizers(self, registry):
        registry.add("momentum_sgd", MomentumSGD, description="SGD with momentum and a step count (test)")


class TiedBatchNorm(torch.nn.Module):
    """Tied weights under two state-dict keys, and BatchNorm's buffers (one of them int64)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(29, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 29, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        return torch.nn.functional.cross_entropy(self.head(self.bn(self.embed(tokens).mean(1))), targets[:, 0])


def test_third_party_optimizer_state_tied_weights_and_buffers_round_trip(tmp_path):
    plugins = [MomentumPlugin()]
    base = {"optimizer": {"name": "momentum_sgd", "lr": 0.1}}
    data = batches(9, 4, 1, 1, 8)
    torch.manual_seed(3)
    engine = zkernel.initialize(TiedBatchNorm(), {**base, "partitioner": "zero2"}, plugins=plugins)
    before = run_steps(engine, data[:2], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    uninterrupted = run_steps(engine, data[2:], 1)
    engine.close()
    torch.manual_seed(4)
    zero3 = {**base, "partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}}
    resumed = zkernel.initialize(TiedBatchNorm(), zero3, plugins=plugins)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert all(int(g.optim_state["count"]) == 2 for g in resumed.trainable_groups)
    assert_close(run_steps(resumed, data[2:], 1), uninterrupted, 1e-6, "momentum_sgd zero2 -> zero3")
    assert before[-1] != uninterrupted[0]
    full = zkernel.consolidate(tmp_path / "ckpt")
    plain = TiedBatchNorm()
    assert list(full) == list(plain.state_dict())  # embed.weight and head.weight, bn's three buffers
    plain.load_state_dict(full, strict=True)
    assert full["bn.num_batches_tracked"].dtype == torch.int64 and int(full["bn.num_batches_tracked"]) == 2
    assert torch.equal(full["head.weight"], full["embed.weight"])
    state = resumed.state_dict()
    assert list(state) == list(plain.state_dict()) and int(state["bn.num_batches_tracked"]) == 4
    resumed.close()
    adam = zkernel.initialize(TiedBatchNorm(), {"partitioner": "zero1"})
    with pytest.raises(zkernel.CheckpointError, match=r"keeps state \['exp_avg', 'exp_avg_sq', 'step'\].*momentum_sgd"):
        adam.load_checkpoint(tmp_path / "ckpt")
    # DeepSpeed's load_optimizer_states=False: the weights and counters, under the selected optimizer's fresh state.
    adam.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False)
    assert adam.global_steps == 2 and all(int(g.optim_state["step"].max()) == 0 for g in adam.trainable_groups)
    assert all(torch.equal(v, full[k]) for k, v in adam.state_dict().items())
    adam.close()
