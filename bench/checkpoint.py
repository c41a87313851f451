"""Checkpoint throughput against the disk, and consolidation's peak memory against the model.

One run measures, on the same disk and in this order: a dd-style baseline
(one file of the checkpoint's size written sequentially with O_DIRECT in
64 MiB blocks and fsynced, then read back with O_DIRECT; GNU dd too when
present), `engine.save_checkpoint` and `engine.load_checkpoint` of the anchors'
GPT after one training step (GB/s of checkpoint bytes, and the ratio to the
baseline), the baseline again, then `zkernel.consolidate` (the dict) and
`zkernel consolidate` (streamed to a file), each in a fresh process, by peak
RSS against the model's fp32 size. Page caches are dropped before each read
when running as root.

GPU machine:  python bench/checkpoint.py --model 1.3b --dir /tmp/zk_ckpt_bench
CPU, small:   python bench/checkpoint.py --model tiny --device cpu --dir /tmp/zk_ckpt_bench
Options: --partitioner, --offload none|cpu, --precision, --keep (leave the files).
Under torchrun every rank saves and loads its shards; rank 0 runs the rest.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.3b", help="preset of bench/gpt_model.py: tiny, 350m, 1.3b, 6.7b")
    parser.add_argument("--dim", type=int, default=None, help="override the preset's width")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dir", default="/tmp/zk_ckpt_bench", help="where checkpoints and baseline files go")
    parser.add_argument("--partitioner", default="zero1")
    parser.add_argument("--offload", default="none", help="offload.optimizer tier")
    parser.add_argument("--precision", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--seq", type=int, default=128, help="tokens of the one training step")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and baseline files")
    parser.add_argument("--consolidate-child", nargs=3, metavar=("MODE", "DIR", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


# -- the disk baseline ----------------------------------------------------------------------------


def drop_caches() -> bool:
    """Drop the page cache (root only), so reads come from the disk."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def direct_baseline(path: Path, nbytes: int, block: int = 64 << 20) -> dict:
    """Sequential O_DIRECT write (then fsync) and read of ``nbytes``: what dd oflag/iflag=direct does."""
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (block >> 20))
    blocks = max(1, -(-nbytes // block))
    path.unlink(missing_ok=True)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        for _ in range(blocks):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - start
    drop_caches()
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)
    read_s = time.perf_counter() - start
    total = blocks * block
    out = {"bytes": total, "write_gbs": total / write_s / 1e9, "read_gbs": total / read_s / 1e9}
    out.update(gnu_dd(path, blocks, block))
    path.unlink(missing_ok=True)
    return out


def gnu_dd(path: Path, blocks: int, block: int) -> dict:
    if shutil.which("dd") is None:
        return {}

    def rate(cmd) -> float | None:
        result = subprocess.run(cmd, capture_output=True, text=True)
        match = re.search(r"([\d.,]+) s,", result.stderr)
        if result.returncode or not match:
            return None
        return blocks * block / float(match.group(1).replace(",", ".")) / 1e9

    bs = f"bs={block >> 20}M"
    write = rate(["dd", "if=/dev/zero", f"of={path}", bs, f"count={blocks}", "oflag=direct", "conv=fsync"])
    drop_caches()
    read = rate(["dd", f"if={path}", "of=/dev/null", bs, "iflag=direct"])
    return {"dd_write_gbs": write, "dd_read_gbs": read}


# -- consolidation in a fresh process ----------------------------------------------------------


def peak_rss() -> int:
    """This process's peak resident set (VmHWM; ``ru_maxrss`` would include the parent's, kept across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def consolidate_child(mode: str, directory: str, out: str) -> None:
    import torch  # noqa: F401 - counted in the baseline, as in any real use

    import zkernel
    from zkernel.checkpoint import consolidate_to_file

    base = peak_rss()
    start = time.perf_counter()
    if mode == "dict":
        state = zkernel.consolidate(directory)
        nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    else:
        nbytes = consolidate_to_file(directory, out).stat().st_size
    seconds = time.perf_counter() - start
    peak = peak_rss()
    print(json.dumps({"base_rss": base, "peak_rss": peak, "seconds": seconds, "output_bytes": nbytes}))


def run_consolidate(mode: str, directory: Path, out: Path) -> dict:
    drop_caches()
    cmd = [sys.executable, __file__, "--consolidate-child", mode, str(directory), str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(f"consolidation child failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- save and load ---------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.consolidate_child:
        consolidate_child(*args.consolidate_child)
        return
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from gpt_model import GPT, PRESETS, VOCAB

    import zkernel

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda but CUDA is not available")
    shape = dict(PRESETS[args.model])
    if args.dim:
        shape["dim"] = args.dim
    if args.layers:
        shape["layers"] = args.layers
    precision = args.precision or ("bf16" if cuda else "fp32")
    root = Path(args.dir)
    config = {
        "partitioner": args.partitioner,
        "precision": precision,
        "optimizer": {"name": "cpu_adam" if args.offload == "cpu" else "adamw", "lr": 1e-4, "betas": [0.9, 0.95],
                      "weight_decay": 0.1},  # fmt: skip
        "offload": {"optimizer": args.offload},
    }
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(**shape)
    numel = sum(p.numel() for p in model.parameters())
    if args.partitioner != "zero3":
        model = model.to_empty(device="cpu")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    engine = zkernel.initialize(model, config)
    rank = engine.dist.rank
    leader = rank == 0

    def say(text: str) -> None:
        if leader:
            print(text, flush=True)

    say(f"model {args.model} {shape}: {numel / 1e9:.3f} B parameters, fp32 size {numel * 4 / 1e9:.2f} GB; "
        f"{args.partitioner}, offload {args.offload}, {precision}, world {engine.dist.world_size}, "
        f"device {engine.device}")  # fmt: skip
    tokens = torch.randint(0, VOCAB, (1, args.seq))
    loss = engine(tokens, tokens)
    engine.backward(loss)
    engine.step()

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()
        if cuda:
            torch.cuda.synchronize()

    if leader:
        shutil.rmtree(root / "ckpt", ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    barrier()
    # The checkpoint's size, to size the baseline: masters + optimizer state (+ frozen, buffers).
    estimate = numel * 12
    results: dict = {"model": args.model, "params": numel, "partitioner": args.partitioner,
                     "offload": args.offload, "precision": precision, "world": engine.dist.world_size}  # fmt: skip
    if leader:
        results["disk_before"] = direct_baseline(root / "baseline.bin", estimate)
    barrier()
    start = time.perf_counter()
    path = engine.save_checkpoint(root / "ckpt", tag="bench")
    barrier()
    save_s = time.perf_counter() - start
    manifest = json.loads((path / "manifest.json").read_text())
    nbytes = sum(f["bytes"] for f in manifest["files"].values())
    if leader:
        results["dropped_caches"] = drop_caches()
    barrier()
    start = time.perf_counter()
    engine.load_checkpoint(root / "ckpt")
    barrier()
    load_s = time.perf_counter() - start
    results.update(checkpoint_bytes=nbytes, save_s=save_s, load_s=load_s,
                   save_gbs=nbytes / save_s / 1e9, load_gbs=nbytes / load_s / 1e9)  # fmt: skip
    engine.close()
    if leader:
        results["disk_after"] = direct_baseline(root / "baseline.bin", estimate)
        for mode in ("dict", "file"):
            c = run_consolidate(mode, root / "ckpt", root / "consolidated.safetensors")
            c["peak_over_fp32"] = c["peak_rss"] / (numel * 4)
            c["growth_over_fp32"] = (c["peak_rss"] - c["base_rss"]) / (numel * 4)
            results[f"consolidate_{mode}"] = c
        report(results)
        if not args.keep:
            shutil.rmtree(root / "ckpt", ignore_errors=True)
            (root / "consolidated.safetensors").unlink(missing_ok=True)


def report(r: dict) -> None:
    disk = {k: (r["disk_before"][k] + r["disk_after"][k]) / 2 for k in ("write_gbs", "read_gbs")}
    print(f"\ncheckpoint {r['checkpoint_bytes'] / 1e9:.2f} GB on {r['world']} rank(s)")
    print(f"{'':24}{'GB/s':>8}{'disk GB/s':>11}{'ratio':>8}")
    print(f"{'save_checkpoint':24}{r['save_gbs']:8.2f}{disk['write_gbs']:11.2f}{r['save_gbs'] / disk['write_gbs']:8.2f}")
    print(f"{'load_checkpoint':24}{r['load_gbs']:8.2f}{disk['read_gbs']:11.2f}{r['load_gbs'] / disk['read_gbs']:8.2f}")
    for when in ("disk_before", "disk_after"):
        d = r[when]
        dd = f", GNU dd {d.get('dd_write_gbs') or 0:.2f} / {d.get('dd_read_gbs') or 0:.2f}" if "dd_write_gbs" in d else ""
        print(f"  {when}: O_DIRECT write {d['write_gbs']:.2f} / read {d['read_gbs']:.2f} GB/s{dd}")
    print(f"  page cache dropped before reads: {r['dropped_caches']}")
    for mode, label in (("dict", "zkernel.consolidate (dict)"), ("file", "zkernel consolidate (file)")):
        c = r[f"consolidate_{mode}"]
        print(f"{label:28} peak RSS {c['peak_rss'] / 1e9:.2f} GB = {c['peak_over_fp32']:.2f}x fp32 size "
              f"(growth {c['growth_over_fp32']:.2f}x), {c['seconds']:.1f} s")  # fmt: skip
    print(json.dumps(r))


if __name__ == "__main__":
    main()
