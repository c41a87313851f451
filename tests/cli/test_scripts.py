"""scripts/install.sh (shared by scripts/demo.sh and scripts/test.sh) installs only when the build is stale.

Run on a copy of the checkout with a Python shim whose ``pip install`` only
records the call and "builds" by copying this checkout's compiled extension, so
nothing is installed into the test's environment.
"""

from __future__ import annotations

from tests.support.paths import REPO
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zkernel

REPO = REPO
NATIVE = next(Path(zkernel.__file__).parent.glob("_native*.so"), None)

pytestmark = pytest.mark.skipif(
    NATIVE is None or not (REPO / ".git").exists(), reason="needs a git checkout with the native extension built"
)


def _copy_checkout(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.fixture
def checkout(tmp_path):
    clone = tmp_path / "zkernel"
    clone.mkdir()
    _copy_checkout(clone)
    log = tmp_path / "pip-installs.log"
    shim = tmp_path / "python"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        # ZKERNEL_TEST_NO_TORCH: the shim's environment has no torch (the look-up fails).
        'if [ -n "${ZKERNEL_TEST_NO_TORCH:-}" ] && [[ "$*" == *"find_spec(\'torch\')"* ]]; then exit 1; fi\n'
        'if [ "$1 $2 $3" = "-m pip install" ]; then\n'
        f'  echo "$*" >> {log}\n'
        f"  cp {NATIVE} zkernel/\n"
        "  exit 0\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    shim.chmod(0o755)
    # What the editable install's path mapping provides: `plugins/` importable as `zkernel_plugins`.
    site = tmp_path / "site"
    site.mkdir()
    (site / "zkernel_plugins").symlink_to(clone / "plugins")
    return clone, shim, log


def _env(clone: Path, shim: Path | None, **env_extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "ZKERNEL_EXTRAS")}
    env.update(PYTHONPATH=f"{clone}{os.pathsep}{clone.parent / 'site'}", **env_extra)
    if shim is not None:
        env["PYTHON"] = str(shim)
    return env


def _install(clone: Path, shim: Path | None, **env_extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail; source scripts/install.sh"],
        cwd=clone, env=_env(clone, shim, **env_extra), capture_output=True, text=True, timeout=120,
    )


def _script(clone: Path, shim: Path | None, script: str, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", f"scripts/{script}", *args],
        cwd=clone, env=_env(clone, shim, **env_extra), capture_output=True, text=True, timeout=120,
    )


def _installs(log: Path) -> int:
    return len(_calls(log))


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_no_cxx17_compiler_fails_with_the_hint_before_pip(checkout):
    clone, shim, log = checkout
    result = _install(clone, shim, CXX=str(clone / "no-such-compiler"))
    assert result.returncode != 0
    assert "needs a C++17 compiler" in result.stderr and "apt-get install g++" in result.stderr, result.stderr
    assert _installs(log) == 0


def test_install_runs_on_a_fresh_clone_then_only_when_the_build_changes(checkout):
    clone, shim, log = checkout
    steps = []

    def run(label):
        result = _install(clone, shim)
        assert result.returncode == 0, result.stderr
        steps.append((label, _installs(log)))

    run("fresh clone")
    run("unchanged")
    with open(clone / "native" / "cpu_adam.cpp", "a") as f:
        f.write("// edited\n")
    (clone / "plugins" / "partitioners" / "extra.py").write_text("")
    run("native source edited, plugin module added")
    for so in (clone / "zkernel").glob("_native*.so"):
        so.unlink()
    run("extension missing")
    (clone.parent / "site" / "zkernel_plugins").unlink()  # the editable install maps another checkout's plugins
    run("plugins not this checkout's")
    assert steps == [
        ("fresh clone", 1),
        ("unchanged", 1),
        ("native source edited, plugin module added", 2),
        ("extension missing", 3),
        ("plugins not this checkout's", 4),
    ]
    assert (clone / "zkernel" / NATIVE.name).exists()


def test_no_compiler_stops_before_torch_is_installed(checkout):
    clone, shim, log = checkout
    result = _install(clone, shim, CXX="/bin/false", ZKERNEL_TEST_NO_TORCH="1")
    assert result.returncode != 0
    assert "needs a C++17 compiler" in result.stderr and "Nothing was installed" in result.stderr, result.stderr
    assert _calls(log) == []  # neither torch nor zkernel


def test_a_missing_torch_is_installed_first(checkout):
    clone, shim, log = checkout
    result = _install(clone, shim, ZKERNEL_TEST_NO_TORCH="1")
    assert result.returncode == 0, result.stderr
    assert _calls(log) == ["-m pip install torch==2.13.0", "-m pip install -e ."]


def test_an_active_virtual_environment_is_used_unless_python_is_given(checkout, tmp_path):
    clone, shim, log = checkout
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(shim)
    result = _install(clone, None, VIRTUAL_ENV=str(venv))
    assert result.returncode == 0, result.stderr
    assert _installs(log) == 1  # through the environment's python (the shim)
    other = tmp_path / "missing-python"
    result = _install(clone, None, VIRTUAL_ENV=str(venv), PYTHON=str(other))
    assert result.returncode != 0 and f"no Python at '{other}'" in result.stderr, result.stderr


def test_demo_installs_without_the_test_extras_and_each_set_keeps_its_stamp(checkout):
    clone, shim, log = checkout
    steps = []

    def run(script, *args):
        result = _script(clone, shim, script, *args)
        assert result.returncode == 0, result.stderr
        steps.append((script, _calls(log)[len(steps_calls(steps)) :]))
        return result

    def steps_calls(done):
        return [call for _, calls in done for call in calls]

    demo = run("demo.sh", "--help")
    assert "--partitioner" in demo.stdout  # the demo's own options: `python -m zkernel.cli demo` ran
    run("demo.sh", "--help")
    run("test.sh", "--version")
    run("test.sh", "--version")
    run("demo.sh", "--help")  # the [test] install serves the demo too
    assert steps == [
        ("demo.sh", ["-m pip install -e ."]),
        ("demo.sh", []),
        ("test.sh", ["-m pip install -e .[test]"]),
        ("test.sh", []),
        ("demo.sh", []),
    ]
