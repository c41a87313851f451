"""The ``zkernel`` command, run as a user runs it: in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import zkernel
from zkernel.kernel.config_source import load_config

BUILTINS = [
    ("partitioner", "none"),
    ("partitioner", "zero1"),
    ("partitioner", "zero2"),
    ("partitioner", "zero3"),
    ("optimizer", "adamw"),
    ("optimizer", "cpu_adam"),
    ("offload tier", "none"),
    ("offload tier", "cpu"),
    ("offload tier", "nvme"),
]

# Variables torchrun sets; a test run under torchrun must not make the demo think it is a rank.
_LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.pop("ZKERNEL_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run(
        [sys.executable, "-m", "zkernel.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _rows(table: str) -> list[list[str]]:
    lines = table.strip().splitlines()
    assert lines[0].split()[:3] == ["FAMILY", "NAME", "PLUGIN"], table
    return [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]


def test_plugins_lists_the_builtins_as_entry_points():
    result = run_cli("plugins")
    assert result.returncode == 0, result.stderr
    rows = {(r[0], r[1]): r for r in _rows(result.stdout)}
    for family, name in BUILTINS:
        assert (family, name) in rows, f"{family} {name!r} missing from:\n{result.stdout}"
        _, _, plugin, origin, distribution, description = rows[(family, name)]
        assert origin == "entry point", rows[(family, name)]
        assert distribution == f"zkernel {zkernel.__version__}", rows[(family, name)]
        assert plugin and description


def test_plugins_block_hides_a_plugin():
    result = run_cli("plugins", "--block", "partitioner_zero1")
    assert result.returncode == 0, result.stderr
    names = {(r[0], r[1]) for r in _rows(result.stdout)}
    assert ("partitioner", "zero1") not in names
    assert ("partitioner", "zero3") in names


def test_config_prints_the_defaults_as_toml_that_loads_back(tmp_path):
    result = run_cli("config")
    assert result.returncode == 0, result.stderr
    path = tmp_path / "zkernel.toml"
    path.write_text(result.stdout)
    if sys.version_info >= (3, 11):
        assert load_config(path) == load_config(None)
    assert 'partitioner = "none"' in result.stdout and "[optimizer]" in result.stdout


def test_config_prints_a_file_with_every_section_as_toml_that_loads_back(tmp_path):
    source = tmp_path / "in.toml"
    source.write_text(
        'partitioner = "zero3"\n[optimizer]\nweight_decay = 0.1\nno_weight_decay = ["*.bias"]\n'
        '[[optimizer.param_groups]]\nparams = ["embed.*"]\nlr_scale = 0.1\n'
        '[[optimizer.param_groups]]\nparams = ["block.*"]\nweight_decay = 0.0\nbetas = [0.5, 0.9]\neps = 0.01\n'
        '[lr_schedule]\nname = "warmup_decay"\ntotal_num_steps = 100\n'
    )
    result = run_cli("config", str(source))
    assert result.returncode == 0, result.stderr
    printed = tmp_path / "out.toml"
    printed.write_text(result.stdout)
    if sys.version_info >= (3, 11):
        assert load_config(printed) == load_config(source)
    assert 'param_groups = [{params = ["embed.*"], lr_scale = 0.1}, ' in result.stdout
    assert '{params = ["block.*"], lr_scale = 1.0, weight_decay = 0.0, betas = [0.5, 0.9], eps = 0.01}]' in result.stdout


def test_config_rejects_a_bad_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"partitioner": "zero3", "precison": "bf16"}')
    result = run_cli("config", str(path))
    assert result.returncode == 2
    assert "precison" in result.stderr and "precision" in result.stderr


def test_demo_short_trains_on_two_processes_and_the_loss_goes_down():
    result = run_cli("demo", "--short", "--nproc", "2", timeout=120)
    out = result.stdout
    assert result.returncode == 0, f"stdout:\n{out}\nstderr:\n{result.stderr[-4000:]}"
    assert "2 rank(s)" in out and "built on the meta device" in out, out
    match = re.search(r"loss: first (\d+\.\d+) -> last (\d+\.\d+) \((\d+) optimizer steps\)", out)
    assert match, out
    first, last, steps = float(match[1]), float(match[2]), int(match[3])
    assert steps >= 3, out
    assert last < first - 0.3, out
    assert re.search(r"throughput: [\d,]+ tokens/s", out), out
    # Every rank's memory report reaches rank 0; zero3 shards the parameters, so each holds half.
    reports = re.findall(r"rank (\d): params ([\d.]+) MiB", out)
    assert [r for r, _ in reports] == ["0", "1"], out
    assert "sample: " in out
    # Rank-aware structured logs on stderr, zkernel debug events hidden by default.
    assert "zkernel.initialized" in result.stderr
    assert "rank=1" in result.stderr
    assert "[debug" not in result.stderr


@pytest.mark.parametrize("argv", [["--version"]])
def test_version(argv):
    result = run_cli(*argv)
    assert result.returncode == 0
    assert zkernel.__version__ in result.stdout


def test_the_parser_and_config_command_import_no_torch():
    """``zkernel --version`` and ``zkernel config`` answer without the seconds torch takes to import."""
    probe = "import sys, zkernel.cli.commands as c; c.build_parser(); c.main(['config']); print('torch' in sys.modules, file=sys.stderr)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "False", result.stderr


def test_configure_logging_json_is_rank_aware_and_hides_debug(capsys, restore_zkernel_logger):
    import json

    import structlog

    from zkernel.cli.commands import configure_logging

    configure_logging(json_output=True, rank=1)
    log = structlog.get_logger("zkernel")
    log.debug("zkernel.test.hidden")
    log.info("zkernel.test.shown", nbytes=3)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    event = json.loads(lines[0])
    assert event["event"] == "zkernel.test.shown"
    assert event["rank"] == 1 and event["nbytes"] == 3 and event["level"] == "info"

    configure_logging(verbose=True)
    structlog.get_logger("zkernel").debug("zkernel.test.verbose")
    assert "zkernel.test.verbose" in capsys.readouterr().err
