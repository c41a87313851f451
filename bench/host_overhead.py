"""zkernel's host work per step: zero3 on a GPT whose matmuls are too small to hide it, beside plain torch.

    python bench/host_overhead.py                       # 24 blocks of width 128, every Linear its own unit
    python bench/host_overhead.py --modes none,tiled --layers 24
    python bench/host_overhead.py --modes none --cprofile 20      # where the host time goes

Each step is forward, backward and AdamW on one CPU thread, with a model small enough
(width 128, 8 tokens, vocab 512) that the host's own work is most of the step: the anchor is
plain torch on the same model and data, in the same run. zkernel runs zero3 with
``persistence_threshold`` 0 (every Linear a unit: four per block; ``tiled`` cuts ``fc`` and ``out``
into 4 tiles each, ten units per block). The difference per unit is what a GPU step must hide
behind its matmuls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt_model  # noqa: E402

VOCAB, WIDTH, TOKENS = 512, 128, 8
MODES = ("plain", "none", "tiled", "ckpt", "ckpt_offload")


def _step_ms(run_step, steps: int, profile: int = 0) -> float:
    for _ in range(3):
        run_step()
    if profile:  # the host's functions by their own time over the timed steps, for this mode
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            run_step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _measure(mode: str, layers: int, steps: int, profile: int = 0) -> tuple[float, int]:
    import zkernel

    torch.manual_seed(0)
    gpt_model.VOCAB = VOCAB
    data = torch.Generator().manual_seed(1)

    def batch():
        idx = torch.randint(0, VOCAB, (1, TOKENS), generator=data)
        return idx, torch.roll(idx, -1, 1)

    if mode == "plain":
        model = gpt_model.GPT(dim=WIDTH, layers=layers, heads=2, seq=TOKENS)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def run_step():
            model(*batch()).backward()
            opt.step()
            opt.zero_grad()

        return _step_ms(run_step, steps), 0
    config = {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}, "precision": "fp32",
              "optimizer": {"name": "adamw", "lr": 1e-4}}
    if mode == "tiled":
        config["tiling"] = {"modules": ["blocks.*.fc", "blocks.*.out"], "tiles": 4}
    if mode in ("ckpt", "ckpt_offload"):
        config["activation_checkpointing"] = {"modules": ["Block"], "offload": "cpu" if mode == "ckpt_offload" else "none"}
    with torch.device("meta"):
        model = gpt_model.GPT(dim=WIDTH, layers=layers, heads=2, seq=TOKENS)
    engine = zkernel.initialize(model, config)

    def run_step():
        engine.backward(engine(*batch()))
        engine.step()

    ms = _step_ms(run_step, steps, profile)
    units = len(engine.groups)
    engine.close()
    return ms, units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--modes", default="plain,none,tiled,ckpt,ckpt_offload", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="print the N functions with the most own host time under cProfile per zkernel mode")
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = args.modes.split(",")
    if "plain" not in modes:
        modes.insert(0, "plain")
    results = {m: _measure(m, args.layers, args.steps, args.cprofile) for m in modes}
    plain = results["plain"][0]
    print(f"GPT {args.layers} x {WIDTH}, {TOKENS} tokens, one CPU thread; median of {args.steps} steps")
    print(f"{'mode':13} {'step ms':>8} {'units':>6} {'vs plain':>9} {'host ms per unit':>17}")
    for mode, (ms, units) in results.items():
        per_unit = f"{(ms - plain) / units:17.3f}" if units else f"{'-':>17}"
        print(f"{mode:13} {ms:8.1f} {units:6d} {ms / plain:9.2f} {per_unit}")


if __name__ == "__main__":
    main()
