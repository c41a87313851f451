"""Engine lifecycle: close() gives the model back whole, ownership, dropped engines, clean exit."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import zkernel
from tests.harness import gpus_hidden_if_short, run_ranks
from tests.lifecycle_scenarios import close_and_reuse, reference_two_phases
from tests.models import VOCAB, TrickyNet

LR = 1e-2


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
