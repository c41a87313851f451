"""How much all-gathers running beside a chain of matmuls slow it: NCCL kernels vs peer copies.

    torchrun --nproc_per_node=2 bench/gather_contention.py

Rank 0 prints, in seconds (best of 3): the matmul chain alone (40 bf16 8192^3 multiplies), 60
all-gathers of 128 MiB shards alone (NCCL, and as copies through symmetric memory on the copy
engines, through zero3's own ``peer_gathers`` pool), and the chain with each kind of gather running beside it on
another stream. The slowdown of the chain is what a gather costs the compute it overlaps.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

SHARD = 64 * 2**20  # bf16 elements per rank (128 MiB)
GATHERS, MATMULS, SIZE = 60, 40, 8192


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    full = torch.empty(world * SHARD, dtype=torch.bfloat16, device=device)
    shard = torch.full((SHARD,), float(rank + 1), dtype=torch.bfloat16, device=device)
    a = torch.randn(SIZE, SIZE, dtype=torch.bfloat16, device=device)
    b = torch.randn(SIZE, SIZE, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream()

    def matmuls():
        for _ in range(MATMULS):
            torch.mm(a, b)

    def best(fn, reps=3):
        times = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    def nccl_gathers():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GATHERS):
                dist.all_gather_into_tensor(full, shard)

    from zkernel.telemetry.timeline import Timeline
    from zkernel_plugins.partitioners._peer_gather import open_pool

    pool = open_pool(SHARD, torch.bfloat16, device, required=True, timeline=Timeline(device, enabled=False))  # zero3's own
    _, mine = pool.take(SHARD)
    mine.copy_(shard)

    def peer_gathers():
        done = None
        for _ in range(GATHERS):  # each on the pool's stream, after what the current stream queued
            done = pool.all_gather(full, 0, SHARD, reused=True)
        side.wait_event(done)

    peer_gathers()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert all(bool((full[r * SHARD : (r + 1) * SHARD] == r + 1).all()) for r in range(world))
    result = {
        "matmuls_alone_s": best(matmuls),
        "nccl_gathers_alone_s": best(nccl_gathers),
        "peer_gathers_alone_s": best(peer_gathers),
        "matmuls_beside_nccl_s": best(lambda: (nccl_gathers(), matmuls())),
        "matmuls_beside_peer_s": best(lambda: (peer_gathers(), matmuls())),
    }
    if rank == 0:
        alone = result["matmuls_alone_s"]
        print(json.dumps({k: round(v, 4) for k, v in result.items()}))
        print(f"matmul chain beside NCCL gathers: {result['matmuls_beside_nccl_s'] / alone:.3f}x its time alone; "
              f"beside peer copies: {result['matmuls_beside_peer_s'] / alone:.3f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
