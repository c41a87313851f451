#!/usr/bin/env bash
# Shared set-up of scripts/demo.sh and scripts/test.sh: install zkernel, and torch if it is missing.
# Sourced with PYTHON set; run from the repository root.
#
# `pip install -e ".[test]"` compiles the native extension (about 30 s), so it is
# skipped when the installed build is current: build/install-stamps/ holds, per
# Python environment, a fingerprint of everything the build depends on (native/*,
# setup.py, pyproject.toml, the file list of zkernel/ and plugins/, the
# interpreter), written after an install that imports; the build is current when
# the fingerprint matches, `import zkernel._native` works and that zkernel is
# this checkout's. A fresh clone has no stamp, so it installs everything.
"$PYTHON" -m pip --version >/dev/null 2>&1 || "$PYTHON" -m ensurepip --upgrade
# A GPU machine has torch preinstalled; a plain `torch` requirement would pull
# GBs of CUDA wheels, so only a missing torch is installed, at a pinned version.
# (Looked up, not imported: importing torch takes seconds.)
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" >/dev/null 2>&1; then
    "$PYTHON" -m pip install "torch==2.13.0"
fi

# Prints the fingerprint and the stamp file of this Python environment.
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
# One stamp per Python environment, so two environments do not rebuild each other's.
print(h.hexdigest(), "build/install-stamps/" + hashlib.sha256(sys.prefix.encode()).hexdigest()[:16])
PY
}

zkernel_imports_here() {
    "$PYTHON" - <<'PY' >/dev/null 2>&1
import importlib.metadata, pathlib
import pytest  # the [test] extra
import zkernel, zkernel._native, zkernel_plugins
here = (pathlib.Path.cwd() / "zkernel").resolve()
assert pathlib.Path(zkernel.__file__).resolve().parent == here
assert pathlib.Path(zkernel._native.__file__).resolve().parent == here
# zkernel imports from the working directory; the plugins only through the install's path mapping.
assert pathlib.Path(zkernel_plugins.__file__).resolve().parent == (pathlib.Path.cwd() / "plugins").resolve()
importlib.metadata.version("zkernel")  # entry points of the builtin plugins are registered
PY
}

zkernel_check_compiler() {
    local cxx="${CXX:-$("$PYTHON" -c 'import sysconfig; print((sysconfig.get_config_var("CXX") or "c++").split()[0])')}"
    if ! printf '#include <optional>\nint main() { std::optional<int> x = 0; if constexpr (sizeof(int) > 0) return *x; }\n' \
        | "$cxx" -std=c++17 -fsyntax-only -x c++ - >/dev/null 2>&1; then
        echo "scripts/install.sh: zkernel's native extension (pybind11) needs a C++17 compiler, and '$cxx' is" \
             "not one (not found, or without C++17). Install one (Debian/Ubuntu: apt-get install g++;" \
             "Fedora: dnf install gcc-c++; macOS: xcode-select --install) or set CXX to one, then run again." >&2
        return 1
    fi
}

read -r zkernel_expected zkernel_stamp_file < <(zkernel_fingerprint)
if [ -f "$zkernel_stamp_file" ] && [ "$(cat "$zkernel_stamp_file")" = "$zkernel_expected" ] && zkernel_imports_here; then
    echo "scripts/install.sh: the installed zkernel build is current; skipping pip install" >&2
else
    zkernel_check_compiler || exit 1
    rm -f "$zkernel_stamp_file"
    # Builds the native pybind11 extension (build isolation on).
    "$PYTHON" -m pip install -e ".[test]"
    if zkernel_imports_here; then
        mkdir -p "$(dirname "$zkernel_stamp_file")"
        echo "$zkernel_expected" > "$zkernel_stamp_file"
    fi
fi
