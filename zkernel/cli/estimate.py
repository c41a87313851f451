"""``zkernel estimate``: the memory table, the row ``"auto"`` would choose, and ``--plan``'s decision.

`cmd_estimate` prints, for a model given by an import path or a transformer's
numbers, every partitioner and offload combination's model-state bytes per
rank (`zkernel.sizing.estimator.estimate_table`) and whether it fits the
machine (this one, or the one ``--gpus/--gpu-memory/--ram/--disk`` describe).
The planner runs once (`zkernel.sizing.planning.plan`): the table marks its
choice in the AUTO column, and ``--plan`` shows the decision with the rates it
used, each said to be given (``--cpu-adam-rate`` and the like, for the
described machine) or measured here.

[Note: a row that offloads more and keeps more] Moving a role off the device
does not always free device memory: with the optimizer on the GPU, zero3's
fp32 master stays there (without parameter offload zero3 casts the parameters
it gathers from that master, and keeps no compute-dtype shard), so moving the
shards to host memory frees nothing on the GPU and adds a staging copy of each
update there before it is copied to the host. The table keeps such rows (they
are what that config does) and explains each under it, from the estimate's
bytes by role (`Row.roles`), next to the row that offloads less.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from zkernel.cli.table import text_table

# What each kind of buffer is (`zkernel.spec.sizing.Role` values), for the notes under the table.
ROLE_TEXT = {
    "param_full": "whole parameters",
    "param_shard": "parameter shards",
    "staging": "staging copies of each update",
    "master": "fp32 master weights",
    "grad_reduce": "whole fp32 gradients",
    "grad_landing": "fp32 gradient slices",
    "optimizer_state": "optimizer state",
}
# ``--<flag>`` -> the planner's rate (`zkernel.platform.machine.RATE_NAMES`), and its unit.
RATE_FLAGS = {
    "cpu_adam_rate": ("cpu_adam", "elements/s"),
    "disk_read": ("disk_read", "B/s"),
    "disk_write": ("disk_write", "B/s"),
    "host_to_device": ("host_to_device", "B/s"),
    "device_to_host": ("device_to_host", "B/s"),
}
_MACHINE_FLAGS = ("gpus", "gpu_memory", "ram", "disk")


def parse_size(text: str) -> int:
    """Bytes from ``"80GiB"``, ``"1.5TB"``, ``"512e6"`` (an argparse type)."""
    from zkernel.platform.sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_rate(text: str) -> float:
    """A positive rate per second: a number (``"2e9"``) or a size (``"25GB"``: bytes per second)."""
    try:
        value = float(text)
    except ValueError:
        value = float(parse_size(text))
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive rate per second")
    return value


def format_size(nbytes: int | None) -> str:
    """A table cell: `zkernel.platform.sizes.format_bytes`, ``"?"`` for unknown, ``"-"`` for nothing."""
    from zkernel.platform.sizes import format_bytes

    if nbytes is None:
        return "?"
    return "-" if nbytes == 0 else format_bytes(nbytes)


def add_estimate_arguments(est: argparse.ArgumentParser) -> None:
    """The options of ``zkernel estimate`` (called by `zkernel.cli.commands.build_parser`)."""
    est.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="import path pkg.mod:factory of a function returning the nn.Module (resolved from the "
        "current directory first, as `python -m` would)",
    )
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
    machine = est.add_argument_group("machine (detected; these override, describing another machine)")
    machine.add_argument("--gpus", type=int, default=None, help="GPUs on the machine")
    machine.add_argument("--gpu-memory", type=parse_size, default=None, metavar="SIZE", help="memory per GPU, e.g. 80GiB")
    machine.add_argument("--ram", type=parse_size, default=None, metavar="SIZE", help="available CPU memory (default: MemAvailable)")
    machine.add_argument("--disk", type=parse_size, default=None, metavar="SIZE", help="free disk at nvme_path")
    machine.add_argument("--nvme-path", default=None, help="where an nvme tier would write (overrides the config's offload.nvme_path)")
    rates = est.add_argument_group(
        "rates of the machine (measured here unless given; the predicted seconds of the plan use them)"
    )
    rates.add_argument("--cpu-adam-rate", type=parse_rate, default=None, metavar="RATE", help="CPU Adam elements per second, e.g. 2e9")
    rates.add_argument("--disk-read", type=parse_rate, default=None, metavar="RATE", help="disk read bytes per second at nvme_path, e.g. 6GB")
    rates.add_argument("--disk-write", type=parse_rate, default=None, metavar="RATE", help="disk write bytes per second at nvme_path")
    rates.add_argument("--host-to-device", type=parse_rate, default=None, metavar="RATE", help="host to GPU copy bytes per second, e.g. 50GB")
    rates.add_argument("--device-to-host", type=parse_rate, default=None, metavar="RATE", help="GPU to host copy bytes per second")
    est.add_argument(
        "--plan",
        action="store_true",
        help="also show why \"auto\" chooses the row it does here: budgets, rates and predicted seconds, the "
        "placements that do not fit",
    )


def _estimate_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """(what to estimate, the transformer shape or None) from the command line."""
    from zkernel.spec.config import ConfigError
    from zkernel.sizing.model_shape import TransformerShape

    numbers = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "sequence")}
    given = [k for k, v in numbers.items() if v is not None]
    if args.model and given:
        raise ConfigError(f"give either MODEL or the transformer's numbers, not both (got MODEL and --{given[0]})")
    if args.model:
        # As `python -m` would: a module in the current directory imports (the `zkernel`
        # script's own sys.path starts with its bin directory instead).
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
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


def _given_rates(args: argparse.Namespace) -> dict[str, float]:
    return {rate: getattr(args, flag) for flag, (rate, _) in RATE_FLAGS.items() if getattr(args, flag) is not None}


def _decide(model: Any, config: Any, world: int, args: argparse.Namespace) -> tuple[Any, str | None]:
    """(the planner's decision for the machine described, or None, and why there is none)."""
    import attrs

    from zkernel.sizing.planning import plan
    from zkernel.spec.config import ConfigError

    planner = attrs.evolve(
        config.planner,
        micro_batch=args.micro_batch if args.micro_batch is not None else config.planner.micro_batch,
        tiled_loss=args.tiled_loss or config.planner.tiled_loss,
        gpu_memory=args.gpu_memory if args.gpu_memory is not None else config.planner.gpu_memory,
        ram=args.ram if args.ram is not None else config.planner.ram,
        disk=args.disk if args.disk is not None else config.planner.disk,
    )
    try:
        return plan(model, attrs.evolve(config, planner=planner), world, gpus=args.gpus, rates=_given_rates(args)), None
    except ConfigError as exc:  # PlacementError included: nothing fits
        return None, str(exc)


def _row_name(row: Any) -> str:
    return f"{row.partitioner} {row.offload_optimizer}/{row.offload_params}"


def _on(row: Any, place: str) -> dict[str, int]:
    """Bytes of ``row`` on ``place`` by role (its value: "master", "staging", ...)."""
    return {role.value: by_place.get(place, 0) for role, by_place in row.roles.items()}


def _places(row: Any, role: str) -> dict[str, int]:
    """Bytes of ``row``'s buffers of ``role`` (a `Role` value) by place."""
    return next((dict(by_place) for r, by_place in row.roles.items() if r.value == role), {})


def offload_notes(rows: Sequence[Any], device: str) -> list[str]:
    """Rows that keep more off ``device`` than another row of the same partitioner and optimizer
    tier, but no less on it: each explained by role ([Note: a row that offloads more and keeps more])."""
    from zkernel.sizing.estimator import totals

    if device == "cpu":
        return []  # the compute device is host memory: nothing to free
    notes = []
    for row in rows:
        states = totals(row.report)
        away = sum(n for place, n in states.items() if place != device)
        peers = [
            other
            for other in rows
            if (other.partitioner, other.offload_optimizer) == (row.partitioner, row.offload_optimizer)
            and other.offload_params != row.offload_params
            and sum(n for place, n in totals(other.report).items() if place != device) < away
            and totals(other.report).get(device, 0) <= states.get(device, 0)
        ]
        if not peers:
            continue
        peer = min(peers, key=lambda other: totals(other.report).get(device, 0))
        mine, theirs = _on(row, device), _on(peer, device)
        deltas = {role: mine.get(role, 0) - theirs.get(role, 0) for role in {*mine, *theirs}}
        added = [f"{format_size(d)} of {ROLE_TEXT.get(role, role)}" for role, d in sorted(deltas.items()) if d > 0]
        saved = [f"{format_size(-d)} of {ROLE_TEXT.get(role, role)}" for role, d in sorted(deltas.items()) if d < 0]
        text = (
            f"note: {_row_name(row)} keeps no less on {device} than {_row_name(peer)} "
            f"({format_size(states.get(device, 0))} vs {format_size(totals(peer.report).get(device, 0))}) "
            f"although it moves the parameters off it"
        )
        if mine.get("master") or mine.get("optimizer_state"):
            text += f": the optimizer's fp32 master, gradients and state stay on {device} with the optimizer"
        if added:
            text += f"; on {device} it adds {', '.join(added)}"
        if deltas.get("staging", 0) > 0:
            homes = sorted(p for p, n in _places(row, "param_shard").items() if n and p != device)
            text += f" (the optimizer steps on {device} and stages each update there before it reaches the shards on {', '.join(homes) or 'the params tier'})"
        if saved:
            text += f" and saves {', '.join(saved)}"
        if not theirs.get("param_shard") and theirs.get("master"):
            text += f"; {_row_name(peer)} keeps no separate parameter shard (it gathers from the fp32 master)"
        better = [
            other
            for other in rows
            if other.partitioner == row.partitioner
            and other.offload_params == row.offload_params
            and totals(other.report).get(device, 0) < totals(peer.report).get(device, 0)
        ]
        if better:
            best = min(better, key=lambda other: totals(other.report).get(device, 0))
            text += f". To free {device}, offload the optimizer too: {_row_name(best)} keeps {format_size(totals(best.report).get(device, 0))} there"
        notes.append(text)
    return notes


def cmd_estimate(args: argparse.Namespace) -> int:
    """``zkernel estimate``: print the table (and ``--plan``'s decision); 0, or 1 when ``--plan`` finds nothing that fits."""
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
    decision, no_plan = _decide(module if shape is None else shape, config, world, args)
    chosen = (
        None if decision is None else (decision.partitioner, decision.offload_optimizer, decision.offload_params)
    )
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
                "*" if (row.partitioner, row.offload_optimizer, row.offload_params) == chosen else "",
                fit,
            )
        )
    print("\nmodel states per rank (grads at their peak, after backward):")
    header = ("PARTITIONER", "OFFLOAD OPT/PARAMS", "PARAMS", "GRADS", "MASTER", "OPTIM STATE", *(p.upper() for p in places), "AUTO", "FITS")
    print(text_table(header, table))
    if decision is not None:
        print(
            f"\nAUTO *: what partitioner/offload = \"auto\" would choose here (planner {decision.planner!r}): "
            f"{decision.placement}; it keeps a reserve FITS does not (--plan shows its budgets)"
        )
    else:
        print(f"\nAUTO: no row; the planner chose none: {no_plan}")
    if activations is not None:
        print(
            f"activations per rank, ESTIMATE (saved for backward; micro-batch {args.micro_batch} x sequence "
            f"{shape.sequence}, {config.precision}{', the loss tiled' if tiled else ''}): "
            f"{format_size(activations)} without checkpointing, "
            f"{format_size(ckpt)} with every block checkpointed; FITS adds them to {device}"
        )
    else:
        print("FITS counts model states only (activations: give the transformer's numbers and --micro-batch)")
    for note in offload_notes(rows, device):
        print(note)
    listed = {name for row in rows for name in (row.offload_optimizer, row.offload_params)}
    silent = [t for t in installed_tiers(config) if t not in listed and t not in answering_tiers("optimizer", config) + answering_tiers("params", config)]
    if silent:
        print(f"not estimated: offload tier(s) {', '.join(silent)} (their plugins do not answer zkernel_size_offload_tier)")
    if args.plan:
        return _print_plan(decision, no_plan, world, args)
    return 0


def _print_plan(decision: Any, no_plan: str | None, world: int, args: argparse.Namespace) -> int:
    """``estimate --plan``: the decision, with the budgets, the rates (given or measured here) and the seconds."""
    from zkernel.platform.sizes import format_bytes

    if decision is None:
        print(f"\nplacement plan: {no_plan}")
        return 1
    print(f"\nplacement plan (planner {decision.planner!r}, {world} rank(s)): {decision.placement}")
    for place, kinds in decision.bytes.items():
        parts = ", ".join(f"{kind.replace('_', ' ')} {format_bytes(n)}" for kind, n in kinds.items() if n)
        budget = decision.budgets.get(place)
        print(f"  {place}: {format_bytes(sum(kinds.values()))} per rank of {format_bytes(budget)} usable ({parts or 'nothing'})")
    units = {"host_to_device": "B", "device_to_host": "B", "disk_write": "B", "disk_read": "B", "cpu_adam": " elements"}
    given = {name: probe for name, probe in decision.measurements.items() if probe.reason == "given"}
    measured = {name: probe for name, probe in decision.measurements.items() if name not in given}
    if measured:
        text = ", ".join(f"{name.replace('_', ' ')} {probe.text(units.get(name, ''))}" for name, probe in measured.items())
        print(f"  measured: {text}")
    if given:
        text = ", ".join(f"{name.replace('_', ' ')} {probe.text(units.get(name, ''))}" for name, probe in given.items())
        print(f"  given: {text}")
    described = [f"--{flag.replace('_', '-')}" for flag in _MACHINE_FLAGS if getattr(args, flag) is not None]
    if described and any(probe.rate is not None for probe in measured.values()):
        flags = ", ".join(f"--{flag.replace('_', '-')}" for flag, (name, _) in RATE_FLAGS.items() if name in measured)
        print(
            f"  note: the measured rates are this machine's ({socket.gethostname()}, {os.cpu_count()} CPUs), not the "
            f"machine {'/'.join(described)} describe(s); give its own with {flags}"
        )
    if decision.predicted_seconds:
        seconds = ", ".join(f"{name.replace('_', ' ')} {value:.3f} s" for name, value in decision.predicted_seconds.items())
        print(f"  predicted per optimizer step: {seconds}")
    for line in decision.rejected:
        print(f"  does not fit: {line}")
    for note in decision.notes:
        print(f"  note: {note}")
    return 0
