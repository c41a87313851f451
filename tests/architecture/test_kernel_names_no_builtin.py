"""The kernel names no builtin (DESIGN "Layers and packages"; issue 42 item 2).

`zkernel.spec` and `zkernel.kernel` may not import a builtin plugin, branch on a
builtin component's name, or copy a builtin's name or option names into code: a
rule that involves a component is declared by the component (its options, its
``check``, its capabilities; [Note: capabilities] in `zkernel.spec.registry`),
and a message that names components lists the installed ones.

What is scanned: every string literal of those packages that is not a
docstring. A builtin's name that only a builtin could have (``zero3``, ``nvme``,
``cpu_adam``) is an error anywhere in such a literal; a name that is also a
plain word or a torch device type (``none``, ``cpu``, ``default``) is an error
where the literal is compared with something (``x == "cpu"``, ``x in ("none",
...)``) other than a device's ``.type``; a builtin's option name (``gpu_share``)
is an error as a whole literal. Schema defaults (``partitioner = "none"``) are
data, not branches, and are not compared, so they pass; what is left is in
`ALLOWED`, each with its reason.
"""

from __future__ import annotations

from tests.support.paths import REPO
import ast
import pathlib
import re

import attrs
import pytest

from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager
from zkernel.spec.registry import Family

ROOT = REPO
PACKAGES = ("zkernel/spec", "zkernel/kernel")
# Names of builtins that are also plain words, device types or config values of their own.
WORDS = {"none", "cpu", "device", "default", "linear", "cuda"}
# The schema's defaults: the builtin each section selects unless the user names another (a
# literal given as ``default=`` of a field). Data, not a branch.
SCHEMA_DEFAULTS = {"none", "adamw", "linear", "recompute", "default"}
# (file, the literal, the builtin name in it): why it may stay.
ALLOWED = {
    # The offload sections' default ("none": the tier that keeps everything on the device), which a
    # plan's description reads as "the compute device".
    ("zkernel/spec/planner.py", "none", "none"): "the offload sections' schema default, for people",
    # Places, as memory_report and the estimates name them (host memory, disk), not tier names.
    ("zkernel/spec/sizing.py", "nvme", "nvme"): "the disk place of PLACES",
    ("zkernel/kernel/sizing.py", "cpu", "cpu"): "the host-memory place and device type",
    # activation_checkpointing.offload's own value "cpu" (a section key's choice, not a tier).
    ("zkernel/spec/planner.py", "cpu", "cpu"): "activation_checkpointing.offload = 'cpu'",
}


def _builtins() -> tuple[set[str], set[str]]:
    """(names of the builtin components, names of their own options), from the entry points."""
    installed = get_plugin_manager(autoload=False)
    registry = collect_components(installed)
    names, options = set(), set()
    for family in Family:
        for component in registry.components(family):
            if installed.sources[component.plugin_name].distribution != "zkernel":
                continue
            names.add(component.name)
            classes = component.options_cls.values() if isinstance(component.options_cls, dict) else [component.options_cls]
            for cls in classes:
                if cls is not None:
                    options.update(a.name for a in attrs.fields(cls))
    # A section's own key is the schema's, whichever component also takes it.
    from zkernel.spec.config import Config

    schema = {a.name for a in attrs.fields(Config)}
    for family in Family:
        schema.update(family.section_keys())
    return names, options - schema


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _compared(tree: ast.AST) -> set[int]:
    """Ids of string literals compared with something that is not a device's ``.type``."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides):
            continue
        for side in sides:
            for sub in ast.walk(side):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    out.add(id(sub))
    return out


def _defaults(tree: ast.AST) -> set[int]:
    """Ids of string literals given as a field's ``default=`` that name a schema default."""
    return {
        id(kw.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg == "default" and isinstance(kw.value, ast.Constant) and kw.value.value in SCHEMA_DEFAULTS
    }


def offences(root: pathlib.Path, names: set[str], options: set[str]) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text())
            docs, compared = _docstrings(tree) | _defaults(tree), _compared(tree)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    modules = [getattr(node, "module", None) or "", *(a.name for a in node.names)]
                    if any(m.split(".")[0] == "zkernel_plugins" for m in modules):
                        found.append(f"{rel}:{node.lineno}: imports a builtin plugin")
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
                    continue
                words = set(re.findall(r"[A-Za-z0-9_]+", node.value))
                hits = {w for w in words & names if w not in WORDS}
                if id(node) in compared and node.value in names:
                    hits.add(node.value)
                if node.value in options:
                    hits.add(node.value)
                for hit in sorted(hits):
                    if (rel, node.value, hit) not in ALLOWED:
                        found.append(f"{rel}:{node.lineno}: names builtin {hit!r} in {node.value[:80]!r}")
    return found


def test_spec_and_kernel_name_no_builtin():
    names, options = _builtins()
    assert {"zero1", "zero2", "zero3", "nvme", "cpu", "adamw", "cpu_adam"} <= names
    assert "gpu_share" in options
    found = offences(ROOT, names, options)
    assert not found, "the kernel names builtins (declare the rule on the component instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("code", "hit"),
    [
        ('if cfg.partitioner == "zero3":\n    pass\n', "zero3"),
        ('raise ValueError("valid: adamw, cpu_adam")\n', "cpu_adam"),
        ('if tier in ("none", "auto"):\n    pass\n', "none"),
        ('SPILLS = ("gpu_share",)\n', "gpu_share"),
        ('name = attrs.field(default="zero3")\n', "zero3"),
        ("from zkernel_plugins.partitioners import zero3\n", "imports a builtin plugin"),
    ],
)
def test_the_scan_catches_a_builtin_name(tmp_path, code, hit):
    names, options = _builtins()
    target = tmp_path / "zkernel" / "kernel"
    target.mkdir(parents=True)
    (tmp_path / "zkernel" / "spec").mkdir()
    (target / "mod.py").write_text('"""A docstring may say zero3."""\nx = torch.device("cpu")\n' + code)
    found = offences(tmp_path, names, options)
    assert found and all(hit in line for line in found), found
