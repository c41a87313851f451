"""Shared test set-up: skip CUDA-marked tests where there is no GPU and slow ones unless asked; show zkernel's debug events on demand."""

from __future__ import annotations

import logging

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # `slow` tests run only when the marker expression names them (`-m slow`, `-m "slow or not slow"`).
    if "slow" not in config.getoption("markexpr"):
        skip_slow = pytest.mark.skip(reason="slow: run with -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def zkernel_debug_logs():
    """The ``zkernel`` logger at DEBUG for one test (its level gates events before any processor runs)."""
    logger = logging.getLogger("zkernel")
    saved = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield logger
    finally:
        logger.setLevel(saved)


@pytest.fixture
def restore_zkernel_logger():
    """Undo `zkernel.cli.commands.configure_logging` after a test: the logger's level and handlers, structlog's config."""
    import structlog

    logger = logging.getLogger("zkernel")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    try:
        yield logger
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
