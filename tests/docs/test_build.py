"""The docs site builds with warnings as errors (`mkdocs build --strict`), generated pages included."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support.paths import REPO

BUDGET_S = 30


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    took = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert took < BUDGET_S, f"mkdocs build took {took:.1f} s; the budget is {BUDGET_S} s"
    page = (tmp_path / "site" / "guide" / "configuration" / "index.html").read_text()
    assert "gradient_accumulation_steps" in page and "persistence_threshold" in page, "config reference not generated"
    assert "zkernel_step_optimizer" in (tmp_path / "site" / "plugins" / "hooks" / "index.html").read_text()
