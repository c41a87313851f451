"""MkDocs hook: the parts of the docs that are generated from the code, at build time.

mkdocs.yml names this file under ``hooks:``; MkDocs calls `on_page_markdown` for every
page, and each marker line below is replaced by what it names:

* ``<!-- generated: config-reference -->``: the configuration reference, from the
  config schema (`zkernel.spec.config.CoreConfig`, the families' sections in
  `zkernel.spec.sections`) and the options class of every builtin component.
* ``<!-- generated: api-reference -->``: one mkdocstrings entry per name in
  ``zkernel.__all__``, at the module that defines it (the facade imports them lazily, which a
  static reader cannot follow), so a name added to the public API gets its entry.
* ``<!-- generated: hook-contract -->``: every hook spec of `zkernel.spec.hookspecs`, under
  the phase banner it sits below in the source, with how its results combine (the
  ``@hookspec`` options) and its docstring through mkdocstrings.
* ``<!-- generated: zkernel ARGS -->``: the output of the command ``zkernel ARGS``, run
  in a fresh process at build time, as a text block headed by the command.

`on_files` also adds the repository's BENCHMARKS.md as the page ``benchmarks.md`` (the
record every figure of the performance page comes from), so the site links it without a copy.

[Note: descriptions from comments] The schema documents each field with the ``#``
comment lines right above it (STYLE.md's attrs convention), not with metadata, so
the reference reads those comments from the class's source. A field without such a
comment gets its type and default only; the reference never invents a meaning.
"""

from __future__ import annotations

import inspect
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import attrs

MARKER = re.compile(r"^<!-- generated: (.+?) -->$", re.M)
FIELD_LINE = re.compile(r"^    (\w+)\s*:")


def field_comments(cls: type) -> dict[str, str]:
    """Each field of the attrs class ``cls`` -> the comment lines right above its definition, joined
    (a field a base class defines has the base's comment, unless ``cls`` redefines it)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if attrs.has(klass):
            found.update(_own_field_comments(klass))
    return found


def _own_field_comments(cls: type) -> dict[str, str]:
    try:
        lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    except (OSError, TypeError):  # a class made at runtime (`zkernel.spec.config.Config`) has no source
        return {}
    found: dict[str, str] = {}
    for i, line in enumerate(lines):
        match = FIELD_LINE.match(line)
        if not match:
            continue
        comment: list[str] = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            comment.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        found.setdefault(match.group(1), " ".join(comment))
    return found


def _default(field: attrs.Attribute) -> str:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory() if not default.takes_self else None
    if default is attrs.NOTHING:
        return "required"
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "`true`" if default else "`false`"
    if isinstance(default, str):
        return f'`"{default}"`'
    if isinstance(default, (tuple, list)):
        return "`[" + ", ".join(repr(v) if not isinstance(v, str) else f'"{v}"' for v in default) + "]`"
    if isinstance(default, dict):
        return "`{}`" if not default else f"`{default}`"
    if isinstance(default, int) and default >= 2**20:
        return f"`{default}`"
    return f"`{default!r}`" if not hasattr(default, "__fspath__") else f"`{os.fspath(default)}`"


def _type(field: attrs.Attribute) -> str:
    kind = field.type
    text = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return f"`{text}`".replace("|", "\\|") if text else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def options_table(cls: type, prefix: str = "", skip: tuple[str, ...] = ("options",)) -> str:
    """A Markdown table of the attrs class ``cls``: key, type, default, meaning (its comments)."""
    comments = field_comments(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for field in attrs.fields(cls):
        if field.name in skip:
            continue
        rows.append(
            f"| `{prefix}{field.name}` | {_type(field)} | {_default(field)} | {_cell(comments.get(field.name, ''))} |"
        )
    return "\n".join(rows)


def _docline(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def config_reference() -> str:
    """The configuration reference: the core keys, every section, every builtin component's options."""
    from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager
    from zkernel.spec.config import CoreConfig
    from zkernel.spec.registry import Family
    from zkernel.spec.sections import ParamGroupConfig

    out = [
        "## Top-level keys",
        "",
        f"{_docline(CoreConfig)} From `zkernel.spec.config.CoreConfig`.",
        "",
        options_table(CoreConfig, skip=()),
        "",
    ]
    for family in Family:
        if not family.section:
            continue
        out += [
            f"## `[{family.section}]`",
            "",
            f"{_docline(family.schema)} From `{family.schema.__module__}.{family.schema.__qualname__}`.",
            "",
            options_table(family.schema),
            "",
        ]
        if family.section == "optimizer":
            out += [
                "Each `[[optimizer.param_groups]]` entry "
                f"(`{ParamGroupConfig.__module__}.{ParamGroupConfig.__qualname__}`):",
                "",
                options_table(ParamGroupConfig),
                "",
            ]
    registry = collect_components(get_plugin_manager(autoload=False))
    out += [
        "## Options of the builtin components",
        "",
        "Each component validates its own options with the class named in its heading; "
        "a third-party component brings its own. `zkernel plugins` lists what is installed.",
        "",
    ]
    for family in Family:
        for component in registry.components(family):
            for slot in family.slots:
                cls = component.options_for(slot)
                if cls is None:
                    continue
                out += [
                    f"### {family.label} `{component.name}`: `{slot.options}`",
                    "",
                    f"{_cell(component.description)} (`{cls.__module__}.{cls.__qualname__}`)",
                    "",
                    options_table(cls),
                    "",
                ]
    return "\n".join(out)


def api_reference() -> str:
    """mkdocstrings entries for every public name of `zkernel`, under its public name, errors last."""
    import zkernel

    entries, errors = [], []
    for name in sorted(zkernel.__all__):
        obj = getattr(zkernel, name)
        entry = [f"### `zkernel.{name}`", ""]
        try:
            inspect.getsource(obj)
        except (OSError, TypeError):  # made at runtime (`Config`): no source for a static reader
            entry += [_cell(inspect.getdoc(obj) or ""), ""]
        else:
            entry += [
                f"::: {obj.__module__}.{obj.__qualname__}",
                "    options:",
                "      show_root_heading: false",
                "      heading_level: 4",
                "",
            ]
        (errors if isinstance(obj, type) and issubclass(obj, Exception) else entries).append("\n".join(entry))
    return "\n".join(["## Functions and classes", "", *entries, "## Errors", "", *errors])


BANNER = re.compile(r"^# -{20,}\n# (?P<title>.+)\n# -{20,}$", re.M)
SPEC = re.compile(r"^@hookspec(?:\((?P<options>[^)]*)\))?\ndef (?P<name>\w+)\(", re.M)


def hook_contract() -> str:
    """The hook specs by phase, in source order, each with its result rule and its docstring."""
    from zkernel.spec import hookspecs

    source = inspect.getsource(hookspecs)
    marks = sorted(
        [(m.start(), "banner", m.group("title")) for m in BANNER.finditer(source)]
        + [(m.start(), m.group("name"), m.group("options") or "") for m in SPEC.finditer(source)]
    )
    out: list[str] = []
    for _, kind, value in marks:
        if kind == "banner":
            out += [f"## {value}", ""]
            continue
        rule = "first non-None result wins" if "firstresult=True" in value else "every implementation is called"
        if "historic=True" in value:
            rule += "; historic (replayed to plugins registered later)"
        out += [
            f"### `{kind}`",
            "",
            f"*{rule}*",
            "",
            f"::: zkernel.spec.hookspecs.{kind}",
            "    options:",
            "      show_root_heading: false",
            "      heading_level: 4",
            "",
        ]
    return "\n".join(out)


def command_output(args: str) -> str:
    """``zkernel ARGS`` run in a fresh process in a temp directory, as a text block headed by the command."""
    with tempfile.TemporaryDirectory() as cwd:
        env = dict(os.environ, ZKERNEL_PROGRESS="0", ZKERNEL_DISABLE_PLUGIN_AUTOLOAD="1")
        result = subprocess.run(
            [sys.executable, "-m", "zkernel.cli", *shlex.split(args)],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
        )
    if result.returncode != 0:
        raise RuntimeError(f"`zkernel {args}` failed at docs build time ({result.returncode}):\n{result.stderr}")
    return f"```text\n$ zkernel {args}\n{result.stdout.rstrip()}\n```"


def render(marker: str) -> str:
    """What the marker ``<!-- generated: MARKER -->`` is replaced by."""
    if marker == "config-reference":
        return config_reference()
    if marker == "hook-contract":
        return hook_contract()
    if marker == "api-reference":
        return api_reference()
    if marker.startswith("zkernel "):
        return command_output(marker[len("zkernel "):])
    raise ValueError(f"unknown generated marker {marker!r}; valid: config-reference, api-reference, hook-contract, zkernel ARGS")


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: the repository's BENCHMARKS.md, served as the page ``benchmarks.md``."""
    from mkdocs.structure.files import File

    source = os.path.join(os.path.dirname(config["config_file_path"]), "BENCHMARKS.md")
    files.append(File.generated(config, "benchmarks.md", abs_src_path=source))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: replace each marker line of the page by what it generates."""
    return MARKER.sub(lambda m: render(m.group(1)), markdown)
