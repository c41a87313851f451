"""Run a Python script as ``python script.py`` runs it, in a process forked from the ranks' fork server
(tests/support/harness.py), which imported torch and zkernel once, instead of a new interpreter that
imports them again (2-3 s of a core per script).

[Note: a forked script is a fresh process] The fork server is a fresh interpreter that has only
imported modules (it runs no zkernel code and never touches CUDA), so the child starts as a new
``python script.py`` would once those imports were done: its own environment, working directory,
``sys.argv``, the script's folder first on ``sys.path``, the script run as ``__main__``, the
``atexit`` handlers run at the end, stdout and stderr captured at the file descriptors (what the
script's own children write too) and its exit status (1 for an uncaught exception, whose traceback is
on stderr; the code of a ``SystemExit``). What differs is only what was imported already.
"""

from __future__ import annotations

import atexit
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.harness import fork_server_context


def _run_as_main(script: str, cwd: str, env: dict[str, str], stdout: str, stderr: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, fd)
        os.close(out)
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))
    if "OMP_NUM_THREADS" in env:  # read by a new interpreter when torch loads; the server had loaded it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()


def run_script(script: Path, *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``
    for a script that needs no new interpreter ([Note: a forked script is a fresh process]).

    Called by tests that run example scripts; returns the exit status and the captured output; raises
    `subprocess.TimeoutExpired` after ``timeout`` seconds, the process killed.
    """
    args = [sys.executable, str(script)]
    with tempfile.TemporaryDirectory() as tmp:
        stdout, stderr = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = fork_server_context().Process(target=_run_as_main, args=(str(script), str(cwd), dict(env), stdout, stderr))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(args, timeout, _read(stdout), _read(stderr))
        return subprocess.CompletedProcess(args, process.exitcode, _read(stdout), _read(stderr))


def _read(path: str) -> str:
    """What the child wrote there; nothing where it failed before it redirected its output."""
    return Path(path).read_text(errors="replace") if os.path.exists(path) else ""
