"""What a weight's start address in a flat buffer costs its matmuls: aligned against misaligned.

    python bench/flat_alignment.py            # needs one CUDA device

Flat-buffer engines (zkernel's zero1-3, FSDP1, DeepSpeed) make every parameter a view into one
buffer per group. A parameter whose element count is not a multiple of 8 (a vocabulary bias of
30,522 or 50,265, a scalar gate) moves every later parameter of the group off a 16-byte boundary,
where cuBLAS cannot use its fastest kernels ([Note: flat layout] in
`plugins/partitioners/_flat.py`). Each line times the forward and backward of a bf16 ``nn.Linear``
whose weight is a view at an offset of N elements into a flat buffer, against the same layer with
its own allocation (the anchor: what plain torch and FSDP2, which allocates each parameter
separately, run), from the same run (median of 5 rounds of 20 steps).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def _step_ms(layer: torch.nn.Linear, x: torch.Tensor, grad: torch.Tensor, steps: int = 20) -> float:
    def run():
        for _ in range(steps):
            layer(x).backward(grad)
            layer.weight.grad = None
            x.grad = None

    run()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / steps)
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="rows of the input (micro-batch x sequence)")
    parser.add_argument("--shapes", default="2048x2048,2048x8192,8192x2048", help="comma list of in x out features")
    parser.add_argument("--offsets", default="0,1,2,4,8,16", help="element offsets of the weight in the flat buffer")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/flat_alignment.py needs a CUDA device")
    dtype, device = torch.bfloat16, torch.device("cuda")
    offsets = [int(o) for o in args.offsets.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {args.tokens} tokens")
    print(f"{'shape':>12} {'offset':>7} {'bytes':>6} {'ms':>8} {'vs own allocation':>18}")
    for shape in args.shapes.split(","):
        fan_in, fan_out = (int(d) for d in shape.split("x"))
        torch.manual_seed(0)
        layer = torch.nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=dtype)
        x = torch.randn(args.tokens, fan_in, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(args.tokens, fan_out, device=device, dtype=dtype)
        weight = layer.weight.detach().clone()
        anchor = _step_ms(layer, x, grad)
        print(f"{shape:>12} {'own':>7} {'':>6} {anchor:8.3f} {1.0:18.3f}")
        for offset in offsets:
            flat = torch.zeros(offset + weight.numel() + 64, device=device, dtype=dtype)
            view = flat[offset : offset + weight.numel()].view_as(weight)
            view.copy_(weight)
            layer.weight.data = view
            ms = _step_ms(layer, x, grad)
            print(f"{shape:>12} {offset:7d} {offset * flat.element_size():6d} {ms:8.3f} {ms / anchor:18.3f}")


if __name__ == "__main__":
    main()
