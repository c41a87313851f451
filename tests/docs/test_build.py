"""The docs site builds with warnings as errors (`mkdocs build --strict`), generated pages included,
and what the pages say about the generated output holds for it."""

from __future__ import annotations

import html
import re
import resource
import subprocess
import sys
import time

import pytest

from tests.support.paths import REPO

# CPU seconds the build may take (its own and its children's): the wall time on a loaded machine
# says little, so it is reported but not held to.
BUDGET_CPU_S = 30


def _text(page) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("site")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    print(f"\nmkdocs build --strict: {wall:.1f} s wall, {cpu:.1f} s CPU")
    assert cpu < BUDGET_CPU_S, f"mkdocs build took {cpu:.1f} CPU seconds; the budget is {BUDGET_CPU_S}"
    return out


def test_mkdocs_build_strict_generates_the_reference_pages(site):
    config = _text(site / "guide" / "configuration" / "index.html")
    for key in ("gradient_accumulation_steps", "persistence_threshold", "nvme_path", "gpu_share", "warmup_num_steps"):
        assert key in config, f"configuration reference lacks {key}"
    assert "zkernel_step_optimizer" in _text(site / "plugins" / "hooks" / "index.html")
    api = _text(site / "reference" / "api" / "index.html")
    import zkernel

    for name in zkernel.__all__:
        assert f"zkernel.{name}" in api, f"API reference lacks zkernel.{name}"


def test_the_estimate_page_describes_its_generated_output(site):
    """The prose around the generated `zkernel estimate` output names what the output shows."""
    page = _text(site / "guide" / "estimator" / "index.html")
    output = page[page.index("$ zkernel estimate"):]
    rows = [line.split() for line in output.splitlines()]
    partitioners = {row[0] for row in rows if row and row[0] in ("none", "zero1", "zero2", "zero3")}
    assert partitioners == {"none", "zero1", "zero2", "zero3"}, "one row per partitioner"
    header = next(line for line in output.splitlines() if line.startswith("PARTITIONER"))
    for column in ("OFFLOAD OPT/PARAMS", "CUDA", "CPU", "FITS"):  # the columns the page's prose names
        assert column in header, f"the estimate page explains a column {column!r} the output lacks: {header}"
    assert "activations per rank" in output, "the page explains the activation line"
