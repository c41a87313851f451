"""The demo's training options, shared by ``zkernel demo`` and ``python -m zkernel.cli.demo``.

Kept apart from `zkernel.cli.demo.train` so that building the CLI's parser imports
no torch: ``zkernel --version`` and ``zkernel config`` answer at once.
"""

from __future__ import annotations

import argparse

SHORT_SECONDS = 5.0
SHORT_MIN_STEPS = 12  # --short trains at least this many optimizer steps, however slow the machine


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the training options to ``parser`` (``zkernel demo`` forwards them to ``python -m zkernel.cli.demo``)."""
    parser.add_argument("--seconds", type=float, default=60.0, help="training time (default: 60)")
    parser.add_argument(
        "--partitioner", default="zero3", help="partitioner to train with (default: zero3)"
    )
    parser.add_argument(
        "--offload-optimizer",
        default="cpu",
        help="offload.optimizer tier: fp32 masters and Adam state in host memory, stepped by the native "
        "CPU Adam while the device computes (default: cpu; 'none' keeps them on the device)",
    )
    parser.add_argument(
        "--offload-params", default="none", help="offload.params tier (zero3 only; default: none)"
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help=f"test mode: {SHORT_SECONDS:g} s of training (at least {SHORT_MIN_STEPS} optimizer steps) and a shorter sample",
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default: 2e-3)")
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-batch per rank")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sample-chars", type=int, default=None, help="characters to generate at the end")
    parser.add_argument(
        "--meta-init",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build the model on the meta device and let zero3 materialise it shard by shard "
        "(default: on with zero3, which is the only partitioner that can)",
    )
