#!/usr/bin/env bash
# Install zkernel (and torch, if it is not importable yet), then run the demo.
# Usage: bash scripts/demo.sh [zkernel demo options, e.g. --seconds 30 --partitioner zero2]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"

source scripts/install.sh

exec "$PYTHON" -m zkernel.cli demo "$@"
