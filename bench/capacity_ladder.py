"""The capacity ladder: the largest GPT-style model each placement holds on one machine, as the planner sizes it.

    python bench/capacity_ladder.py --gpu-memory 79GiB --ram 120GiB --disk 58GiB --micro-batch 8

For each placement of the ladder, the widths of ``--widths`` (heads = width / 128)
are tried with as many layers as the default planner (`zkernel.sizing.planning.plan`,
probes off) says still fit, found by bisection; the largest model over the widths
is the placement's row. The placements:

- ``plain``: one GPU, no offload. Sized as partitioner ``none`` in bf16 (bf16
  parameters, fp32 gradients, masters and Adam moments: 18 bytes per
  parameter), which is also what plain torch holds under autocast (fp32 weights,
  gradients and moments, 16 bytes, plus the bf16 copies autocast caches for the
  backward), with every block checkpointed as ``largest_model.py --plain
  --checkpoint`` runs it.
- ``optimizer_cpu``: zero3, ``offload.optimizer = "cpu"``, parameters on the GPU.
- ``params_cpu``: zero3, optimizer and parameters on the CPU.

  Both with the cpu tier's ``gpu_share`` of ``--gpu-shares`` that holds the most (the
  optimizer of the first-needed groups stays on the GPU, placed as zero3 adopts them).
- ``nvme``: every placement the planner knows, the NVMe tiers included (its shares sized).

Each row prints the ``bench/largest_model.py`` command that trains that model with that
placement, so a prediction is checked by training it (BENCHMARKS.md records both).
Capacities are the flags' (defaults: one H100 box); nothing is allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from zkernel.sizing.model_shape import TransformerShape
from zkernel.spec.planner import PlacementError
from zkernel.sizing.planning import plan
from zkernel.platform.sizes import format_bytes

VOCAB = 50304
SEQ = 1024
HEAD_DIM = 128

# name: (partitioner, offload.optimizer, offload.params, keys the planner chooses)
PLACEMENTS = {
    "plain": ("none", "none", "none", ()),
    "optimizer_cpu": ("zero3", "cpu", "none", ()),
    "params_cpu": ("zero3", "cpu", "cpu", ()),
    "nvme": ("auto", "auto", "auto", ("partitioner", "offload.optimizer", "offload.params")),
}


def _config(args, name: str, nvme_path: str, gpu_share: float) -> dict:
    partitioner, optimizer, params, _ = PLACEMENTS[name]
    offload = {"optimizer": optimizer, "params": params, "nvme_path": nvme_path}
    if optimizer == "cpu" and gpu_share:
        offload["optimizer_options"] = {"gpu_share": gpu_share}
    config = {
        "precision": "bf16",
        "partitioner": partitioner,
        "offload": offload,
        "planner": {
            "gpu_memory": args.gpu_memory, "ram": args.ram, "disk": args.disk,
            "micro_batch": args.micro_batch, "sequence": SEQ, "options": {"measure": False},
        },
    }
    if name == "plain":
        config["activation_checkpointing"] = {"modules": ["_Block"]}
    return config


def _shape(width: int, layers: int) -> dict:
    return {"layers": layers, "hidden": width, "heads": width // HEAD_DIM, "vocab": VOCAB, "sequence": SEQ}


def _fits(args, name: str, width: int, layers: int, nvme_path: str, gpu_share: float):
    shape = _shape(width, layers)
    try:
        return plan(shape, _config(args, name, nvme_path, gpu_share), 1, gpus=1, keys=PLACEMENTS[name][3])
    except PlacementError:
        return None


def _largest_layers(args, name: str, width: int, nvme_path: str, gpu_share: float):
    """(layers, plan) of the deepest model of ``width`` that fits, or None when one layer does not."""
    lo, hi = 0, 1
    best = None
    while hi <= args.max_layers:
        found = _fits(args, name, width, hi, nvme_path, gpu_share)
        if found is None:
            break
        lo, best, hi = hi, found, hi * 2
    hi = min(hi, args.max_layers + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = _fits(args, name, width, mid, nvme_path, gpu_share)
        if found is None:
            hi = mid
        else:
            lo, best = mid, found
    return (lo, best) if lo else None


def _params(width: int, layers: int) -> int:
    """Parameters of the model, counted on its meta-device build (`bench/gpt_model.py`'s layout)."""
    return sum(p.numel() for p in TransformerShape(**_shape(width, layers)).build().parameters())


def _command(args, name: str, width: int, layers: int, decision) -> str:
    model = f"{layers}x{width}x{width // HEAD_DIM}"
    base = f"python3 bench/largest_model.py --model {model} --micro-batch {args.micro_batch} --warmup 1 --steps 2"
    if name == "plain":
        return base + " --plain --checkpoint"
    config = {"partitioner": decision.partitioner, "offload": {"optimizer": decision.offload_optimizer, "params": decision.offload_params}}
    if decision.optimizer_options:
        config["offload"]["optimizer_options"] = dict(decision.optimizer_options)
    if decision.params_options:
        config["offload"]["params_options"] = dict(decision.params_options)
    checkpoint = ""
    if decision.activation_checkpointing is not None:
        _, offload = decision.activation_checkpointing
        checkpoint = " --checkpoint" + (f" --checkpoint-offload {offload}" if offload != "none" else "")
    return base + checkpoint + f" --zkernel '{json.dumps(config)}'"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory", default="79GiB", help="free memory of the GPU")
    parser.add_argument("--ram", default="120GiB", help="available host memory")
    parser.add_argument("--disk", default="58GiB", help="free disk for the NVMe tiers")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--widths", default="2560,4096,5120,6144,8192")
    parser.add_argument("--max-layers", type=int, default=160)
    parser.add_argument("--gpu-shares", default="0,0.1,0.2,0.3,0.4,0.5,0.6",
                        help="the cpu tier's gpu_share values tried (its optimizer groups kept and stepped on the GPU)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as nvme_path:
        for name in args.placements.split(","):
            if name not in PLACEMENTS:
                parser.error(f"unknown placement {name!r}; valid: {', '.join(PLACEMENTS)}")
            best = None
            shares = [float(x) for x in args.gpu_shares.split(",")] if PLACEMENTS[name][1] == "cpu" else [0.0]
            for width in (int(w) for w in args.widths.split(",")):
                for share in shares:
                    found = _largest_layers(args, name, width, nvme_path, share)
                    if found is not None and (best is None or _params(width, found[0]) > best[3]):
                        best = (width, found[0], found[1], _params(width, found[0]))
            rows.append((name, best))
    print(f"capacities: GPU {args.gpu_memory}, RAM {args.ram}, disk {args.disk}; micro-batch {args.micro_batch} x {SEQ}")
    print("| placement | model | parameters | planned as | GPU | host | disk |")
    print("|---|---|---|---|---|---|---|")
    commands = []
    for name, best in rows:
        if best is None:
            print(f"| {name} | none fits | | | | | |")
            continue
        width, layers, decision, params = best
        used = {where: format_bytes(sum(kinds.values())) for where, kinds in decision.bytes.items()}
        print(
            f"| {name} | {layers}x{width}x{width // HEAD_DIM} | {params / 1e9:.2f} B | {decision.placement} "
            f"| {used.get('device', '-')} | {used.get('cpu', '-')} | {used.get('nvme', '-')} |"
        )
        commands.append(_command(args, name, width, layers, decision))
    print()
    for command in commands:
        print(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
