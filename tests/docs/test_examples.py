"""Every code example in README.md and docs/ runs as written ([Note: example markers] in tests/docs/examples.py).

A ```python block runs in a fresh process in a temp directory with the repository
importable (under torchrun with 2 gloo ranks where its marker says so) and must exit 0;
a plain one is forked from a server that imported torch once ([Note: a forked script is a
fresh process] in tests/support/forked_script.py);
a ```toml or ```json block is a config zkernel must accept: loaded by
`zkernel.kernel.config_source.load_config` and every component it names resolved
against the installed plugins with its options. Parametrized by file:line, so a
failure names the block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.docs.examples import all_examples
from tests.support.forked_script import run_script
from tests.support.paths import REPO

EXAMPLES = all_examples()
RUN = [e for e in EXAMPLES if e.mode in ("python", "torchrun")]
CONFIGS = [e for e in EXAMPLES if e.mode == "config"]
SKIPPED = [e for e in EXAMPLES if e.mode == "skip"]
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["ZKERNEL_PROGRESS"] = "0"
    # The convention: examples run as on a CPU machine (torchrun ones on gloo), on a GPU machine too.
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.mark.parametrize("example", RUN, ids=[e.id for e in RUN])
def test_python_example_runs(example, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example.code)
    if example.mode == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(example.nproc), str(script)]
        result = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    else:  # `python example.py`, forked from a server that imported torch once
        result = run_script(script, cwd=tmp_path, env=_env(), timeout=TIMEOUT_S)
    assert result.returncode == 0, (
        f"{example.id} failed ({result.returncode}):\n{example.code}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-5000:]}"
    )


def _load(example):
    if example.language == "json":
        return json.loads(example.code)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads(example.code)


@pytest.mark.parametrize("example", CONFIGS, ids=[e.id for e in CONFIGS])
def test_config_example_is_accepted(example):
    from zkernel.kernel.config_source import load_config
    from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager, resolve_components
    from zkernel.spec.config import AUTO_KEYS, config_value

    config = load_config(_load(example))
    registry = collect_components(get_plugin_manager(config=config))
    auto = [key for key in AUTO_KEYS if config_value(config, key) == "auto"]
    resolve_components(registry, config, skip=auto)


def test_examples_are_found_and_skips_give_reasons():
    """The extraction sees the README's loop, and every skipped block says why (listed in the report)."""
    readme = [e for e in RUN if e.path.name == "README.md"]
    assert readme, "no runnable python block found in README.md"
    assert any("engine.backward(loss)" in e.code for e in readme)
    for example in SKIPPED:
        assert example.reason, example.id
    print("\nskipped examples:\n" + "\n".join(f"  {e.id}: {e.reason}" for e in SKIPPED))
