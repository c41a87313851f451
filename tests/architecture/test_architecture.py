"""The package boundaries and the one list of builtins hold.

The import-linter contracts in pyproject.toml (docs/architecture.md) are run
here, so a broken boundary fails the suite; the builtin plugins are listed once
(pyproject's entry points), and the installed metadata and the plugin modules
agree with that list.
"""

from __future__ import annotations

from tests.support.paths import REPO
import ast
import importlib.metadata
import pathlib

import pytest

ROOT = REPO


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_import_contracts_hold():
    # In a subprocess: the contracts' report is printed, and grimp's import of every module stays out
    # of this process.
    pytest.importorskip("importlinter")
    import subprocess
    import sys

    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_builtins_listed_once_match_installed_entry_points():
    declared = _pyproject()["project"]["entry-points"]["zkernel"]
    installed = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group="zkernel")
        if ep.dist is not None and ep.dist.metadata["Name"] == "zkernel"
    }
    assert installed == declared, "reinstall zkernel (pip install -e .): its metadata is stale"


def _registers_components(path: pathlib.Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.FunctionDef) and node.name.startswith("zkernel_register_")
        for node in ast.walk(tree)
    )


def test_every_plugin_module_that_registers_components_is_an_entry_point():
    declared = set(_pyproject()["project"]["entry-points"]["zkernel"].values())
    registering = {
        "zkernel_plugins." + ".".join(path.relative_to(ROOT / "plugins").with_suffix("").parts)
        for path in (ROOT / "plugins").rglob("*.py")
        if _registers_components(path)
    }
    assert registering == declared


def test_old_module_paths_warn_and_name_the_new_one():
    import subprocess
    import sys

    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from zkernel.tiers import OptimizerTier\n"
        "    from zkernel.config import load_config, build_options, Config\n"
        "    from zkernel import hookimpl\n"
        "import zkernel.spec\n"
        "assert OptimizerTier is zkernel.spec.OptimizerTier\n"
        "assert hookimpl is zkernel.spec.hookimpl\n"
        "for w in caught: print(w.category.__name__, w.message)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "DeprecationWarning zkernel.tiers moved to zkernel.spec.tiers" in out
    assert "DeprecationWarning zkernel.config moved to zkernel.spec.config and zkernel.spec.options" in out
    assert "DeprecationWarning zkernel.hookimpl moved to zkernel.spec.hookimpl" in out
