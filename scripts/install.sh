#!/usr/bin/env bash
# Shared set-up of scripts/demo.sh and scripts/test.sh: install zkernel, and torch if it is missing.
# Sourced from the repository root, with ZKERNEL_EXTRAS naming the extras to install with zkernel
# ("test" for scripts/test.sh; empty or unset for scripts/demo.sh, which needs none of them).
#
# Which Python (and so which environment) it installs into:
#   PYTHON=/path/to/python   that interpreter, whatever else is set;
#   else, in an active virtual environment ($VIRTUAL_ENV set), $VIRTUAL_ENV/bin/python;
#   else python3, the first on PATH (a note on stderr recommends a virtual environment:
#   python3 -m venv .venv && . .venv/bin/activate).
#
# Nothing is installed before the C++17 compiler the native extension needs is found: without
# one the scripts stop at once with what to install (or set CXX to a compiler).
#
# `pip install -e .` compiles the native extension (about 30 s), so it is skipped when the
# installed build is current: build/install-stamps/ holds, per Python environment and per set of
# extras, a fingerprint of everything the build depends on (native/*, setup.py, pyproject.toml,
# the file list of zkernel/ and plugins/, the interpreter), written after an install that
# imports; the build is current when the fingerprint matches, `import zkernel._native` works and
# that zkernel is this checkout's. An install with extras also serves the plain one (no extras),
# not the other way round. A fresh clone has no stamp, so it installs everything.

# The interpreter to install into (see the header).
zkernel_python() {
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
    elif [ -n "${VIRTUAL_ENV:-}" ]; then
        echo "$VIRTUAL_ENV/bin/python"
    else
        echo python3
    fi
}

PYTHON="$(zkernel_python)"
ZKERNEL_EXTRAS="${ZKERNEL_EXTRAS:-}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "scripts/install.sh: no Python at '$PYTHON' (set PYTHON to an interpreter, or activate a virtual environment)" >&2
    exit 1
fi

# Fails, with what to install, unless CXX (default: the compiler Python was built with) compiles C++17.
zkernel_check_compiler() {
    local cxx="${CXX:-$("$PYTHON" -c 'import sysconfig; print((sysconfig.get_config_var("CXX") or "c++").split()[0])' 2>/dev/null || echo c++)}"
    if ! printf '#include <optional>\nint main() { std::optional<int> x = 0; if constexpr (sizeof(int) > 0) return *x; }\n' \
        | "$cxx" -std=c++17 -fsyntax-only -x c++ - >/dev/null 2>&1; then
        echo "scripts/install.sh: zkernel's native extension (pybind11) needs a C++17 compiler, and '$cxx' is" \
             "not one (not found, or without C++17). Install one (Debian/Ubuntu: apt-get install g++;" \
             "Fedora: dnf install gcc-c++; macOS: xcode-select --install) or set CXX to one, then run again." \
             "Nothing was installed." >&2
        return 1
    fi
}

# Prints the fingerprint and this Python environment's stamp prefix (a stamp: PREFIX-EXTRAS, or PREFIX-base).
zkernel_fingerprint() {
    "$PYTHON" - <<'PY'
import hashlib, pathlib, sys

h = hashlib.sha256(f"{sys.prefix}\n{sys.version}\n".encode())
for path in sorted(pathlib.Path("native").iterdir()) + [pathlib.Path("setup.py"), pathlib.Path("pyproject.toml")]:
    if path.is_file():
        h.update(f"{path}\n".encode() + path.read_bytes())
for top in ("zkernel", "plugins"):
    for path in sorted(pathlib.Path(top).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".so", ".pyd", ".pyc"):
            h.update(f"{path}\n".encode())
# Stamps per Python environment, so two environments do not rebuild each other's.
print(h.hexdigest(), "build/install-stamps/" + hashlib.sha256(sys.prefix.encode()).hexdigest()[:16])
PY
}

# Whether this checkout's zkernel (and the extras' test runner, when asked for) imports.
zkernel_imports_here() {
    ZKERNEL_EXTRAS="$ZKERNEL_EXTRAS" "$PYTHON" - <<'PY' >/dev/null 2>&1
import importlib.metadata, os, pathlib
if "test" in os.environ["ZKERNEL_EXTRAS"].split(","):
    import pytest
import zkernel, zkernel._native, zkernel_plugins
here = (pathlib.Path.cwd() / "zkernel").resolve()
assert pathlib.Path(zkernel.__file__).resolve().parent == here
assert pathlib.Path(zkernel._native.__file__).resolve().parent == here
# zkernel imports from the working directory; the plugins only through the install's path mapping.
assert pathlib.Path(zkernel_plugins.__file__).resolve().parent == (pathlib.Path.cwd() / "plugins").resolve()
importlib.metadata.version("zkernel")  # entry points of the builtin plugins are registered
PY
}

# Whether a stamp of prefix $1 that serves these extras holds fingerprint $2.
zkernel_stamp_current() {
    local stamp candidates=("$1-${ZKERNEL_EXTRAS:-base}")
    [ -z "$ZKERNEL_EXTRAS" ] && candidates+=("$1"-*)  # any extras include the plain install
    for stamp in "${candidates[@]}"; do
        if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$2" ]; then
            return 0
        fi
    done
    return 1
}

zkernel_install() {
    # $1: the stamp prefix, $2: the fingerprint. Called where `set -e` does not apply: each step checks.
    if [ "$PYTHON" = python3 ] && ! "$PYTHON" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)" >/dev/null 2>&1; then
        echo "scripts/install.sh: installing into $(command -v python3 || echo python3), outside any virtual" \
             "environment; to keep zkernel apart: python3 -m venv .venv && . .venv/bin/activate," \
             "or PYTHON=/path/to/python" >&2
    fi
    zkernel_check_compiler || return 1
    "$PYTHON" -m pip --version >/dev/null 2>&1 || "$PYTHON" -m ensurepip --upgrade || return 1
    # A GPU machine has torch preinstalled; a plain `torch` requirement would pull
    # GBs of CUDA wheels, so only a missing torch is installed, at a pinned version.
    # (Looked up, not imported: importing torch takes seconds.)
    if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" >/dev/null 2>&1; then
        "$PYTHON" -m pip install "torch==2.13.0" || return 1
    fi
    local target="."
    [ -n "$ZKERNEL_EXTRAS" ] && target=".[$ZKERNEL_EXTRAS]"
    rm -f "$1-${ZKERNEL_EXTRAS:-base}"
    # Builds the native pybind11 extension (build isolation on).
    "$PYTHON" -m pip install -e "$target" || return 1
    if zkernel_imports_here; then
        mkdir -p "$(dirname "$1")"
        echo "$2" > "$1-${ZKERNEL_EXTRAS:-base}"
    fi
}

read -r zkernel_expected zkernel_stamps < <(zkernel_fingerprint)
if zkernel_stamp_current "$zkernel_stamps" "$zkernel_expected" && zkernel_imports_here; then
    echo "scripts/install.sh: the installed zkernel build is current; skipping pip install" >&2
else
    zkernel_install "$zkernel_stamps" "$zkernel_expected" || exit 1
fi
