"""Tier ``nvme`` (optimizer state and ZeRO-3 parameter shards in swap files), against single-process torch,
with its lifecycle (run directories, buffers, threads) and the faults a user hits (real files)."""

from __future__ import annotations

from tests.support.paths import REPO, python_path
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import structlog
import torch

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses
from tests.support.nvme_scenarios import RUN_GLOB, nvme_config, steps, write_failures
from tests.support.scenarios import train, train_many
from tests.plugins.partitioners.test_partitioners import ACCUM, LR, MICRO, SEED, STEPS, WD, assert_matches, config, reference
from zkernel.platform.aio import ChecksumError, live_aligned_buffers
from zkernel.spec.config import ConfigError
from zkernel.sizing.estimator import installed_tiers
from zkernel.telemetry.timeline import SpanKind

ROOT = REPO
SMALL_IO = {"aio_threads": 2}


def optimizer_on_nvme(stage: str, optimizer: str, path, **options) -> dict:
    cfg = config(stage)  # accumulation 2, clipping 0.5, several groups
    cfg["optimizer"] = {**cfg["optimizer"], "name": optimizer}
    # No GPU share: the disk path is what these tests read (on CUDA "auto" would move groups off it).
    cfg["offload"] = {"optimizer": "nvme", "nvme_path": str(path),
                      "optimizer_options": {**SMALL_IO, "gpu_share": 0.0, **options}}
    return cfg


def params_on_nvme(optimizer_tier: str, optimizer: str, path, **options) -> dict:
    cfg = config("zero3")
    cfg["optimizer"] = {**cfg["optimizer"], "name": optimizer}
    cfg["offload"] = {"optimizer": optimizer_tier, "params": "nvme", "nvme_path": str(path),
                      "params_options": {**SMALL_IO, **options}}
    if optimizer_tier == "nvme":
        cfg["offload"]["optimizer_options"] = dict(SMALL_IO)
    return cfg


STAGES = ("zero1", "zero2", "zero3")
OPTIMIZERS = ("cpu_adam", "adamw")
PARAM_COMBOS = (("none", "adamw"), ("cpu", "cpu_adam"), ("nvme", "adamw"))


def params_on_host(optimizer: str, path) -> dict:
    """zero3 with the parameter shards in host memory (tier ``cpu``) and the optimizer on NVMe."""
    cfg = optimizer_on_nvme("zero3", optimizer, path)
    cfg["offload"]["params"] = "cpu"
    return cfg


def _runs(path: Path) -> list[Path]:
    return sorted(path.glob(RUN_GLOB))


# -- numerics -----------------------------------------------------------------------------------


def test_nvme_is_an_installed_tier():
    """(`zkernel plugins` lists it: tests/cli/test_cli.py.)"""
    assert "nvme" in installed_tiers(zkernel.Config())


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_on_nvme_matches_torch(stage, tmp_path):
    """zero1/2/3 x cpu_adam/adamw, accumulation and clipping."""
    for optimizer in OPTIMIZERS:
        result = train(optimizer_on_nvme(stage, optimizer, tmp_path), STEPS, ACCUM, MICRO, SEED)
        assert_matches(result["losses"], reference(1), f"{stage} {optimizer} optimizer on nvme")
        memory = result["memory"]
        assert set(memory["master_weights"]) == {"nvme"} and set(memory["optimizer_state"]) == {"nvme"}


@pytest.mark.parametrize(("optimizer_tier", "optimizer"), PARAM_COMBOS)
def test_params_on_nvme_matches_torch(optimizer_tier, optimizer, tmp_path):
    """zero3 with parameter shards on NVMe, beside each optimizer tier."""
    result = train(params_on_nvme(optimizer_tier, optimizer, tmp_path), STEPS, ACCUM, MICRO, SEED)
    assert_matches(result["losses"], reference(1), f"params nvme, optimizer {optimizer_tier}/{optimizer}")
    assert set(result["memory"]["params"]) == {"nvme"}


def test_params_on_host_beside_the_nvme_optimizer_match_torch(tmp_path):
    result = train(params_on_host("cpu_adam", tmp_path), STEPS, ACCUM, MICRO, SEED)
    assert_matches(result["losses"], reference(1), "params cpu, optimizer nvme/cpu_adam")
    assert set(result["memory"]["params"]) == {"cpu"} and set(result["memory"]["master_weights"]) == {"nvme"}


def test_spill_over_host_memory_and_disk_matches_torch(tmp_path):
    """host_share keeps the first groups' master and state in host memory and the rest in swap files:
    loss for loss like torch, with the bytes where the shares say (a share of 1 leaves no file)."""
    for stage, optimizer in (("zero2", "adamw"), ("zero3", "cpu_adam")):
        for share in (0.5, 1.0):
            cfg = optimizer_on_nvme(stage, optimizer, tmp_path, host_share=share)
            result = train(cfg, STEPS, ACCUM, MICRO, SEED)
            assert_matches(result["losses"], reference(1), f"{stage} {optimizer} host_share {share}")
            masters = result["memory"]["master_weights"]
            if share == 1.0:
                assert set(masters) == {"cpu"}, masters
                continue
            assert set(masters) == {"cpu", "nvme"}, masters
            total = masters["cpu"] + masters["nvme"]
            assert 0.2 * total <= masters["cpu"] <= 0.5 * total, masters  # greedy: at most the share
            assert set(result["memory"]["optimizer_state"]) == {"cpu", "nvme"}
    assert not _runs(tmp_path)


def test_branches_an_eval_pass_and_a_failing_forward_with_both_roles_on_nvme(tmp_path):
    """Issue 8 on the disk tiers: the module order changes every step, an evaluation forward (no grad,
    another batch size, another branch) runs first and one forward raises: loss for loss like torch,
    and nothing stays gathered between steps."""
    from tests.support.branch_scenarios import reference_branching, train_branching

    cfg = {
        "partitioner": "zero3",
        "optimizer": {"name": "cpu_adam", "lr": 2e-2},
        "partitioner_options": {"persistence_threshold": 0},
        "prefetch_bytes": 4096,
        "offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": str(tmp_path),
                    "optimizer_options": dict(SMALL_IO), "params_options": dict(SMALL_IO, lookahead_host_bytes=8192)},
    }
    result = train_branching(cfg, 6, eval_first=True, fail_at=2)
    expected = reference_branching(6, 1, 2e-2)
    assert len(result["losses"]) == len(expected)
    for i, (a, b) in enumerate(zip(result["losses"], expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: {a} vs {b}"
    assert result["leftovers"] == [0] * 7
    assert not _runs(tmp_path)


def test_tight_pools_match_torch(tmp_path):
    """Both roles through pools far smaller than the model: the optimizer's holds one group at a time
    (its reads wait for the previous group's writes), the parameters' cannot hold the read-ahead
    (blocks are given back and read again), 1024-element extents (several requests per tensor)."""
    cfg = params_on_nvme("nvme", "cpu_adam", tmp_path, buffer_bytes=4096 * 3, lookahead_host_bytes=1 << 20)
    cfg["offload"]["optimizer_options"].update(buffer_bytes=4096 * 4, sub_group_size=1024)
    assert_matches(train(cfg, STEPS, ACCUM, MICRO, SEED)["losses"], reference(1), "tight pools")


def test_early_steps_started_during_backward_match_torch(tmp_path):
    """Without clipping each host step starts as soon as its group's last gradient landed: the tier
    is told to read ahead from autograd's thread, in landing order."""
    cfg = params_on_nvme("nvme", "cpu_adam", tmp_path)
    cfg["gradient_clipping"] = 0.0
    torch.manual_seed(SEED)
    expected = reference_losses(TrickyNet(), batches(SEED + 1, STEPS, ACCUM, 1, MICRO), LR, WD, 0.0)
    torch.manual_seed(SEED)
    engine = zkernel.initialize(TrickyNet(), cfg)
    from tests.support.scenarios import _train_steps

    assert_matches(_train_steps(engine, STEPS, ACCUM, MICRO, SEED), expected, "early steps, both roles on nvme")
    assert engine.pipeline.early_steps > 0
    engine.close()


def test_fp16_overflow_skips_the_step_and_its_prepared_reads(tmp_path):
    """An fp16 step whose gradients overflow is skipped: the groups the pipeline prepared (reads in
    flight or done) give their room back unstepped, the masters on disk stay as they were."""
    cfg = nvme_config(tmp_path, stage="zero2", precision="fp16", name="cpu_adam", buffer_bytes=4096 * 16)
    cfg["initial_loss_scale"] = 1024.0
    engine = zkernel.initialize(TrickyNet(), cfg)
    sums = []
    for i, step in enumerate(batches(11, 4, 1, 1, 2)):
        tokens, targets = step[0][0]
        loss = engine(tokens, targets)
        engine.backward(loss * float("inf") if i == 1 else loss)
        engine.step()
        engine.pipeline.wait_all()
        sums.append(sum(float(engine.optimizer_tier.read_master(g).double().sum()) for g in engine.trainable_groups))
    assert engine.skipped_steps == 1 and engine.loss_scaler.scale == 512.0
    assert sums[1] == sums[0] and sums[2] != sums[1] and sums[3] != sums[2]
    engine.close()
    assert not _runs(tmp_path)


def test_bf16_on_nvme_equals_the_cpu_tier_bit_for_bit(tmp_path):
    """Same arithmetic, other storage: bf16 losses through NVMe equal those through host memory exactly
    (the params tier lends the optimizer its update buffer for each step)."""
    for stage in ("zero2", "zero3"):
        host = optimizer_on_nvme(stage, "cpu_adam", tmp_path)
        host["offload"] = {"optimizer": "cpu"}
        disk = optimizer_on_nvme(stage, "cpu_adam", tmp_path)
        if stage == "zero3":
            host["offload"]["params"] = "cpu"
            disk["offload"].update(params="nvme", params_options=dict(SMALL_IO))
        for cfg in (host, disk):
            cfg["precision"] = "bf16"
        a, b = (train(c, STEPS, ACCUM, MICRO, SEED)["losses"] for c in (host, disk))
        assert a == b, f"{stage}: {a} vs {b}"


def test_nvme_on_two_ranks_matches_torch(tmp_path):
    """Every partitioner with the optimizer on NVMe, and zero3 with parameters on NVMe beside each
    optimizer tier, on two gloo ranks sharing one nvme_path."""
    configs = [optimizer_on_nvme(s, o, tmp_path) for s in STAGES for o in OPTIMIZERS]
    configs += [params_on_nvme(t, o, tmp_path) for t, o in PARAM_COMBOS] + [params_on_host("adamw", tmp_path)]
    spill = params_on_host("cpu_adam", tmp_path)
    spill["offload"]["optimizer_options"]["host_share"] = 0.4
    configs.append(spill)
    results = run_ranks(2, train_many, configs, STEPS, ACCUM, MICRO, SEED)
    for rank_results in results:
        for cfg, result in zip(configs, rank_results):
            label = f"{cfg['partitioner']} {cfg['optimizer']['name']} {cfg['offload']} world 2"
            assert_matches(result["losses"], reference(2), label)
    assert not _runs(tmp_path)


def test_nvme_on_three_ranks_matches_torch(tmp_path):
    configs = [optimizer_on_nvme("zero2", "cpu_adam", tmp_path), params_on_nvme("nvme", "cpu_adam", tmp_path)]
    for rank_results in run_ranks(3, train_many, configs, STEPS, ACCUM, MICRO, SEED):
        for cfg, result in zip(configs, rank_results):
            assert_matches(result["losses"], reference(3), f"{cfg['partitioner']} {cfg['offload']} world 3")


def test_timeline_records_disk_transfers_with_their_bytes(tmp_path):
    cfg = nvme_config(tmp_path, params="nvme")
    cfg["timeline"] = True
    engine = zkernel.initialize(TrickyNet(), cfg)
    steps(engine, 3)
    engine.close()
    summaries = engine.timeline.summaries
    moved = {kind: sum(s.nbytes.get(kind, 0) for s in summaries) for kind in (SpanKind.NVME_READ, SpanKind.NVME_WRITE, SpanKind.PARAM_NVME_READ)}
    assert all(n > 0 for n in moved.values()), moved
    assert moved[SpanKind.NVME_READ] <= engine.optimizer_tier.bytes_read


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_preallocation_progress_bar_on_rank_0_terminals_only(tmp_path, monkeypatch, zkernel_debug_logs):
    """Laying out the swap files shows a zkernel.telemetry.progress bar per role on a terminal, nothing where
    stderr is a file or the zkernel logger is set above WARNING; an INFO event gives the bytes."""
    monkeypatch.delenv("ZKERNEL_PROGRESS", raising=False)
    cfg = nvme_config(tmp_path, params="nvme")
    shown = {}
    for case, stream, level in (("terminal", _Terminal(), logging.INFO), ("file", io.StringIO(), logging.WARNING),
                                ("quiet", _Terminal(), logging.ERROR)):  # fmt: skip
        monkeypatch.setattr(sys, "stderr", stream)
        zkernel_debug_logs.setLevel(level)
        with structlog.testing.capture_logs() as logs:
            engine = zkernel.initialize(TrickyNet(), cfg)
            files = sum(f.stat().st_size for f in engine.optimizer_tier.run_dir.path.glob("*.swap"))
            engine.close()
        shown[case] = stream.getvalue()
        if case == "terminal":
            laid_out = [e for e in logs if e["event"] == "zkernel.nvme.preallocated"]
            assert sorted(e["what"] for e in laid_out) == ["optimizer state", "parameter"]
            assert sum(e["nbytes"] for e in laid_out) == files
    assert "laying out optimizer state swap files" in shown["terminal"]
    assert "laying out parameter swap files" in shown["terminal"]
    assert shown["file"] == "" and shown["quiet"] == ""


# -- lifecycle ---------------------------------------------------------------------------------


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_close_removes_the_run_directory_buffers_and_threads(tmp_path):
    warm = zkernel.initialize(TrickyNet(), nvme_config(tmp_path, name="cpu_adam"))  # process-wide pools start here
    steps(warm, 1)
    warm.close()
    tasks, buffers, names = len(os.listdir("/proc/self/task")), live_aligned_buffers(), _threads()
    engine = zkernel.initialize(TrickyNet(), nvme_config(tmp_path, params="nvme", name="cpu_adam", precision="bf16"))
    steps(engine, 2)
    [run] = _runs(tmp_path)
    files = sorted(run.glob("*.swap"))
    assert run.stat().st_mode & 0o777 == 0o700
    assert files and {f.stat().st_mode & 0o777 for f in files} == {0o600}
    assert {f.name.split("-")[0] for f in files} == {"optimizer", "params"}  # both roles, one directory
    assert len(os.listdir("/proc/self/task")) > tasks and live_aligned_buffers()[0] > buffers[0]
    assert {"zkernel-nvme-optimizer-io", "zkernel-nvme-params-io"} <= _threads()
    engine.close()
    assert not _runs(tmp_path)
    assert live_aligned_buffers() == buffers
    assert len(os.listdir("/proc/self/task")) == tasks and _threads() == names


def test_a_dropped_engine_removes_its_run_directory(tmp_path):
    import gc

    engine = zkernel.initialize(TrickyNet(), nvme_config(tmp_path, params="nvme"))
    steps(engine, 1)
    assert len(_runs(tmp_path)) == 1
    del engine
    gc.collect()
    assert not _runs(tmp_path)


def _script(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.support.nvme_scenarios", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def test_clean_exit_and_a_killed_run(tmp_path):
    """A run that exits without close leaves nothing; a killed run's directory is removed by the next
    start, while a live run's (another process on the same path) is left alone."""
    done = _script("clean_exit", str(tmp_path))
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err[-2000:]
    assert Path(out.strip()).name.startswith("zkernel-run-") and not _runs(tmp_path)

    killed = _script("live_run", str(tmp_path), stdin=subprocess.PIPE)
    live = _script("live_run", str(tmp_path), stdin=subprocess.PIPE)
    try:
        dead_dir = Path(killed.stdout.readline().strip())
        live_dir = Path(live.stdout.readline().strip())
        assert dead_dir.is_dir() and live_dir.is_dir(), killed.stderr.read()[-2000:]
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        assert dead_dir.is_dir()  # nobody cleaned up after it
        engine = zkernel.initialize(TrickyNet(), nvme_config(tmp_path))
        assert not dead_dir.exists() and live_dir.is_dir()
        assert set(_runs(tmp_path)) == {live_dir, engine.optimizer_tier.run_dir.path}
        engine.close()
    finally:
        live.stdin.close()
        live.wait(timeout=60)
        for proc in (killed, live):
            proc.kill() if proc.poll() is None else None
            proc.stdout.close()
            proc.stderr.close()
    assert live.returncode == 0
    assert not _runs(tmp_path)


# -- faults ------------------------------------------------------------------------------------


def test_missing_nvme_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"offload.nvme_path '.*nope' does not exist"):
        zkernel.initialize(TrickyNet(), nvme_config(missing))
    with pytest.raises(ConfigError, match=r"does not exist"):
        zkernel.initialize(TrickyNet(), nvme_config(missing, optimizer="cpu", params="nvme"))


def test_read_only_nvme_path_is_a_clear_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes to any directory: the read-only mount is tested in test_read_only_and_small_disks")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"offload.nvme_path .* is not writable"):
            zkernel.initialize(TrickyNet(), nvme_config(tmp_path))
    finally:
        tmp_path.chmod(0o700)


def test_read_only_and_small_disks(tmp_path):
    """In a private mount namespace: a read-only file system, and a 1 MiB tmpfs for a model whose
    optimizer state needs 3 MiB: each a clear error at initialize, with the numbers."""
    unshare = shutil.which("unshare")
    readonly, small = tmp_path / "ro", tmp_path / "small"
    readonly.mkdir()
    small.mkdir()
    script = (
        f"mount -t tmpfs -o ro,size=1m tmpfs {readonly} && mount -t tmpfs -o size=1m tmpfs {small} && "
        f"exec {sys.executable} -m tests.support.nvme_scenarios fenced_paths {readonly} {small}"
    )
    if unshare is None:
        pytest.skip("no unshare(1) to mount file systems in a private namespace")
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([unshare, "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    if "mount" in proc.stderr and proc.returncode != 0 and "read-only" not in proc.stdout:
        pytest.skip(f"cannot mount tmpfs in a user namespace here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert "is not writable (Read-only file system)" in lines["read-only"], lines
    assert "disk at offload.nvme_path: needs 3.01 MiB" in lines["small"] and "usable" in lines["small"], lines


def test_capacity_shortfall_names_the_numbers(tmp_path, monkeypatch):
    from zkernel.kernel import bootstrap
    from zkernel.spec.tiers import Capacity

    full = Capacity(device_bytes=None, host_bytes=None, disk_bytes=1000)
    monkeypatch.setattr(bootstrap.Capacity, "measure", classmethod(lambda cls, device, path: full))
    with pytest.raises(ConfigError, match=r"disk at offload.nvme_path: needs \d+\.\d\d KiB \(\d+\.\d\d KiB per rank\), 1000 B usable"):
        zkernel.initialize(TrickyNet(), nvme_config(tmp_path, params="nvme"))
    assert not _runs(tmp_path)  # the run directory made before the check is gone again


def test_option_errors_name_the_key(tmp_path):
    cfg = nvme_config(tmp_path)
    cfg["offload"]["optimizer_options"]["buffer_size"] = 1
    with pytest.raises(ConfigError, match=r"unknown config key offload.optimizer_options.buffer_size; valid: .*buffer_bytes"):
        zkernel.initialize(TrickyNet(), cfg)
    cfg = nvme_config(tmp_path, buffer_bytes=4096)
    cfg["partitioner_options"] = {"persistence_threshold": 10**6}  # one group bigger than the pool
    with pytest.raises(ConfigError, match=r"buffer_bytes = 4096 cannot hold group '<persistent>'.* raise buffer_bytes to at least"):
        zkernel.initialize(TrickyNet(), cfg)
    assert not _runs(tmp_path)


def _flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x01]), offset)
    finally:
        os.close(fd)


def test_altered_optimizer_swap_file_is_named_and_not_trained_on(tmp_path):
    """A pool of one group, so the altered file is read at the next step, not read (or kept) ahead
    before it was altered ([Note: read-ahead])."""
    engine = zkernel.initialize(TrickyNet(), nvme_config(tmp_path, stage="zero2", buffer_bytes=16384))
    steps(engine, 2)
    engine.pipeline.wait_all()
    engine.optimizer_tier.wait_writes()
    files = sorted(engine.optimizer_tier.run_dir.path.glob("optimizer-*.swap"))
    victim = files[-1]
    _flip(victim, 4096 + 5)  # a byte of exp_avg (the master comes first, on its own 4 KiB)
    with pytest.raises(ChecksumError) as info:
        steps(engine, 1, start=2)
    assert info.value.filename == str(victim) and str(victim) in str(info.value)
    assert "CRC32C mismatch" in str(info.value)
    engine.close()  # the master extents are intact: the model comes back
    assert not _runs(tmp_path)


def test_altered_parameter_swap_file_is_named_and_not_trained_on(tmp_path):
    engine = zkernel.initialize(TrickyNet(), nvme_config(tmp_path, optimizer="cpu", params="nvme"))
    steps(engine, 2)
    engine.pipeline.wait_all()
    engine.params_tier.wait_writes()
    victim = sorted(engine.params_tier.run_dir.path.glob("params-*.swap"))[0]
    _flip(victim, 3)
    with pytest.raises(ChecksumError) as info:
        steps(engine, 1, start=2)
    assert info.value.filename == str(victim)
    _flip(victim, 3)  # put it back: close() gathers every shard once more
    engine.close()


def test_a_disk_that_refuses_writes(tmp_path):
    """RLIMIT_FSIZE in a process of its own, for each role: pre-allocation fails at initialize with the
    numbers; a write-back that fails mid-training is an error naming the swap file, and closing the
    engine gives back exactly the model of the steps taken (nothing lost or read back half-written)."""
    for role, out in run_ranks(1, write_failures, str(tmp_path))[0].items():
        assert "cannot reserve" in out["preallocate_error"] and "File too large" in out["preallocate_error"], role
        assert out["left_after_failed_init"] == [], role
        assert out["errno"] == 27 and "File too large" in out["error"], role  # EFBIG
        assert out["filename"].startswith(str(tmp_path)) and out["filename"].endswith(".swap"), role
        assert any("kept in host memory" in note for note in out["notes"]), role
        assert out["steps"] == 3 and out["same_as_clean_steps"], role
        assert out["left_after_close"] == [], role


# -- the benchmark ----------------------------------------------------------------------------


def test_nvme_step_bench_runs_one_tiny_step_on_the_cpu(tmp_path, monkeypatch, capsys):
    """bench/nvme_step.py parses its arguments and prints its table, here with its own O_DIRECT
    measurement of the disk (as where fio is missing)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import nvme_step
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setattr(nvme_step, "_fio_engine", lambda: None)
    args = ["--nvme-path", str(tmp_path / "disk"), "--steps", "1", "--warmup", "0", "--model", "tiny", "--seq", "16",
            "--micro-batch", "1", "--disk-gib", "0.02", "--cpu"]  # fmt: skip
    assert nvme_step.parse_args(args).steps == 1
    nvme_step.main(args)
    out = capsys.readouterr().out
    assert "fio is not installed" in out and "tokens/s" in out
    rows = {line.split()[1]: line.split()[-3:] for line in out.splitlines() if line.startswith("NVMe ")}
    assert set(rows) == {"read", "write"} and all(float(x) > 0 for row in rows.values() for x in row)
    mixed = next(line for line in out.splitlines() if line.startswith("optimizer phase GB/s"))
    assert "read + write at once" in mixed and all(float(x) > 0 for x in mixed.split()[3:6])
    assert not list((tmp_path / "disk").iterdir())  # the engine's run directory and the disk's file are gone


# -- on the GPU machine -------------------------------------------------------------------------


def _cuda_config(stage: str, optimizer_tier: str, params_tier: str, path, precision: str = "fp32") -> dict:
    from tests.kernel import test_cuda

    cfg = test_cuda._config(stage, precision)
    cfg["optimizer"] = {**cfg["optimizer"], "name": "cpu_adam" if optimizer_tier != "none" else "adamw"}
    cfg["offload"] = {"optimizer": optimizer_tier, "params": params_tier, "nvme_path": str(path)}
    if optimizer_tier != "none":
        # The host and disk paths: no GPU share (the default, "auto", would move these small models'
        # optimizer to the GPU after the first step).
        cfg["offload"]["optimizer_options"] = {"gpu_share": 0.0}
    return cfg


CUDA_TIERS = [("nvme", "none"), ("nvme", "nvme"), ("cpu", "nvme"), ("none", "nvme"), ("nvme", "cpu")]


@pytest.mark.cuda
@pytest.mark.parametrize(("optimizer_tier", "params_tier"), CUDA_TIERS)
def test_cuda_nvme_tiers_match_torch(optimizer_tier, params_tier, tmp_path):
    """Swap files through page-locked pools, gradients down and shards up on side streams, against
    torch AdamW on the GPU; parameters offloaded with and without prefetch."""
    from tests.kernel import test_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    stages = STAGES if params_tier == "none" else ("zero3",)
    expected = test_cuda._reference(1)
    for stage in stages:
        for prefetch in (0, 1 << 20) if params_tier != "none" else (None,):
            cfg = _cuda_config(stage, optimizer_tier, params_tier, tmp_path)
            if prefetch is not None:
                cfg["prefetch_bytes"] = prefetch
            result = train(cfg, test_cuda.STEPS, test_cuda.ACCUM, test_cuda.MICRO, test_cuda.SEED)
            for i, (a, b) in enumerate(zip(result["losses"], expected)):
                assert abs(a - b) <= 2e-5 * abs(b), f"{stage} {optimizer_tier}/{params_tier} prefetch {prefetch} step {i}: {a} vs {b}"
            assert "nvme" in {*result["memory"]["master_weights"], *result["memory"]["params"]}
    assert not _runs(tmp_path)


@pytest.mark.cuda
def test_cuda_spill_over_gpu_host_and_disk_matches_torch(tmp_path):
    """gpu_share and host_share: the optimizer across the GPU, host memory and swap files, against torch."""
    from tests.kernel import test_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _cuda_config("zero3", "nvme", "cpu", tmp_path)
    cfg["offload"]["optimizer_options"] = {"gpu_share": 0.3, "host_share": 0.4}
    result = train(cfg, test_cuda.STEPS, test_cuda.ACCUM, test_cuda.MICRO, test_cuda.SEED)
    for i, (a, b) in enumerate(zip(result["losses"], test_cuda._reference(1))):
        assert abs(a - b) <= 2e-5 * abs(b), f"step {i}: {a} vs {b}"
    where = {device.split(":")[0] for device in result["memory"]["master_weights"]}
    assert where == {"cuda", "cpu", "nvme"}, result["memory"]["master_weights"]
    assert not _runs(tmp_path)


@pytest.mark.cuda
def test_cuda_bf16_on_nvme_equals_the_cpu_tier_bit_for_bit(tmp_path):
    from tests.kernel import test_cuda

    for stage, params in (("zero2", "none"), ("zero3", "none"), ("zero3", "nvme")):
        disk = _cuda_config(stage, "nvme", params, tmp_path, "bf16")
        host = _cuda_config(stage, "cpu", "cpu" if params == "nvme" else "none", tmp_path, "bf16")
        host["offload"]["optimizer_options"] = {"speculate": "never", "gpu_share": 0.0}  # the nvme tier never speculates
        a, b = (train(c, test_cuda.STEPS, test_cuda.ACCUM, test_cuda.MICRO, test_cuda.SEED)["losses"] for c in (host, disk))
        assert a == b, f"{stage} params {params}: {a} vs {b}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_nvme_tiers_match_torch(tmp_path):
    from tests.kernel import test_cuda

    configs = [_cuda_config("zero2", "nvme", "none", tmp_path), _cuda_config("zero3", "nvme", "nvme", tmp_path)]
    results = run_ranks(2, train_many, configs, test_cuda.STEPS, test_cuda.ACCUM, test_cuda.MICRO, test_cuda.SEED)
    expected = test_cuda._reference(2)
    for rank_results in results:
        for cfg, result in zip(configs, rank_results):
            for i, (a, b) in enumerate(zip(result["losses"], expected)):
                assert abs(a - b) <= 2e-5 * abs(b), f"{cfg['offload']} step {i}: {a} vs {b}"
