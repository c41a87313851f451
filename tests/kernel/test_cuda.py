"""The partitioners on CUDA (NCCL for several GPUs) against torch AdamW on the same GPU."""

from __future__ import annotations

from tests.support.paths import REPO
import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches
from tests.support.scenarios import train_many

pytestmark = pytest.mark.cuda

STEPS, ACCUM, MICRO, SEED, LR, WD, CLIP = 8, 2, 3, 99, 2e-2, 0.1, 0.5
STAGES = ("none", "zero1", "zero2", "zero3")


def _config(stage, precision="fp32"):
    cfg = {
        "partitioner": stage,
        "precision": precision,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"lr": LR, "weight_decay": WD},
    }
    if stage == "zero3":
        cfg["partitioner_options"] = {"persistence_threshold": 0}
    return cfg


def _reference(world):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(SEED)
    model = TrickyNet().cuda()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    losses = []
    for step in batches(SEED + 1, STEPS, ACCUM, world, MICRO):
        total = 0.0
        for micro in step:
            tokens = torch.cat([t for t, _ in micro]).cuda()
            targets = torch.cat([y for _, y in micro]).cuda()
            loss = model(tokens, targets) / ACCUM
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _check(results, expected, label, rel):
    for stage, result in zip(STAGES, results):
        for i, (a, b) in enumerate(zip(result["losses"], expected)):
            assert abs(a - b) <= rel * abs(b), f"{label} {stage} step {i}: {a} vs {b}"


def test_cuda_single_gpu_matches_torch():
    torch.backends.cuda.matmul.allow_tf32 = False
    results = train_many([_config(s) for s in STAGES], STEPS, ACCUM, MICRO, SEED)
    _check(results, _reference(1), "cuda world 1", 2e-5)
    for r in results:
        assert all(dev.startswith("cuda") for dev in r["memory"]["params"])


def test_cuda_bf16_trains():
    results = train_many([_config(s, "bf16") for s in STAGES], STEPS, ACCUM, MICRO, SEED)
    for stage, r in zip(STAGES, results):
        assert r["losses"][-1] < r["losses"][0], (stage, r["losses"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_match_torch():
    results = run_ranks(2, train_many, [_config(s) for s in STAGES], STEPS, ACCUM, MICRO, SEED)
    expected = _reference(2)
    for rank_results in results:
        _check(rank_results, expected, "nccl world 2", 2e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nccl_two_gpus_peer_gathers_are_the_nccl_gathers(precision):
    """zero3 gathering through peer memory on the copy engines trains exactly as with NCCL gathers
    (the same values arrive: the optimizer's rounded copy in the pool is the cast a NCCL gather makes)."""
    configs = []
    for policy in ("always", "never"):
        cfg = _config("zero3", precision)
        cfg["partitioner_options"] = {**cfg["partitioner_options"], "peer_gathers": policy}
        configs.append(cfg)
    for peer, nccl in run_ranks(2, train_many, configs, STEPS, ACCUM, MICRO, SEED):
        assert peer["peer_gathers"] and not nccl["peer_gathers"]
        assert peer["losses"] == nccl["losses"], (peer["losses"], nccl["losses"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nccl_two_gpus_peer_reductions_are_the_nccl_reductions(precision):
    """zero3 reducing through peer memory (copy engines, then one fp32 sum) trains exactly as with NCCL's
    fp32 reduce-scatter on two ranks: a + b of fp32 values is rounded once either way."""
    configs = []
    for policy in ("auto", "never"):
        cfg = _config("zero3", precision)
        cfg["partitioner_options"] = {**cfg["partitioner_options"], "peer_gathers": "always", "peer_reductions": policy}
        configs.append(cfg)
    for peer, nccl in run_ranks(2, train_many, configs, STEPS, ACCUM, MICRO, SEED):
        assert peer["peer_reductions"] and not nccl["peer_reductions"]
        assert peer["losses"] == nccl["losses"], (peer["losses"], nccl["losses"])


def test_peer_reduction_kernel_sums_as_the_host_does():
    """The Triton sum of the peer reductions adds the ranks in rank order, as the torch path does."""
    from tests.plugins.partitioners.test_partitioners import _rank_order_inputs
    from zkernel_plugins.partitioners._peer_reduce import mean_of_ranks

    rows = _rank_order_inputs("cuda")
    rows = [torch.cat([r, torch.randn(10_000, device="cuda").bfloat16()]) for r in rows]
    for rank in range(3):
        peers = torch.stack([r for i, r in enumerate(rows) if i != rank])
        out, expected = torch.empty(rows[0].numel(), device="cuda"), torch.empty(rows[0].numel())
        mean_of_ranks(out, rows[rank], peers, rank, 3)
        mean_of_ranks(expected, rows[rank].cpu(), peers.cpu(), rank, 3)
        assert torch.equal(out.cpu(), expected), rank


OFFLOAD_STAGES = ("zero1", "zero2", "zero3")


def _offload_config(stage, optimizer, precision="fp32"):
    cfg = _config(stage, precision)
    cfg["optimizer"] = {**cfg["optimizer"], "name": optimizer}
    # The host path: no GPU share (the default, "auto", would move these small models' optimizer
    # to the GPU after the first step).
    cfg["offload"] = {"optimizer": "cpu", "optimizer_options": {"gpu_share": 0.0}}
    return cfg


@pytest.mark.parametrize("optimizer", ["cpu_adam", "adamw"])
def test_cuda_cpu_offload_matches_torch(optimizer):
    """Masters and Adam state in page-locked host memory, gradients down and parameters up on side streams."""
    torch.backends.cuda.matmul.allow_tf32 = False
    results = train_many([_offload_config(s, optimizer) for s in OFFLOAD_STAGES], STEPS, ACCUM, MICRO, SEED)
    expected = _reference(1)
    for stage, result in zip(OFFLOAD_STAGES, results):
        for i, (a, b) in enumerate(zip(result["losses"], expected)):
            assert abs(a - b) <= 2e-5 * abs(b), f"{optimizer} {stage} step {i}: {a} vs {b}"
        memory = result["memory"]
        assert set(memory["master_weights"]) == {"cpu"} and set(memory["optimizer_state"]) == {"cpu"}
        assert all(dev.startswith("cuda") for dev in memory["params"] if dev != "cpu")


def test_cuda_cpu_offload_bf16_tracks_device_run():
    device = train_many([_config(s, "bf16") for s in OFFLOAD_STAGES], STEPS, ACCUM, MICRO, SEED)
    offload = train_many([_offload_config(s, "cpu_adam", "bf16") for s in OFFLOAD_STAGES], STEPS, ACCUM, MICRO, SEED)
    for stage, a, b in zip(OFFLOAD_STAGES, offload, device):
        assert a["losses"][-1] < a["losses"][0], (stage, a["losses"])
        for x, y in zip(a["losses"], b["losses"]):
            assert abs(x - y) <= 2e-2 * abs(y), (stage, a["losses"], b["losses"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_cpu_offload_matches_torch():
    configs = [_offload_config(s, "cpu_adam") for s in OFFLOAD_STAGES]
    results = run_ranks(2, train_many, configs, STEPS, ACCUM, MICRO, SEED)
    expected = _reference(2)
    for rank_results in results:
        for stage, result in zip(OFFLOAD_STAGES, rank_results):
            for i, (a, b) in enumerate(zip(result["losses"], expected)):
                assert abs(a - b) <= 2e-5 * abs(b), f"nccl {stage} step {i}: {a} vs {b}"


def test_cuda_gpu_share_matches_torch():
    """Part of the offloaded optimizer moves to the GPU after the first step (Twin-Flow) and steps there."""
    torch.backends.cuda.matmul.allow_tf32 = False
    configs = []
    for stage in OFFLOAD_STAGES:
        cfg = _offload_config(stage, "cpu_adam")
        cfg["offload"]["optimizer_options"] = {"gpu_share": 0.5}
        if stage != "zero3":
            cfg["partitioner_options"] = {"bucket_size": 300}  # several buckets, so half of them can move
        configs.append(cfg)
    results = train_many(configs, STEPS, ACCUM, MICRO, SEED)
    expected = _reference(1)
    for stage, result in zip(OFFLOAD_STAGES, results):
        for i, (a, b) in enumerate(zip(result["losses"], expected)):
            assert abs(a - b) <= 2e-5 * abs(b), f"gpu share {stage} step {i}: {a} vs {b}"
        memory = result["memory"]
        assert memory["optimizer_state"].get("cpu", 0) > 0 and any(d.startswith("cuda") for d in memory["optimizer_state"])


@pytest.mark.parametrize("optimizer_tier", ["none", "cpu"])
def test_cuda_params_on_host_match_torch(optimizer_tier):
    """ZeRO-Infinity's parameter tier: shards in page-locked host memory, uploaded on a side stream per gather."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _offload_config("zero3", "cpu_adam" if optimizer_tier == "cpu" else "adamw")
    cfg["offload"] = {"optimizer": optimizer_tier, "params": "cpu"}
    for prefetch in (0, 1 << 20):
        result = train_many([{**cfg, "prefetch_bytes": prefetch}], STEPS, ACCUM, MICRO, SEED)[0]
        for i, (a, b) in enumerate(zip(result["losses"], _reference(1))):
            assert abs(a - b) <= 2e-5 * abs(b), f"params cpu, optimizer {optimizer_tier}, prefetch {prefetch}, step {i}: {a} vs {b}"
        assert "cpu" in result["memory"]["params"]


def test_cuda_bf16_gradient_transfer_tracks_fp32():
    """grad_dtype = "bf16": gradients cross to the host rounded to bf16 (half the bytes)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    configs = []
    for accum in (1, ACCUM):
        cfg = _offload_config("zero3", "cpu_adam")
        cfg["offload"]["optimizer_options"] = {"grad_dtype": "bf16", "gpu_share": 0.0}
        cfg["gradient_accumulation_steps"] = accum
        configs.append(cfg)
    for accum, cfg in zip((1, ACCUM), configs):
        result = train_many([cfg], STEPS, accum, MICRO, SEED)[0]
        reference = _reference(1) if accum == ACCUM else None
        assert result["losses"][-1] < result["losses"][0]
        if reference is not None:
            for a, b in zip(result["losses"], reference):
                assert abs(a - b) <= 1e-2 * abs(b), (result["losses"], reference)
        assert result["memory"]["grads"].get("cpu", 0) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(("branch", "module"), [("right", "right"), ("wide", "wide.0")])
def test_nccl_ranks_that_diverge_stop_with_the_module_named(branch, module):
    """The NCCL form of the path check: a watchdog reads the device ring and ends both ranks."""
    import json
    import os
    import subprocess
    import sys
    import time

    from tests.support.harness import _free_port

    config = {"partitioner": "zero3", "optimizer": {"lr": 1e-2}, "prefetch_bytes": 4096,
              "partitioner_options": {"persistence_threshold": 0}, "collective_timeout": 60.0}
    code = "import json, sys; from tests.support.branch_scenarios import diverge; print(diverge(json.loads(sys.argv[1]), sys.argv[2]))"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
         "--no-python", sys.executable, "-c", code, json.dumps(config), branch],
        capture_output=True, text=True, timeout=120, cwd=str(REPO),
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ranks took different module paths in micro-step 1" in proc.stderr, proc.stderr[-3000:]
    assert f"rank 1 was about to gather for forward '{module}'" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 50  # well inside the collective timeout: the watchdog ended it


def _timeline_collectives(config):
    import zkernel
    from zkernel.telemetry.timeline import SpanKind

    torch.manual_seed(SEED)
    engine = zkernel.initialize(TrickyNet(), {**config, "timeline": True})
    for step in batches(SEED + 1, 3, 1, torch.distributed.get_world_size(), MICRO):
        tokens, targets = step[0][torch.distributed.get_rank()]
        engine.backward(engine(tokens, targets))
        engine.step()
    engine.close()
    last = engine.timeline.summaries[-1]
    return {"count": last.count.get(SpanKind.COLLECTIVE, 0), "busy": last.busy_s.get(SpanKind.COLLECTIVE, 0.0),
            "bytes": last.nbytes.get(SpanKind.COLLECTIVE, 0)}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("peer", ["never", "always"])
def test_nccl_timeline_shows_the_collectives(peer):
    """zero3's all-gathers and reduce-scatters appear in the step timeline with their bytes, NCCL's
    and those through peer memory alike."""
    config = _config("zero3")
    config["partitioner_options"] = {**config["partitioner_options"], "peer_gathers": peer}
    for rank_result in run_ranks(2, _timeline_collectives, config):
        assert rank_result["count"] > 0 and rank_result["busy"] > 0 and rank_result["bytes"] > 0, rank_result
