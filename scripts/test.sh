#!/usr/bin/env bash
# Install zkernel with its test extras (and torch, if it is not importable yet), then run the tests.
# Usage: bash scripts/test.sh [pytest arguments, e.g. -k cli -x]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m pip --version >/dev/null 2>&1 || "$PYTHON" -m ensurepip --upgrade
# A GPU machine has torch preinstalled; a plain `torch` requirement would pull
# GBs of CUDA wheels, so only a missing torch is installed, at a pinned version.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install "torch==2.13.0"
fi
# Builds the native pybind11 extension (build isolation on).
"$PYTHON" -m pip install -e ".[test]"

status=0
"$PYTHON" -m pytest -q "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
fi
exit "$status"
