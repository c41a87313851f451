"""What each rank of ``zkernel demo`` runs: a small GPT trained for a fixed time.

Run it through ``zkernel demo`` (which launches one process per GPU, or two
CPU processes, with ``torch.distributed.run``), or directly::

    python -m torch.distributed.run --nproc_per_node 2 -m zkernel.cli.demo --seconds 30
    python -m zkernel.cli.demo --seconds 10          # one process, world size 1

With zero3 the model is built on the meta device (``--no-meta-init`` to not), so each
rank materialises one module at a time and keeps only its shard. Every rank
draws its own random windows of the embedded corpus. After each optimizer step
one all-reduce carries the loss (for the progress bar) and rank 0's decision to
stop, so all ranks leave the loop after the same step and none is left waiting
in a collective. `train` returns the summary (every rank's memory report
gathered to rank 0); the program in `zkernel.cli.demo.__main__` prints it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import structlog
import torch
import torch.distributed as dist

import zkernel
from zkernel.cli.demo.arguments import SHORT_MIN_STEPS, SHORT_SECONDS, add_training_arguments
from zkernel.cli.demo.corpus import load_corpus, sample_batch
from zkernel.cli.demo.gpt import GPT, GPTConfig
from zkernel.telemetry.log import get_logger
from zkernel.telemetry.progress import shown as progress_shown

log = get_logger("zkernel.demo")

WARMUP_STEPS = 8
PROMPT = "The third stage "


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zkernel.cli.demo", description="Train the demo GPT (one rank of the job)."
    )
    add_training_arguments(parser)
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show zkernel debug events")
    return parser


def demo_config(
    partitioner: str, *, gpu: bool, lr: float, seed: int, offload_optimizer: str = "cpu", offload_params: str = "none"
) -> dict:
    """The zkernel config the demo trains with."""
    config = {
        "partitioner": partitioner,
        "precision": "bf16" if gpu else "fp32",
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": 2,
        "optimizer": {
            "name": "cpu_adam" if offload_optimizer != "none" else "adamw",
            "lr": lr,
            "betas": [0.9, 0.95],
            # GPT-2's recipe: the weight matrices decay, the biases and LayerNorm gains do not.
            "weight_decay": 0.1,
            "no_weight_decay": ["*.bias", "LayerNorm"],
        },
        # A linear warm-up of the learning rate to its peak, then constant (the run's length is
        # a time, not a number of steps).
        "lr_schedule": {"name": "warmup", "warmup_num_steps": WARMUP_STEPS, "warmup_type": "linear"},
        "offload": {"optimizer": offload_optimizer, "params": offload_params},
        "seed": seed,
    }
    if partitioner == "zero3":
        # Shard every module, however small, so the memory report shows it.
        config["partitioner_options"] = {"persistence_threshold": 0, "init_seed": seed}
    return config


def megabytes(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def format_memory(report: dict[str, dict[str, int]]) -> str:
    parts = []
    for category, by_device in report.items():
        if by_device:
            where = ", ".join(f"{megabytes(n)} on {dev}" for dev, n in sorted(by_device.items()))
            parts.append(f"{category} {where}")
        else:
            parts.append(f"{category} -")
    return "; ".join(parts)


class _Sync:
    """One all-reduce per optimizer step: the summed loss and rank 0's stop flag."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.device = device
        self.world_size = world_size

    def __call__(self, loss: float, stop: bool) -> tuple[float, bool]:
        if self.world_size == 1:
            return loss, stop
        buf = torch.tensor([loss, 1.0 if stop else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(buf)
        return float(buf[0]) / self.world_size, bool(buf[1] > 0)


@torch.no_grad()
def generate(engine, tokenizer, prompt: str, n_chars: int, seq_len: int, seed: int) -> str:
    """Sample ``n_chars`` characters after ``prompt``; every rank takes part (zero3 gathers per module).

    Rank 0 samples each character and broadcasts it, so all ranks feed the same
    context into the next forward.
    """
    device = engine.device
    distributed = engine.dist.distributed
    generator = torch.Generator().manual_seed(seed)
    idx = tokenizer.encode(prompt)[None].to(device)
    for _ in range(n_chars):
        logits = engine(idx[:, -seq_len:])[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).to(device)
        if distributed:
            dist.broadcast(nxt, src=0)
        idx = torch.cat([idx, nxt[None]], dim=1)
    return tokenizer.decode(idx[0, len(prompt) :].tolist())


def train(args: argparse.Namespace, on_start: Callable[[str], None] | None = None) -> dict:
    """Train on this rank until rank 0 says the time is up; returns the summary (on every rank)."""
    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    seconds = SHORT_SECONDS if args.short else args.seconds
    min_steps = SHORT_MIN_STEPS if args.short else 1
    sample_chars = args.sample_chars if args.sample_chars is not None else (60 if args.short else 200)

    tokenizer, data = load_corpus()
    gpt_cfg = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
    )
    torch.manual_seed(args.seed)
    meta_init = args.partitioner == "zero3" if args.meta_init is None else args.meta_init
    if meta_init:
        if args.partitioner != "zero3":
            raise SystemExit("--meta-init needs --partitioner zero3")
        # Partitioned construction: no memory is used until zero3 materialises
        # each module in turn and keeps this rank's shard of it.
        with torch.device("meta"):
            model = GPT(gpt_cfg)
    else:
        # Every rank builds the same model; the partitioner broadcasts rank 0's values anyway.
        model = GPT(gpt_cfg)
    n_params = model.num_params()
    config = demo_config(
        args.partitioner,
        gpu=gpu,
        lr=args.lr,
        seed=args.seed,
        offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params,
    )
    engine = zkernel.initialize(model, config)
    rank, world = engine.dist.rank, engine.dist.world_size
    structlog.contextvars.bind_contextvars(rank=rank)
    accumulation = config["gradient_accumulation_steps"]
    tokens_per_step = args.micro_batch * args.seq_len * accumulation * world

    if rank == 0 and on_start is not None:
        on_start(
            f"zkernel demo: GPT of {n_params:,} parameters (d={gpt_cfg.d_model}, {gpt_cfg.n_layers} layers, "
            f"{gpt_cfg.n_heads} heads, seq {gpt_cfg.seq_len}), partitioner {args.partitioner}, "
            f"optimizer offload {args.offload_optimizer}, parameter offload {args.offload_params}, "
            f"{world} rank(s) on {engine.device.type} ({engine.dist.backend or 'no process group'}), "
            f"{config['precision']}, {tokens_per_step:,} tokens per optimizer step, {seconds:g} s"
            + (", built on the meta device" if meta_init else "")
        )

    from tqdm import tqdm

    # [Note: a bar for a person only] The bar is for someone watching a terminal: on another rank,
    # with stderr redirected to a file or a pipe, or with ZKERNEL_PROGRESS=0, nothing is drawn
    # (the rule of `zkernel.telemetry.progress.shown`, which every zkernel bar follows).
    bar = tqdm(
        total=round(seconds),
        unit="s",
        desc="training",
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total}s{postfix}",
        disable=not progress_shown(),
        file=sys.stderr,
        mininterval=0.5,
        dynamic_ncols=True,
    )
    sync = _Sync(engine.device, world)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    engine.module.train()
    losses: list[float] = []
    start = time.perf_counter()
    stop = False
    while not stop:
        step_loss = 0.0
        for _ in range(accumulation):
            x, y = sample_batch(data, args.micro_batch, args.seq_len, generator)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / accumulation
        elapsed = time.perf_counter() - start
        done = elapsed >= seconds and len(losses) + 1 >= min_steps
        mean_loss, stop = sync(step_loss, rank == 0 and done)
        losses.append(mean_loss)
        bar.n = min(elapsed, bar.total)
        bar.set_postfix_str(f"step {len(losses)}  loss {mean_loss:.3f}", refresh=False)
        bar.refresh()
    elapsed = time.perf_counter() - start
    bar.close()
    log.info("zkernel.demo.trained", steps=len(losses), seconds=round(elapsed, 2))

    reports = [engine.memory_report()]
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, engine.memory_report())
    sample = generate(engine, tokenizer, PROMPT, sample_chars, gpt_cfg.seq_len, args.seed) if sample_chars else ""
    summary = {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "steps": len(losses),
        "tokens_per_s": tokens_per_step * len(losses) / elapsed,
        "memory": reports,
        "sample": sample,
        "n_params": n_params,
    }
    engine.close()
    return summary
