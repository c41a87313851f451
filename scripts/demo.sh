#!/usr/bin/env bash
# Install zkernel (and torch, if it is not importable yet; no test extras), then run the demo.
# Usage: bash scripts/demo.sh [zkernel demo options, e.g. --seconds 30 --partitioner zero2]
# Installs into PYTHON=/path/to/python when set, else the active virtual environment's python
# ($VIRTUAL_ENV), else python3 (see scripts/install.sh). Needs a C++17 compiler (checked first).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ZKERNEL_EXTRAS=""  # the demo needs none of the extras
source scripts/install.sh

exec "$PYTHON" -m zkernel.cli demo "$@"
