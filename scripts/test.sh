#!/usr/bin/env bash
# Install zkernel with its test extras (and torch, if it is not importable yet), then run the tests.
# Usage: bash scripts/test.sh [pytest arguments, e.g. -k cli -x]
# Installs into PYTHON=/path/to/python when set, else the active virtual environment's python
# ($VIRTUAL_ENV), else python3 (see scripts/install.sh). Needs a C++17 compiler (checked first).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ZKERNEL_EXTRAS=test
source scripts/install.sh

status=0
"$PYTHON" -m pytest -q "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
fi
exit "$status"
