"""Every byte of a checkpoint is checked: the manifest and ``latest`` carry checksums ([Note: sealed JSON]),
and the leftovers of a save killed while committing are settled by the next save ([Note: leftover replaced
checkpoints])."""

from __future__ import annotations

from tests.support.paths import REPO
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches
from tests.support.checkpoint_scenarios import run_steps
from zkernel.checkpoint.format import INCOMPLETE, LATEST, LATEST_CHECKSUM, MANIFEST, REPLACED
from zkernel.checkpoint.reader import committed_tags, resolve
from zkernel.checkpoint.sealed import read_manifest

REPO = REPO
DIGITS = b"0123456789"
BASE64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
CONFIG = {"partitioner": "zero2", "optimizer": {"lr": 2e-2}, "partitioner_options": {"bucket_size": 300}}


def flip_after(raw: bytes, anchors: list[bytes], allowed: bytes, skip: int = 0) -> bytes:
    """``raw`` with one bit flipped: in the first byte after each of ``anchors`` in turn (and ``skip`` more
    bytes) that is in ``allowed`` and stays in it with its lowest bit flipped, so the JSON still parses."""
    at = 0
    for anchor in anchors:
        at = raw.index(anchor, at) + len(anchor)
    at += skip
    while not (raw[at] in allowed and raw[at] ^ 1 in allowed):
        at += 1
    out = bytearray(raw)
    out[at] ^= 1
    return bytes(out)


# Where to flip one bit of a 2-rank checkpoint's manifest, and the JSON path that then differs.
FLIPS = {
    "step": ([b'"engine": {', b'"global_steps": '], DIGITS, 0, ("engine", "global_steps")),
    "micro steps": ([b'"engine": {', b'"micro_steps": '], DIGITS, 0, ("engine", "micro_steps")),
    "lr": ([b'"engine": {', b'"lr": '], DIGITS, 3, ("engine", "lr")),
    "adam step": ([b'"params": {', b'"scalars": {', b'"step": [', b'",'], DIGITS, 0, ("params",)),
    "rng state": ([b'"ranks": [', b'"rng": {', b'"rng": {', b'"torch": "'], BASE64, 40, ("ranks",)),
}


def _differs_at(before, after, path) -> bool:
    for key in path:
        if before[key] == after[key]:
            return False
        before, after = before[key], after[key]
    return True


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    run_ranks(2, _job, [("train_and_save", ("tricky", CONFIG, str(root / "good"), 2, 1, 1, 1, 5))])
    return root / "good"


def _job(tasks):
    from tests.support.checkpoint_scenarios import job

    return job(tasks)


def test_a_bit_flipped_in_the_manifest_is_refused_by_load_on_every_rank_and_by_consolidate(two_rank_checkpoint):
    good = two_rank_checkpoint
    (tag,) = committed_tags(good)
    raw = (good / tag / MANIFEST).read_bytes()
    manifest = json.loads(raw)
    copies = {}
    for name, (anchors, allowed, skip, path) in FLIPS.items():
        flipped = flip_after(raw, anchors, allowed, skip)
        # Still a manifest that parses, and differs where intended: only the checksum can tell.
        assert _differs_at(manifest, json.loads(flipped), path), name
        copy = good.parent / name.replace(" ", "-")
        shutil.copytree(good, copy)
        (copy / tag / MANIFEST).write_bytes(flipped)
        copies[name] = copy
    results = run_ranks(2, _job, [("failed_load", (CONFIG, str(copy))) for copy in copies.values()])
    for rank, errors in enumerate(results):
        for (name, copy), error in zip(copies.items(), errors):
            named = str(copy / tag / MANIFEST)
            assert named in error and "damaged" in error, (name, rank, error)
            assert "The engine was not changed" in error, (name, rank, error)
    for name, copy in copies.items():
        with pytest.raises(zkernel.CheckpointError, match="damaged") as info:
            zkernel.consolidate(copy)
        assert str(copy / tag / MANIFEST) in str(info.value), name
    assert set(zkernel.consolidate(good)) == set(TrickyNet().state_dict())  # the intact one still consolidates


def _saved(directory: Path, tags=("step4", "step5")) -> zkernel.Engine:
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), {"partitioner": "zero2", "optimizer": {"lr": 1e-2}})
    for tag, step in zip(tags, batches(3, len(tags), 1, 1, 4)):
        run_steps(engine, [step], 1)
        engine.save_checkpoint(directory, tag=tag)
    return engine


def test_every_single_bit_flip_in_the_manifest_and_latest_is_refused_naming_the_file(tmp_path):
    engine = _saved(tmp_path)
    engine.close()
    checked = 0
    for path in (tmp_path / "step5" / MANIFEST, tmp_path / LATEST, tmp_path / LATEST_CHECKSUM):
        raw = path.read_bytes()
        # Every byte of the small files and of the manifest's first 300 (its checksum line, format,
        # version), then every 13th: a CRC catches any change of 32 bits or fewer, wherever it is.
        for at in (*range(min(300, len(raw))), *range(300, len(raw), 13)):
            for bit in (0x01, 0x20, 0x80):  # a digit's, a letter's case, not UTF-8 any more
                damaged = bytearray(raw)
                damaged[at] ^= bit
                path.write_bytes(damaged)
                with pytest.raises(zkernel.CheckpointError) as info:
                    if path.name == MANIFEST:
                        read_manifest(path.parent)
                    else:
                        resolve(tmp_path, None)
                assert str(path) in str(info.value), (path.name, at, bit, str(info.value))
                checked += 1
        path.write_bytes(raw)
    assert checked > 3 * 1000
    assert resolve(tmp_path, None) == tmp_path / "step5"
    assert read_manifest(tmp_path / "step5")["tag"] == "step5"


def test_a_damaged_latest_is_refused_naming_it(tmp_path):
    good = tmp_path / "good"
    engine = _saved(good)
    assert (good / LATEST).read_text().strip() == "step5"

    def damaged(name: str, damage) -> Path:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        damage(copy)
        return copy

    cases = {
        # The bytes of something else: not text at all (a wrapped UnicodeDecodeError before).
        "garbage": (lambda d: (d / LATEST).write_bytes(b"\xff\xfe\x00\x9c garbage \x80"), LATEST, "are not text"),
        "not a tag": (lambda d: (d / LATEST).write_bytes(b"step5\x0e"), LATEST, "not a checkpoint tag"),
        # One bit: step5 -> step4, a checkpoint that exists (it loaded silently before).
        "other tag": (lambda d: (d / LATEST).write_bytes(flip_after(b"step5\n", [b"step"], DIGITS)), LATEST,
                      "records \\['step5'\\]"),
        "whitespace": (lambda d: (d / LATEST).write_bytes(b"step5\x0b"), LATEST, "damaged or was edited"),
        "its checksum": (lambda d: (d / LATEST_CHECKSUM).write_bytes(
            flip_after((d / LATEST_CHECKSUM).read_bytes(), [b'"latest": ['], b"step45")), LATEST_CHECKSUM, "damaged"),
    }  # fmt: skip
    for name, (damage, file, message) in cases.items():
        copy = damaged(name.replace(" ", "-"), damage)
        with pytest.raises(zkernel.CheckpointError, match=message) as info:
            engine.load_checkpoint(copy)
        assert str(copy / file) in str(info.value), (name, str(info.value))
        assert "committed checkpoints" in str(info.value) or "pass the tag" in str(info.value), name
        with pytest.raises(zkernel.CheckpointError, match=message):
            zkernel.consolidate(copy)
        assert engine.load_checkpoint(copy, tag="step4").tag == "step4"  # a tag given: latest is not read
        engine.save_checkpoint(copy, tag="step6")  # a save replaces a damaged latest
        assert engine.load_checkpoint(copy).tag == "step6", name
    assert engine.load_checkpoint(good).tag == "step5"
    engine.close()


def test_checkpoints_written_before_the_checksums_still_load_with_a_warning(tmp_path, restore_zkernel_logger):
    engine = _saved(tmp_path, tags=("old",))
    manifest = tmp_path / "old" / MANIFEST
    raw = manifest.read_bytes()
    first = raw.index(b"\n", 2) + 1  # the checksum line
    unsealed = b"{\n" + raw[first:]
    manifest.write_bytes(unsealed.replace(b'"version": 2,', b'"version": 1,', 1))  # what version 1 wrote
    (tmp_path / LATEST_CHECKSUM).unlink()
    with capture_logs() as logs:
        assert engine.load_checkpoint(tmp_path).tag == "old"
        assert set(zkernel.consolidate(tmp_path)) == set(TrickyNet().state_dict())
    events = {e["event"] for e in logs}
    assert {"zkernel.checkpoint.manifest_unverified", "zkernel.checkpoint.latest_unverified"} <= events
    manifest.write_bytes(unsealed)  # version 2 without its checksum line: damaged, not old
    with pytest.raises(zkernel.CheckpointError, match="checksum, is missing or garbled") as info:
        engine.load_checkpoint(tmp_path)
    assert str(manifest) in str(info.value)
    engine.close()


# -- a save killed while committing over an existing tag -------------------------------------------------

_KILL_BETWEEN_RENAMES = """
import os, signal, sys, torch, zkernel
from tests.support.models import TrickyNet, batches
from tests.support.checkpoint_scenarios import run_steps
import zkernel.checkpoint.save as save

directory, renames = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
engine = zkernel.initialize(TrickyNet(), {"partitioner": "zero2", "optimizer": {"lr": 1e-2}})
data = batches(3, 2, 1, 1, 4)
run_steps(engine, data[:1], 1)
engine.save_checkpoint(directory, tag="a")
run_steps(engine, data[1:], 1)
real, done = os.rename, []

def rename(src, dst):  # the commit's renames of whole checkpoint directories, not a rank file's
    real(src, dst)
    if os.path.dirname(os.fspath(dst)) == directory:
        done.append(dst)
        if len(done) == renames:
            os.kill(os.getpid(), signal.SIGKILL)

save.os.rename = rename
engine.save_checkpoint(directory, tag="a")
"""


@pytest.mark.parametrize("renames", [1, 2], ids=["between-the-renames", "after-both-renames"])
def test_a_replaced_checkpoint_left_by_a_killed_save_is_settled_by_the_next_save(tmp_path, renames):
    directory = tmp_path / "ckpt"
    child = subprocess.run(
        [sys.executable, "-c", _KILL_BETWEEN_RENAMES, str(directory), str(renames)],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr.decode()
    replaced = directory / f"a{REPLACED}"
    assert replaced.is_dir()
    assert (directory / "a").is_dir() == (renames == 2)
    assert committed_tags(directory) == ["a"]  # the .replaced copy counts while "a" is gone
    first = zkernel.consolidate(directory, tag="a")

    engine = _saved(tmp_path / "other", tags=())
    assert engine.load_checkpoint(directory).tag == "a"
    engine.save_checkpoint(directory, tag="b")
    assert sorted(p.name for p in directory.iterdir()) == ["a", "b", LATEST, LATEST_CHECKSUM]
    after = zkernel.consolidate(directory, tag="a")
    assert after.keys() == first.keys() and all(torch.equal(after[k], first[k]) for k in first)
    engine.close()


def test_a_replaced_checkpoint_is_kept_while_the_one_replacing_it_is_not_complete(tmp_path, restore_zkernel_logger):
    engine = _saved(tmp_path, tags=("a",))
    shutil.copytree(tmp_path / "a", tmp_path / f"a{REPLACED}")
    rank_file = tmp_path / "a" / "rank00000.safetensors"
    os.truncate(rank_file, rank_file.stat().st_size - 1)  # "a" is damaged: its .replaced is the good copy
    with capture_logs() as logs:
        engine.save_checkpoint(tmp_path, tag="b")
    assert (tmp_path / f"a{REPLACED}").is_dir()
    assert any(e["event"] == "zkernel.checkpoint.leftover_kept" for e in logs)
    assert not (tmp_path / f"a{INCOMPLETE}").exists()
    engine.close()
