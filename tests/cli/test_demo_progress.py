"""The demo's training bar is for a person at a terminal: a log file gets none, a terminal does."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios

from zkernel.telemetry.progress import ENV

# A tiny model for about a second, one process (world size 1), no sample.
DEMO = [
    sys.executable, "-m", "zkernel.cli.demo", "--seconds", "1", "--d-model", "32", "--layers", "1",
    "--heads", "2", "--micro-batch", "2", "--seq-len", "16", "--sample-chars", "0",
    "--partitioner", "zero1", "--offload-optimizer", "none",
]  # fmt: skip
_LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", ENV)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}


def test_stderr_redirected_to_a_file_gets_no_bar(tmp_path):
    log = tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        result = subprocess.run(DEMO, stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env(), timeout=120)
    err = log.read_text()
    assert result.returncode == 0, err
    assert "loss: first" in result.stdout
    assert "zkernel.demo.trained" in err  # the log still reaches the file
    assert "training:" not in err and "\r" not in err, err


def test_a_terminal_gets_the_bar():
    master, slave = pty.openpty()
    # A terminal of 24 x 80 (a fresh pty has no size, and a bar of width 0 draws nothing).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        process = subprocess.Popen(DEMO, stdout=subprocess.DEVNULL, stderr=slave, env=_env())
        os.close(slave)
        seen = b""
        while True:
            ready, _, _ = select.select([master], [], [], 120)
            if not ready:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal's other end closed (Linux: EIO)
                break
            if not chunk:
                break
            seen += chunk
        assert process.wait(timeout=120) == 0, seen.decode(errors="replace")
    finally:
        os.close(master)
    assert b"training:" in seen, seen.decode(errors="replace")
