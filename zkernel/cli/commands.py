"""The ``zkernel`` command: ``plugins``, ``demo``, ``config``, ``estimate`` (`zkernel.cli.estimate`), ``consolidate``.

The CLI is a front-end, so unlike the library it prints to stdout and
configures logging (`configure_logging`): zkernel's events as console text for
people or JSON lines (``--log-json``), INFO and above unless ``-v``, to
stderr, with the rank bound through `structlog.contextvars` in multi-process runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import structlog

from zkernel.cli.table import text_table
from zkernel.telemetry.log import get_logger

# Set by torchrun in every process it starts.
_TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
# Name of the stderr handler `configure_logging` puts on the ``zkernel`` logger.
_HANDLER_NAME = "zkernel.cli"


def configure_logging(*, json_output: bool = False, verbose: bool = False, rank: int | None = None) -> None:
    """Show zkernel's events on stderr, for a front-end process (the library itself never does this).

    Configures structlog for the standard library (see [Note: library logging]
    in `zkernel.telemetry.log`) and gives the ``zkernel`` logger one stderr handler that
    renders console text or JSON lines, at INFO, or DEBUG when ``verbose``.
    Calling it again replaces that handler.
    """
    level = logging.DEBUG if verbose else logging.INFO
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True) if json_output else structlog.processors.TimeStamper(fmt="%H:%M:%S"),
    ]
    if json_output:
        rendering: list[Any] = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        rendering = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *rendering],
            foreign_pre_chain=shared,
        )
    )
    logger = logging.getLogger("zkernel")
    for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the program's root handlers, if any, would print each event twice
    structlog.contextvars.clear_contextvars()
    if rank is not None:
        structlog.contextvars.bind_contextvars(rank=rank)


# -- zkernel plugins --------------------------------------------------------------


def cmd_plugins(args: argparse.Namespace) -> int:
    from zkernel.spec.config import Config
    from zkernel.kernel.plugin_manager import get_plugin_manager, list_components

    config = Config(plugins=tuple(args.plugin), blocked_plugins=tuple(args.block))
    installed = get_plugin_manager(config=config)
    rows = []
    for component, source in list_components(installed):
        dist = source.distribution or "-"
        if source.distribution and source.version:
            dist = f"{source.distribution} {source.version}"
        rows.append(
            (component.family.label, component.name, source.name, source.origin, dist, component.description)
        )
    print(text_table(("FAMILY", "NAME", "PLUGIN", "ORIGIN", "DISTRIBUTION", "DESCRIPTION"), rows))
    return 0


# -- zkernel demo -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The demo options, as command-line arguments for `python -m zkernel.cli.demo`."""
    out = [
        "--seconds", str(args.seconds),
        "--partitioner", args.partitioner,
        "--offload-optimizer", args.offload_optimizer,
        "--offload-params", args.offload_params,
        "--seed", str(args.seed),
        "--lr", str(args.lr),
        "--micro-batch", str(args.micro_batch),
        "--d-model", str(args.d_model),
        "--layers", str(args.layers),
        "--heads", str(args.heads),
        "--seq-len", str(args.seq_len),
    ]  # fmt: skip
    if args.sample_chars is not None:
        out += ["--sample-chars", str(args.sample_chars)]
    if args.short:
        out.append("--short")
    if args.meta_init is not None:
        out.append("--meta-init" if args.meta_init else "--no-meta-init")
    if args.log_json:
        out.append("--log-json")
    if args.verbose:
        out.append("--verbose")
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    from zkernel.cli.demo import __main__ as demo_program

    forwarded = _forwarded(args)
    if os.environ.get(_TORCHRUN_ENV) is not None:
        # Already one rank of a torchrun job: train here.
        return demo_program.main(forwarded)

    import torch

    gpu = torch.cuda.is_available()
    nproc = args.nproc or (torch.cuda.device_count() if gpu else 2)
    env = dict(os.environ)
    if not gpu:
        # One thread per rank: the ranks share the cores.
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()),
        "-m", "zkernel.cli.demo",
        *forwarded,
    ]  # fmt: skip
    get_logger("zkernel.cli").info(
        "zkernel.demo.launch", nproc=nproc, device="cuda" if gpu else "cpu"
    )
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


# -- zkernel config ---------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, os.PathLike):
        return _toml_value(os.fspath(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    import attrs

    if attrs.has(type(value)):  # an entry of a list of tables (optimizer.param_groups): its set fields
        return _toml_value({k: v for k, v in attrs.asdict(value, recurse=False).items() if v is not None})
    raise TypeError(f"cannot write {value!r} as TOML")


def config_to_toml(config: Any) -> str:
    """A `zkernel.Config` as TOML that `zkernel.kernel.config_source.load_config` reads back."""
    import attrs

    top, tables = [], []
    for field in attrs.fields(type(config)):
        value = getattr(config, field.name)
        if attrs.has(type(value)):
            lines = [f"[{field.name}]"]
            for sub in attrs.fields(type(value)):
                sub_value = getattr(value, sub.name)
                if sub.name == "options":
                    lines += [f"{k} = {_toml_value(v)}" for k, v in sub_value.items()]
                elif sub_value is None:
                    lines.append(f"# {sub.name} is unset")
                else:
                    lines.append(f"{sub.name} = {_toml_value(sub_value)}")
            tables.append("\n".join(lines))
        elif value is None:
            top.append(f"# {field.name} is unset")
        else:
            top.append(f"{field.name} = {_toml_value(dict(value) if isinstance(value, dict) else value)}")
    return "\n".join(top) + "\n\n" + "\n\n".join(tables) + "\n"


def cmd_config(args: argparse.Namespace) -> int:
    from zkernel.kernel.config_source import load_config

    # The structure only (every family's section, from its declaration): components' names and
    # options are checked at `initialize`, which loads the plugins (and torch, which this avoids).
    print(config_to_toml(load_config(args.path)), end="")
    return 0


# -- zkernel estimate: zkernel.cli.estimate ------------------------------------------

# The table's cell formatter and the size parser, where callers have imported them from.
from zkernel.cli.estimate import format_size, parse_size  # noqa: E402


# -- zkernel consolidate ------------------------------------------------------------


def cmd_consolidate(args: argparse.Namespace) -> int:
    from zkernel.checkpoint import CheckpointError, consolidate_to_file

    try:
        path = consolidate_to_file(args.directory, args.out, args.tag)
    except (CheckpointError, OSError) as exc:
        print(f"zkernel consolidate: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


# -- entry point ------------------------------------------------------------------


def _add_logging_options(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--log-json", action="store_true", default=default, help="log JSON lines to stderr")
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default, help="also show zkernel.* debug events"
    )


def build_parser() -> argparse.ArgumentParser:
    from zkernel import __version__
    from zkernel.cli.demo.arguments import add_training_arguments
    from zkernel.cli.estimate import add_estimate_arguments, cmd_estimate

    parser = argparse.ArgumentParser(
        prog="zkernel", description="ZeRO partitioning and offload for PyTorch, as a plugin microkernel."
    )
    parser.add_argument("--version", action="version", version=f"zkernel {__version__}")
    _add_logging_options(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plugins = sub.add_parser("plugins", help="list every installed component by family, with its plugin and distribution")
    plugins.add_argument("--plugin", action="append", default=[], metavar="MODULE", help="also load this plugin module (dotted path)")
    plugins.add_argument("--block", action="append", default=[], metavar="NAME", help="do not load the plugin of this name")
    _add_logging_options(plugins, default=argparse.SUPPRESS)
    plugins.set_defaults(func=cmd_plugins)

    demo = sub.add_parser("demo", help="train a small GPT for a minute (2 CPU processes, or all GPUs)")
    add_training_arguments(demo)
    demo.add_argument("--nproc", type=int, default=None, help="processes (default: all GPUs, else 2)")
    _add_logging_options(demo, default=argparse.SUPPRESS)
    demo.set_defaults(func=cmd_demo)

    config = sub.add_parser("config", help="print the default config (or the config in PATH, validated) as TOML")
    config.add_argument("path", nargs="?", default=None, help="a .json or .toml config to validate and print")
    _add_logging_options(config, default=argparse.SUPPRESS)
    config.set_defaults(func=cmd_config)

    est = sub.add_parser(
        "estimate",
        help="predict the memory per rank of a model for every partitioner and offload tier, and what fits here",
        description="Predict model-state bytes per rank (params, grads, master weights, optimizer state) for every "
        "partitioner and installed offload tier, without allocating the model, mark what fits on this "
        "machine (or the one the machine options describe) and the row \"auto\" would choose. The model is MODEL "
        "(an import path 'pkg.mod:factory', built on the meta device) or a transformer's numbers "
        "(--layers --hidden --heads --vocab --sequence).",
    )
    add_estimate_arguments(est)
    _add_logging_options(est, default=argparse.SUPPRESS)
    est.set_defaults(func=cmd_estimate)
    consolidate = sub.add_parser(
        "consolidate", help="write a checkpoint's full fp32 state dict to a safetensors file (no GPUs needed)"
    )
    consolidate.add_argument("directory", help="the checkpoint directory engine.save_checkpoint wrote")
    consolidate.add_argument("out", help="the .safetensors file to write")
    consolidate.add_argument("--tag", default=None, help="which checkpoint (default: the one 'latest' names)")
    _add_logging_options(consolidate, default=argparse.SUPPRESS)
    consolidate.set_defaults(func=cmd_consolidate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(json_output=args.log_json, verbose=args.verbose)
    from zkernel.spec.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, ImportError) as exc:
        print(f"zkernel {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
