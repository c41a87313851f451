"""zkernel logs like a library: through the `logging` logger ``zkernel``, quiet unless asked."""

from __future__ import annotations

import json
import logging
import os

import pytest
import structlog
import torch
from structlog.testing import capture_logs

from tests.support.harness import run_ranks
from tests.support.scenarios import user_program
from zkernel.cli.commands import configure_logging
from zkernel.telemetry.log import get_logger


@pytest.fixture
def unconfigured_structlog():
    """structlog as a program that never configured it has it (other tests may have configured it)."""
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_nothing_below_warning_shows_without_logging_config(unconfigured_structlog, capsys):
    log = get_logger("zkernel.test")
    log.debug("zkernel.test.debug", x=1)
    log.info("zkernel.test.info", x=2)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert not logging.getLogger("zkernel").isEnabledFor(logging.INFO)


def test_events_are_stdlib_records_with_fields_and_context(unconfigured_structlog, caplog):
    caplog.set_level(logging.DEBUG, logger="zkernel")
    with structlog.contextvars.bound_contextvars(rank=1, step=7):
        get_logger().debug("zkernel.fetch.done", group="block.0", nbytes=4096, tier="cpu")
    (record,) = [r for r in caplog.records if r.name == "zkernel"]
    assert record.levelno == logging.DEBUG
    assert record.getMessage() == "zkernel.fetch.done group=block.0 nbytes=4096 rank=1 step=7 tier=cpu"
    caplog.clear()
    try:
        raise KeyError("lost")
    except KeyError:
        get_logger().exception("zkernel.test.failed", path="/a b")
    (record,) = caplog.records
    assert record.getMessage() == "zkernel.test.failed path='/a b'"
    assert record.exc_info and record.exc_info[0] is KeyError


def test_logger_level_gates_before_any_processor_runs(restore_zkernel_logger):
    seen = []

    def count(_logger, _method, event_dict):
        seen.append(event_dict["event"])
        raise structlog.DropEvent

    structlog.configure(processors=[count])
    log = get_logger("zkernel.sub")
    log.debug("zkernel.test.hidden")
    log.warning("zkernel.test.shown")
    assert seen == ["zkernel.test.shown"]
    restore_zkernel_logger.setLevel(logging.DEBUG)
    log.debug("zkernel.test.now_shown")
    assert seen[-1] == "zkernel.test.now_shown"


def test_capture_logs_sees_key_value_events(zkernel_debug_logs):
    with capture_logs() as logs:
        get_logger().info("zkernel.test.event", nbytes=3, tier="nvme")
        get_logger("zkernel.trace").debug("zkernel.hook.trace", msg="x")
    assert logs == [
        {"event": "zkernel.test.event", "nbytes": 3, "tier": "nvme", "log_level": "info"},
        {"event": "zkernel.hook.trace", "msg": "x", "log_level": "debug"},
    ]


def test_a_structlog_configured_application_renders_zkernel_events(restore_zkernel_logger, capsys):
    """The application's structlog chain and stdlib handlers apply to zkernel's events as to its own."""
    configure_logging(json_output=True, rank=2)
    get_logger().debug("zkernel.test.hidden")
    with structlog.contextvars.bound_contextvars(step=4):
        get_logger("zkernel.engine").info("zkernel.test.shown", nbytes=5)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    event = json.loads(lines[0])
    assert event["event"] == "zkernel.test.shown"
    assert (event["rank"], event["step"], event["nbytes"], event["level"]) == (2, 4, 5, "info")

    configure_logging(verbose=True)  # replaces the handler: one line per event
    get_logger().debug("zkernel.test.verbose", k="v")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "zkernel.test.verbose" in lines[0] and "k=v" in lines[0], lines


def test_logger_names_stay_under_zkernel():
    with pytest.raises(ValueError, match="start with 'zkernel'"):
        get_logger("mylib")


def test_a_plain_program_on_two_ranks_prints_nothing_unless_it_asks(monkeypatch, capfd):
    """Two spawned ranks (fresh interpreters) run the user's program; their output is what they
    write to the file descriptors they inherit from this process, which capfd reads."""
    for name in [k for k in os.environ if k.startswith(("ZKERNEL_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))]:
        monkeypatch.delenv(name)
    capfd.readouterr()
    run_ranks(2, user_program, False, timeout=120, fresh=True)
    quiet_out, quiet_err = capfd.readouterr()
    assert quiet_out == "" and quiet_err == "", (quiet_out, quiet_err)

    run_ranks(2, user_program, True, timeout=120, fresh=True)  # with logging.basicConfig(level=DEBUG)
    loud_out, loud_err = capfd.readouterr()
    assert loud_out == "", loud_out
    lines = loud_err.splitlines()
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"  # as run_ranks places them
    for rank in (0, 1):
        assert f"DEBUG:zkernel:zkernel.dist.init backend={backend} rank={rank} world_size=2" in lines, loud_err
        assert any(line.startswith("INFO:zkernel:zkernel.initialized") and f"rank={rank}" in line for line in lines)
        # Per-step context bound by the engine (structlog.contextvars) reaches the stdlib record.
        assert any(
            line.startswith("INFO:zkernel:zkernel.step.skipped") and f"rank={rank} reason='fp16 overflow' step=0" in line
            for line in lines
        ), loud_err
