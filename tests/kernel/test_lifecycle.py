"""Engine lifecycle: close() gives the model back whole, ownership, dropped engines, clean exit."""

from __future__ import annotations

from tests.support.paths import REPO, python_path
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import zkernel
from tests.support.harness import gpus_hidden_if_short, run_ranks
from tests.support.lifecycle_scenarios import (
    FailingDeclaration,
    FailingSchedule,
    close_and_reuse,
    failed_initialize,
    model_state,
    reference_two_phases,
    same_state,
)
from tests.support.models import VOCAB, TrickyNet

LR = 1e-2
ROOT = REPO


def _cfg(stage: str, tier: str = "none", precision: str = "fp32") -> dict:
    cfg = {"partitioner": stage, "precision": precision, "optimizer": {"name": "adamw", "lr": LR}}
    if stage == "zero3":
        cfg["partitioner_options"] = {"persistence_threshold": 0}
    if tier != "none":
        cfg["offload"] = {"optimizer": tier}
    return cfg


CASES = [
    ("zero3", "none", "zero2", "none"),
    ("zero3", "cpu", "zero1", "none"),
    ("zero2", "cpu", "zero3", "cpu"),
    ("none", "none", "zero3", "none"),
]


@pytest.mark.parametrize(("first", "tier1", "second", "tier2"), CASES)
def test_close_gives_the_model_back_whole_and_a_new_engine_continues(first, tier1, second, tier2):
    r = close_and_reuse(_cfg(first, tier1), _cfg(second, tier2))
    # Whole, current values in storage of their own, in the dtype they had, no hooks left.
    for name, value in r["after"].items():
        assert value.numel() > 0, f"{name} is empty after close"
        torch.testing.assert_close(value.float(), r["gathered"][name], rtol=0, atol=0, msg=name)
    assert r["after_dtypes"] == r["dtypes"]
    assert r["hooks"] == 0 and r["grad_hooks"] == 0
    assert r["plain_grads"]
    # A fresh AdamW (new engine, new optimizer state) continues exactly as plain torch would.
    expected = reference_two_phases(3, LR)
    for i, (a, b) in enumerate(zip(r["losses"], expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: {a} vs {b}"


def test_close_under_bf16_restores_fp32_masters():
    r = close_and_reuse(_cfg("zero3", "cpu", "bf16"), _cfg("zero2", "none"))
    assert set(r["after_dtypes"].values()) == {"torch.float32"}
    assert all(r["after"][n].numel() > 0 for n in r["after"])


def test_close_on_two_ranks():
    results = run_ranks(2, close_and_reuse, _cfg("zero3", "cpu"), _cfg("zero2", "none"))
    for r in results:
        for name, value in r["after"].items():
            torch.testing.assert_close(value.float(), r["gathered"][name], rtol=0, atol=0, msg=name)
    for name in results[0]["after"]:  # every rank got the same whole values back
        assert torch.equal(results[0]["after"][name], results[1]["after"][name]), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the model fits the GPU's free memory: close puts it there")
def test_close_releases_a_model_that_fits_nowhere_and_says_so(monkeypatch, caplog):
    """A model whose whole parameters fit neither the device nor host memory: close releases them (meta)
    with a WARNING naming the way to keep them, instead of failing half-way (here the CPU is the compute
    device and ZKERNEL_HOST_MEMORY says there is next to no memory)."""
    import logging

    torch.manual_seed(0)
    model = TrickyNet()
    engine = zkernel.initialize(model, _cfg("zero3"))
    tokens = torch.randint(0, VOCAB, (2, 6))
    engine.backward(engine(tokens, tokens))
    engine.step()
    monkeypatch.setenv("ZKERNEL_HOST_MEMORY", "1KiB")
    with caplog.at_level(logging.WARNING, logger="zkernel"):
        engine.close()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert any("zkernel.engine.params_released" in r.getMessage() and "save_checkpoint" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    monkeypatch.delenv("ZKERNEL_HOST_MEMORY")
    engine = zkernel.initialize(TrickyNet(), _cfg("zero3"))  # the released module's engine is gone
    engine.close()


def test_a_module_held_by_a_live_engine_is_refused():
    model = TrickyNet()
    engine = zkernel.initialize(model, _cfg("zero3"))
    with pytest.raises(RuntimeError, match=r"held by a live zkernel engine.*engine.close\(\)"):
        zkernel.initialize(model, _cfg("zero2"))
    with pytest.raises(RuntimeError, match=r"\(Sequential\) is held by a live zkernel engine"):
        zkernel.initialize(model.block, _cfg("none"))
    engine.close()
    zkernel.initialize(model, _cfg("zero2")).close()


def test_a_module_whose_engine_was_dropped_is_refused_with_the_reason():
    model = TrickyNet()
    engine = zkernel.initialize(model, _cfg("zero3"))
    engine.backward(engine(torch.randint(0, 29, (2, 6)), torch.randint(0, 29, (2, 6))))
    engine.step()
    del engine
    gc.collect()
    assert model.block[0].weight.numel() == 0  # released by zero3: the values are gone with the engine
    with pytest.raises(RuntimeError, match=r"dropped without engine.close\(\)"):
        zkernel.initialize(model, _cfg("zero2"))


def test_a_closed_engine_refuses_work_and_closing_twice_is_harmless():
    engine = zkernel.initialize(TrickyNet(), _cfg("zero2", "cpu"))
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine(torch.randint(0, 29, (2, 6)), torch.randint(0, 29, (2, 6)))


def test_a_failed_initialize_gives_the_model_back_bitwise_and_it_trains_after(tmp_path):
    """zero3 with both roles on NVMe fails after partitioning (a plugin raising while groups are placed, a
    schedule raising in the engine's constructor, after every module was hooked): each time the model is
    exactly as it was (values bitwise, classes, hooks), and a valid initialize then trains it as torch does."""
    out = failed_initialize(str(tmp_path))
    for name in ("declaration", "schedule"):
        assert out[name]["error"] is not None and "injected" in out[name]["error"], out[name]
        assert out[name]["diffs"] == [], (name, out[name]["diffs"])
    torch.testing.assert_close(out["losses"], out["reference"], rtol=1e-5, atol=1e-6)
    assert out["runs_left"] == []


def test_a_failed_initialize_leaves_a_meta_device_model_on_meta():
    """zero3 had materialised (and released) the first units when placing a later group failed."""
    with torch.device("meta"):
        model = TrickyNet()
    before = model_state(model)
    cfg = {**_cfg("zero3"), "optimizer": {"name": "adamw_failing", "lr": LR}}
    with pytest.raises(RuntimeError, match="injected"):
        zkernel.initialize(model, cfg, plugins=[FailingDeclaration(3)])
    assert same_state(before, model_state(model)) == []
    assert all(p.is_meta for p in model.parameters())

    def init(module: torch.nn.Module) -> None:
        if isinstance(module, TrickyNet):
            module.gain.data.fill_(0.75)
            module.shift.copy_(torch.linspace(-0.1, 0.1, module.shift.numel()))
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    engine = zkernel.initialize(model, _cfg("zero3"), init_fn=init)  # materialised now
    engine.backward(engine(torch.randint(0, VOCAB, (2, 6)), torch.randint(0, VOCAB, (2, 6))))
    engine.step()
    engine.close()
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("stage", ["none", "zero1", "zero2", "zero3"])
def test_a_failed_initialize_undoes_transforms_and_casts_under_every_partitioner(stage):
    """bf16 with a tiled layer and a checkpointed block: the failure comes after the transforms, the casts
    and (for the schedule) the hooks; the model is given back as it was each time and trains after."""
    torch.manual_seed(0)
    model = TrickyNet()
    before = model_state(model)
    base = {**_cfg(stage, precision="bf16"), "tiling": {"modules": ["block.0"], "tiles": 2},
            "activation_checkpointing": {"modules": ["block"]}}
    attempts = [
        ({**base, "optimizer": {"name": "adamw_failing", "lr": LR}}, FailingDeclaration(2)),
        ({**base, "lr_schedule": {"name": "exploding"}}, FailingSchedule()),
    ]
    for cfg, plugin in attempts:
        with pytest.raises(RuntimeError, match="injected"):
            zkernel.initialize(model, cfg, plugins=[plugin])
        assert same_state(before, model_state(model)) == []
    engine = zkernel.initialize(model, base)
    engine.backward(engine(torch.randint(0, VOCAB, (2, 6)), torch.randint(0, VOCAB, (2, 6))))
    engine.step()
    engine.close()


def test_a_disk_too_small_fails_initialize_without_harm(tmp_path):
    """A real 64 KiB disk (tmpfs in a private mount namespace) runs out while zero3 pre-allocates its swap files,
    after the first units were partitioned: the model is given back bitwise and trains on a real disk after."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to mount a small file system in a private namespace")
    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    big.mkdir()
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {small} && "
        f"exec {sys.executable} -m tests.support.lifecycle_scenarios failed_initialize {big} {small}"
    )
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([unshare, "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount tmpfs in a user namespace here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert "No space left on device" in out["disk"]["error"], out["disk"]
    for name in ("disk", "declaration", "schedule"):
        assert out[name]["diffs"] == [], (name, out[name]["diffs"])
    torch.testing.assert_close(out["losses"], out["reference"], rtol=1e-5, atol=1e-6)
    assert out["runs_left"] == []


def test_the_capacity_check_runs_before_anything_moves(tmp_path, monkeypatch):
    """A shortfall is found from the model's shapes before zero3 materialises (or moves) a single unit."""
    from zkernel.kernel import bootstrap
    from zkernel.spec.tiers import Capacity

    full = Capacity(device_bytes=None, host_bytes=None, disk_bytes=1000)
    monkeypatch.setattr(bootstrap.Capacity, "measure", classmethod(lambda cls, device, path: full))
    with torch.device("meta"):
        model = TrickyNet()
    initialised = []
    cfg = _cfg("zero3")
    cfg["offload"] = {"optimizer": "nvme", "params": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(zkernel.ConfigError, match="do not fit"):
        zkernel.initialize(model, cfg, init_fn=initialised.append)
    assert initialised == []  # no unit was materialised
    assert all(p.is_meta and type(p) is torch.nn.Parameter for p in model.parameters())
    assert not list(tmp_path.iterdir())


EXIT_SCRIPT = textwrap.dedent(
    """
    import torch, zkernel
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine = zkernel.initialize(model, {"partitioner": "zero3", "offload": {"optimizer": "cpu"},
                                        "optimizer": {"name": "cpu_adam"}})
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    # no engine.close(), no destroy_process_group(): zkernel cleans up at exit
    """
)


def _torchrun(script: str, port: int) -> subprocess.CompletedProcess:
    env = gpus_hidden_if_short(2, {**os.environ, "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.parametrize("jobs", [2, pytest.param(20, marks=pytest.mark.slow)])
def test_two_rank_jobs_that_never_destroy_the_process_group_exit_cleanly(tmp_path, jobs):
    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    import socket

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    # Each job is 3 interpreters importing torch: 2 jobs take ~15 s on a 2-core machine, 20 (`-m slow`) ~2 min.
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda _: _torchrun(str(script), port()), range(jobs)))
    failed = [(r.returncode, (r.stderr or "")[-400:]) for r in runs if r.returncode != 0]
    assert not failed, f"{len(failed)} of {jobs} jobs did not exit 0: {failed[:2]}"
    assert not any("terminate called" in r.stderr for r in runs)
