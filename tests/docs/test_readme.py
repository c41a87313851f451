"""What the README promises a newcomer holds: its order, its first commands, its links and its figure."""

from __future__ import annotations

import re

from tests.support.paths import REPO

README = (REPO / "README.md").read_text()


def test_readme_opens_with_the_title_and_the_two_commands():
    assert README.startswith("# zkernel\n")
    first_block = re.search(r"```(\w*)\n(.*?)```", README, re.S)
    assert first_block.group(1) == "bash"
    commands = [line.split("#")[0].strip() for line in first_block.group(2).splitlines()]
    assert commands[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert (REPO / "scripts" / "demo.sh").is_file() and (REPO / "scripts" / "test.sh").is_file()
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text(), ".ci/run runs the README's test command"


def test_readme_is_short_and_in_a_newcomers_order():
    lines = README.count("\n")
    assert 150 <= lines <= 300, f"README.md has {lines} lines; it is the newcomer's page (about 200-300)"
    headings = re.findall(r"^## (.+)$", README, re.M)
    order = ["Try it", "The training loop", "Launching", "Configs most people want", "What is supported", "Read more"]
    assert [h for h in headings if h in order] == order, headings


def test_readme_links_point_at_files_that_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" in target:
            continue
        assert (REPO / target).exists(), f"README links {target}, which does not exist"


def test_readme_figure_is_in_benchmarks():
    benchmarks = (REPO / "BENCHMARKS.md").read_text()
    for figure in re.findall(r"(\d+(?:\.\d+)?) TFLOP/s", README) + re.findall(r"(\d+\.\d+)x", README):
        assert figure in benchmarks, f"README's figure {figure} is not in BENCHMARKS.md"
