"""The demo program: ``python -m zkernel.cli.demo`` is one rank of ``zkernel demo``.

Training lives in `zkernel.cli.demo.train`; this entry point configures logging,
runs it, and writes the human-readable banner and summary to stdout on rank 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch.distributed as dist

from zkernel.cli.demo.train import PROMPT, megabytes, build_parser, format_memory, train


def _say(line: str) -> None:
    print(line, flush=True)


def print_summary(summary: dict, partitioner: str) -> None:
    print(
        f"loss: first {summary['first_loss']:.4f} -> last {summary['last_loss']:.4f} "
        f"({summary['steps']} optimizer steps)"
    )
    print(f"throughput: {summary['tokens_per_s']:,.0f} tokens/s (all ranks)")
    unsharded = summary["n_params"] * 4
    print(
        f"memory per rank ({partitioner}; one unsharded fp32 copy of the parameters is "
        f"{megabytes(unsharded)}, of params+grads+Adam state {megabytes(4 * unsharded)}):"
    )
    for rank, report in enumerate(summary["memory"]):
        print(f"  rank {rank}: {format_memory(report)}")
        for line in report.whole_lines():  # what of `params` is not a shard, and why
            print(f"    of params: {line}")
    if summary["sample"]:
        print(f"sample: {PROMPT}{summary['sample']}".replace("\n", "\n        "))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from zkernel.cli.commands import configure_logging

    configure_logging(json_output=args.log_json, verbose=args.verbose, rank=int(os.environ.get("RANK", "0")))
    try:
        summary = train(args, on_start=_say)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print_summary(summary, args.partitioner)
            sys.stdout.flush()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
