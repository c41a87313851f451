#!/usr/bin/env bash
# Shared set-up of scripts/demo.sh and scripts/test.sh: install zkernel, and torch if it is missing.
# Sourced with PYTHON set; run from the repository root.
"$PYTHON" -m pip --version >/dev/null 2>&1 || "$PYTHON" -m ensurepip --upgrade
# A GPU machine has torch preinstalled; a plain `torch` requirement would pull
# GBs of CUDA wheels, so only a missing torch is installed, at a pinned version.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install "torch==2.13.0"
fi
# Builds the native pybind11 extension (build isolation on).
"$PYTHON" -m pip install -e ".[test]"
