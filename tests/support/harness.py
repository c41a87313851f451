"""Run a function on N real gloo processes (forked from a server that imported torch once) and collect
each rank's result (or its traceback)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import multiprocessing as mp
from multiprocessing import forkserver
import os
import pickle
import socket
import sys
import tempfile
import traceback
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def too_few_gpus(world: int) -> bool:
    """Whether ``world`` ranks would have to share GPUs here (then they are shown none and use gloo)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() < world


def gpus_hidden_if_short(world: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for ``world`` launched ranks: with fewer GPUs than ranks,
    none visible, so the ranks form a gloo group on the CPU instead of sharing one GPU under NCCL."""
    env = dict(os.environ if env is None else env)
    if too_few_gpus(world):
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _preloaded_modules() -> list[str]:
    """What the fork server imports once for every rank: torch; torch._dynamo, which the first torch
    optimizer a process builds imports (torch.optim's constructors are wrapped to disable dynamo: with
    sympy and torch.distributed.tensor under it, about 1 s of a core on an idle machine, 2-5 s on a
    loaded one, per rank); zkernel's bootstrap (with structlog and rich under it) and the installed
    plugin modules, a third of a second per rank.

    [Note: preloaded rank modules] Importing runs no zkernel code (nothing happens at import: the
    plugin managers are built by `initialize`, the native library is loaded on first use) and starts
    no thread, so a rank forked with these modules in place starts as one that imports them itself.
    """
    plugins = sorted({ep.module for ep in importlib.metadata.entry_points(group="zkernel")})
    return ["torch", "torch.distributed", "torch._dynamo", "zkernel.kernel.bootstrap", *plugins]


def fork_server_context():
    """The multiprocessing context whose processes fork from one server per test session that imported
    torch and zkernel once (seconds of a core per process otherwise); `run_ranks` and
    tests/support/forked_script.py start their processes from it. The server is a fresh interpreter
    that never touches CUDA, so each rank still picks its devices.

    The server starts here, on the first call, in `_server_environment`.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preloaded_modules())
    with _server_environment():
        forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def _server_environment():
    """This process's environment, for a process started inside, with:

    * a fixed mmap threshold: freed large blocks go back to the OS, so a process's RSS tracks its live
      memory (glibc reads it at start; the fork server passes it to every process forked from it);
    * this process's ``sys.path`` as ``PYTHONPATH``: the fork server imports its preloaded modules
      before it takes the parent's path (Python 3.11), and they must be the ones a rank would import
      (zkernel from the checkout under test, not one installed elsewhere).
    """
    values = {"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _child(rank: int, world: int, port: int, out: str, fn, args, hide_gpus: bool, env: dict[str, str]) -> None:
    # A forkserver child has the server's environment, not the parent's at the time of the call.
    os.environ.clear()
    os.environ.update(env)
    if hide_gpus:  # before anything touches CUDA: zkernel then forms a gloo group on the CPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        result = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out).write_bytes(pickle.dumps(result))


def run_ranks(world: int, fn, *args, timeout: float = 300.0, fresh: bool = False) -> list:
    """``fn(*args)`` on ``world`` new processes forming a gloo group; results by rank.

    A rank that raises fails the call with its traceback; a hang is killed
    after ``timeout`` seconds and reported, never left behind. With a GPU per
    rank the ranks use them (zkernel picks NCCL); on a machine with fewer GPUs
    than ranks they see none and run on the CPU, as on a machine without one.
    ``fresh``: each rank a new interpreter that writes to this process's file descriptors as they
    are now (a forked rank writes where the server's pointed when it started).
    """
    hide_gpus = too_few_gpus(world)
    ctx = mp.get_context("spawn") if fresh else fork_server_context()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        env = dict(os.environ)
        procs = [ctx.Process(target=_child, args=(r, world, port, outs[r], fn, args, hide_gpus, env))
                 for r in range(world)]  # fmt: skip
        with _server_environment():  # for spawned ranks; forked ones have the server's
            for p in procs:
                p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} of {world} produced no result (hung: {hung}, exit {procs[r].exitcode})")
            status, value = pickle.loads(Path(path).read_bytes())
            if status == "error":
                raise RuntimeError(f"rank {r} of {world} failed:\n{value}")
            results.append(value)
        return results


def in_turn(calls: dict[str, tuple]) -> dict:
    """On a rank: each ``name: (fn, *args)`` of ``calls`` run in turn, their results by name.

    For `run_ranks`, so that a module's runs share one spawn where the ranks import something slow
    (transformers' Trainer: seconds per process); each run sets up and tears down what it uses.
    """
    return {name: fn(*args) for name, (fn, *args) in calls.items()}
