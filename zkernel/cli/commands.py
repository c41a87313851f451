"""The ``zkernel`` command: ``plugins``, ``demo``, ``config``, ``estimate``, ``consolidate``.

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


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


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
    print(_table(("FAMILY", "NAME", "PLUGIN", "ORIGIN", "DISTRIBUTION", "DESCRIPTION"), rows))
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


# -- zkernel estimate -------------------------------------------------------------

def parse_size(text: str) -> int:
    """Bytes from ``"80GiB"``, ``"1.5TB"``, ``"512e6"`` (an argparse type)."""
    from zkernel.platform.sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def format_size(nbytes: int | None) -> str:
    """A table cell: `zkernel.platform.sizes.format_bytes`, ``"?"`` for unknown, ``"-"`` for nothing."""
    from zkernel.platform.sizes import format_bytes

    if nbytes is None:
        return "?"
    return "-" if nbytes == 0 else format_bytes(nbytes)


def _estimate_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """(what to estimate, the transformer shape or None) from the command line."""
    from zkernel.spec.config import ConfigError
    from zkernel.sizing.model_shape import TransformerShape

    numbers = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "sequence")}
    given = [k for k, v in numbers.items() if v is not None]
    if args.model and given:
        raise ConfigError(f"give either MODEL or the transformer's numbers, not both (got MODEL and --{given[0]})")
    if args.model:
        return args.model, None
    missing = [k for k, v in numbers.items() if v is None]
    if missing:
        raise ConfigError(
            "give MODEL (an import path 'pkg.mod:factory') or a transformer's numbers; missing: "
            + ", ".join(f"--{k}" for k in missing)
        )
    shape = TransformerShape(
        **numbers,
        style=args.style,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        tied_embeddings=not args.untied,
    )
    return shape, shape


def cmd_estimate(args: argparse.Namespace) -> int:
    import attrs

    from zkernel.kernel.config_source import load_config
    from zkernel.platform.machine import machine_capacity
    from zkernel.sizing.estimator import answering_tiers, estimate_table, installed_tiers, shortfalls, totals
    from zkernel.sizing.model_shape import as_module, estimate_activations

    config = load_config(args.config)
    if args.precision:
        config = attrs.evolve(config, precision=args.precision)
    if args.nvme_path:
        config = attrs.evolve(config, offload=attrs.evolve(config.offload, nvme_path=args.nvme_path))
    model, shape = _estimate_model(args)
    module = as_module(model)
    detected = machine_capacity(config.offload.nvme_path)
    capacity = attrs.evolve(
        detected,
        gpus=detected.gpus if args.gpus is None else args.gpus,
        device_bytes=args.gpu_memory if args.gpu_memory is not None else detected.device_bytes,
        host_bytes=args.ram if args.ram is not None else detected.host_bytes,
        disk_bytes=args.disk if args.disk is not None else detected.disk_bytes,
    )
    device = "cuda" if capacity.gpus else "cpu"
    world = args.world_size or max(1, capacity.gpus)
    per_machine = min(world, capacity.gpus) if capacity.gpus else world
    numel = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    what = f"{shape.style}-like transformer" if shape is not None else str(model)
    print(f"zkernel estimate: {what}, {numel:,} parameters ({trainable:,} trainable), {config.precision}, {world} rank(s)")
    gpu_text = f"{capacity.gpus} GPU(s) x {format_size(capacity.device_bytes)}" if capacity.gpus else "no GPU (compute on CPU)"
    disk_text = f"{format_size(capacity.disk_bytes)} free at {config.offload.nvme_path}" if config.offload.nvme_path else "no nvme_path"
    print(f"machine: {gpu_text}, RAM {format_size(capacity.host_bytes)} available, disk {disk_text}; {per_machine} rank(s) on it")

    activations = ckpt = None
    tiled = args.tiled_loss or config.planner.tiled_loss
    if shape is not None and args.micro_batch:
        activations = estimate_activations(shape, args.micro_batch, precision=config.precision, tiled_loss=tiled)["total"]
        ckpt = estimate_activations(
            shape, args.micro_batch, precision=config.precision, checkpointing=True, tiled_loss=tiled
        )["total"]

    rows = estimate_table(module, config, world, device=device)
    places = [device] + [p for p in ("cpu", "nvme") if p != device and any(p in totals(r.report) for r in rows)]
    table = []
    for row in rows:
        states = totals(row.report)
        fit = "yes"
        if shortfalls(states, capacity, per_machine, device):
            fit = "no (" + ", ".join(shortfalls(states, capacity, per_machine, device)) + ")"
        elif activations is not None:
            with_acts = dict(states, **{device: states.get(device, 0) + activations})
            with_ckpt = dict(states, **{device: states.get(device, 0) + ckpt})
            if not shortfalls(with_acts, capacity, per_machine, device):
                fit = "yes"
            elif not shortfalls(with_ckpt, capacity, per_machine, device):
                fit = "with checkpointing"
            else:
                fit = "no (activations)"
        table.append(
            (
                row.partitioner,
                f"{row.offload_optimizer}/{row.offload_params}",
                *(format_size(sum(row.report[c].values())) for c in ("params", "grads", "master_weights", "optimizer_state")),
                *(format_size(states.get(p, 0)) for p in places),
                fit,
            )
        )
    print("\nmodel states per rank (grads at their peak, after backward):")
    header = ("PARTITIONER", "OFFLOAD OPT/PARAMS", "PARAMS", "GRADS", "MASTER", "OPTIM STATE", *(p.upper() for p in places), "FITS")
    print(_table(header, table))
    if activations is not None:
        print(
            f"\nactivations per rank, ESTIMATE (saved for backward; micro-batch {args.micro_batch} x sequence "
            f"{shape.sequence}, {config.precision}{', the loss tiled' if tiled else ''}): "
            f"{format_size(activations)} without checkpointing, "
            f"{format_size(ckpt)} with every block checkpointed; FITS adds them to {device}"
        )
    else:
        print("\nFITS counts model states only (activations: give the transformer's numbers and --micro-batch)")
    listed = {name for row in rows for name in (row.offload_optimizer, row.offload_params)}
    silent = [t for t in installed_tiers(config) if t not in listed and t not in answering_tiers("optimizer", config) + answering_tiers("params", config)]
    if silent:
        print(f"not estimated: offload tier(s) {', '.join(silent)} (their plugins do not answer zkernel_size_offload_tier)")
    if args.plan:
        return _print_plan(module if shape is None else shape, config, world, args)
    return 0


def _print_plan(model: Any, config: Any, world: int, args: argparse.Namespace) -> int:
    """``estimate --plan``: what ``"auto"`` would choose here, measured, with the machine flags as overrides."""
    import attrs

    from zkernel.platform.sizes import format_bytes
    from zkernel.spec.planner import PlacementError
    from zkernel.sizing.planning import plan

    planner = attrs.evolve(
        config.planner,
        micro_batch=args.micro_batch if args.micro_batch is not None else config.planner.micro_batch,
        tiled_loss=args.tiled_loss or config.planner.tiled_loss,
        gpu_memory=args.gpu_memory if args.gpu_memory is not None else config.planner.gpu_memory,
        ram=args.ram if args.ram is not None else config.planner.ram,
        disk=args.disk if args.disk is not None else config.planner.disk,
    )
    try:
        decision = plan(model, attrs.evolve(config, planner=planner), world, gpus=args.gpus)
    except PlacementError as exc:
        print(f"\nplacement plan: {exc}")
        return 1
    print(f"\nplacement plan (planner {decision.planner!r}, {world} rank(s)): {decision.placement}")
    for place, kinds in decision.bytes.items():
        parts = ", ".join(f"{kind.replace('_', ' ')} {format_bytes(n)}" for kind, n in kinds.items() if n)
        budget = decision.budgets.get(place)
        print(f"  {place}: {format_bytes(sum(kinds.values()))} per rank of {format_bytes(budget)} usable ({parts or 'nothing'})")
    units = {"host_to_device": "B", "device_to_host": "B", "disk_write": "B", "disk_read": "B", "cpu_adam": " elements"}
    measured = ", ".join(f"{name.replace('_', ' ')} {probe.text(units.get(name, ''))}" for name, probe in decision.measurements.items())
    print(f"  measured: {measured}")
    if decision.predicted_seconds:
        seconds = ", ".join(f"{name.replace('_', ' ')} {value:.3f} s" for name, value in decision.predicted_seconds.items())
        print(f"  predicted per optimizer step: {seconds}")
    for line in decision.rejected:
        print(f"  does not fit: {line}")
    for note in decision.notes:
        print(f"  note: {note}")
    return 0


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
        "partitioner and installed offload tier, without allocating the model, and mark what fits on this "
        "machine. The model is MODEL (an import path 'pkg.mod:factory', built on the meta device) or a "
        "transformer's numbers (--layers --hidden --heads --vocab --sequence).",
    )
    est.add_argument("model", nargs="?", default=None, metavar="MODEL", help="import path pkg.mod:factory of a function returning the nn.Module")
    est.add_argument("--config", default=None, help="a zkernel or DeepSpeed config (.json/.toml): precision, partitioner options, nvme_path")
    est.add_argument("--world-size", type=int, default=None, help="ranks (default: the GPUs here, else 1)")
    est.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None, help="override the config's precision")
    shape = est.add_argument_group("transformer numbers (instead of MODEL)")
    for name in ("layers", "hidden", "heads", "vocab", "sequence"):
        shape.add_argument(f"--{name}", type=int, default=None)
    shape.add_argument("--style", choices=("gpt", "llama"), default="gpt", help="gpt: LayerNorm, fused qkv, 4x GELU MLP, learned positions; llama: RMSNorm, q/k/v/o, SwiGLU, rotary")
    shape.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention; llama)")
    shape.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 4 x hidden for gpt, 8/3 x hidden rounded to 256 for llama)")
    shape.add_argument("--untied", action="store_true", help="the output head has its own weight (default: tied to the embedding)")
    shape.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per micro-batch: also estimate activations")
    shape.add_argument(
        "--tiled-loss",
        action="store_true",
        help="the model takes its loss with zkernel.tiled_cross_entropy: the head keeps no logits ([planner] tiled_loss)",
    )
    machine = est.add_argument_group("machine (detected; these override)")
    machine.add_argument("--gpus", type=int, default=None, help="GPUs on this machine")
    machine.add_argument("--gpu-memory", type=parse_size, default=None, metavar="SIZE", help="memory per GPU, e.g. 80GiB")
    machine.add_argument("--ram", type=parse_size, default=None, metavar="SIZE", help="available CPU memory (default: MemAvailable)")
    machine.add_argument("--disk", type=parse_size, default=None, metavar="SIZE", help="free disk at nvme_path")
    machine.add_argument("--nvme-path", default=None, help="where an nvme tier would write (overrides the config's offload.nvme_path)")
    est.add_argument(
        "--plan",
        action="store_true",
        help="also show what partitioner/offload = \"auto\" would choose here (capacities and bandwidths measured; "
        "the machine flags override what is detected)",
    )
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
