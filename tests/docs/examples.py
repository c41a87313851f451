"""The code examples of README.md and docs/**/*.md, found as the docs convention says.

[Note: example markers] Every fenced block is an example. A ```python block runs in a
fresh process in a temp directory (the repository importable); the HTML comment line
right before its fence, if any, says otherwise:

* ``<!-- example: torchrun 2 -->``: run under ``python -m torch.distributed.run
  --nproc-per-node 2`` (gloo on CPU);
* ``<!-- example: skip (reason) -->``: not run; the reason is required, and the test
  suite lists every skipped block with it;
* ``<!-- example: continues -->``: the page's previous python block is prepended, for a
  block that goes on with the same objects.

```toml and ```json blocks are zkernel configs (every key one `zkernel.Config`
knows, or a DeepSpeed config) and are loaded with zkernel's config loader, so a config the
docs show and zkernel rejects fails the suite; one that is not a zkernel config (a
pyproject.toml table) carries a skip marker. ```bash, ```text and others are not run.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from tests.support.paths import REPO

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"^<!-- example: (torchrun (?P<nproc>\d+)|skip \((?P<reason>[^)]+)\)|continues) -->$")
ANY_MARKER = re.compile(r"^<!-- example:")


@attrs.frozen
class Example:
    """One fenced block of a Markdown file: where it is, its language, its code and how to run it."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    mode: str = "python"  # "python", "torchrun", "skip" or "config"
    nproc: int = 1
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{_name(self.path)}:{self.line}"


def _name(path: Path) -> str:
    """The path as a failure names it: relative to the repository where it is inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def markdown_files() -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def examples_of(path: Path) -> list[Example]:
    """The fenced blocks of one file; a malformed marker is a ValueError naming its line."""
    text = path.read_text()
    lines = text.split("\n")
    for number, content in enumerate(lines, 1):
        if ANY_MARKER.match(content) and (number == len(lines) or not lines[number].startswith("```")):
            raise ValueError(f"{_name(path)}:{number}: an example marker must be the line right before a fence")
    found: list[Example] = []
    previous_python = ""
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        language, code = match.group(1).lower(), match.group(2)
        before = lines[line - 2].strip() if line >= 2 else ""
        marker = MARKER.match(before)
        if ANY_MARKER.match(before) and not marker:
            raise ValueError(
                f"{_name(path)}:{line - 1}: malformed example marker {before!r}; valid: "
                "<!-- example: torchrun N -->, <!-- example: skip (reason) -->, <!-- example: continues -->"
            )
        if language == "python":
            if marker and marker.group("reason"):
                found.append(Example(path, line, language, code, "skip", reason=marker.group("reason").strip()))
                previous_python = code
                continue
            full = code
            if marker and before.endswith("continues -->"):
                if not previous_python:
                    raise ValueError(f"{_name(path)}:{line}: 'continues' with no python block before it")
                full = previous_python + "\n" + code
            mode, nproc = ("torchrun", int(marker.group("nproc"))) if marker and marker.group("nproc") else ("python", 1)
            found.append(Example(path, line, language, full, mode, nproc))
            previous_python = full
        elif language in ("toml", "json"):
            if marker and marker.group("reason"):
                found.append(Example(path, line, language, code, "skip", reason=marker.group("reason").strip()))
            else:
                found.append(Example(path, line, language, code, "config"))
    return found


def all_examples() -> list[Example]:
    return [example for path in markdown_files() for example in examples_of(path)]
