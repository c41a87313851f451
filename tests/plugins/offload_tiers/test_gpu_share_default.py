"""The host tiers' GPU share by default ([Note: a share by default] in ``_gpu_share``).

On CPU: the option defaults of the ``cpu`` and ``nvme`` tiers, the
arithmetic that sizes ``"auto"`` from a described GPU (free memory, the
allocator's reserve and peak, a simulated H200 after a GPT-6.7B step), an
engine with the default options stepping every group on the host as before,
like torch, and the move itself (`rebalance`, which ``after_first_step`` runs
on CUDA) onto the CPU as compute device mid-run, the nvme tier's groups read
back from disk, still training as torch does. On CUDA: the default moves the
optimizer to the GPU after the first step and trains as torch does.
"""

from __future__ import annotations

import types

import pytest
import torch

import zkernel
from tests.plugins.partitioners.test_partitioners import ACCUM, MICRO, SEED, STEPS, assert_matches, config, reference
from tests.support.models import TrickyNet
from tests.support.scenarios import _train_steps
from zkernel_plugins.offload_tiers._gpu_share import SHARE_BYTES, SIZED_FRACTION, auto_share, auto_share_bytes, device_room
from zkernel_plugins.offload_tiers._nvme_options import NvmeTierOptions
from zkernel_plugins.offload_tiers.cpu import CpuTierOptions

GiB = 1 << 30


def test_the_cpu_tier_sizes_its_gpu_share_and_arena_by_default():
    options = CpuTierOptions()
    assert options.gpu_share == "auto" and options.device_accumulation == "auto"
    assert CpuTierOptions(gpu_share=0).gpu_share == 0  # a number still fixes it; 0 keeps every group on the host
    with pytest.raises(ValueError, match=r'gpu_share must be a number in \[0, 1\] or "auto", got 1.5'):
        CpuTierOptions(gpu_share=1.5)
    nvme = NvmeTierOptions()
    assert nvme.gpu_share == "auto" and nvme.host_share == 0.0 and nvme.device_accumulation == "auto"
    assert NvmeTierOptions(host_share=1.0).gpu_share == "auto"  # "auto" takes what is left, from disk or host
    with pytest.raises(zkernel.ConfigError, match=r"gpu_share \(0.6\) \+ host_share \(0.6\) is more than 1"):
        NvmeTierOptions(gpu_share=0.6, host_share=0.6)


def test_device_room_is_what_the_peak_step_would_leave():
    # 141 GiB GPU: 30 GiB reserved now, 60 at the peak, 80 free (others hold the rest): 50 GiB of room.
    assert device_room(free=80 * GiB, reserved=30 * GiB, peak_reserved=60 * GiB) == 50 * GiB
    # The allocator at its peak: only what is free.
    assert device_room(free=12 * GiB, reserved=60 * GiB, peak_reserved=60 * GiB) == 12 * GiB
    # Another process took what the peak needs: no room, never negative.
    assert device_room(free=1 * GiB, reserved=10 * GiB, peak_reserved=60 * GiB) == 0


def _group(numel: int, shard_device: str | None = None, dtype=torch.bfloat16):
    master = torch.empty(numel, device="meta")
    shard = None if shard_device is None else torch.empty(numel, dtype=dtype, device=shard_device)
    return types.SimpleNamespace(master=master, param_shard=shard, index=numel)


def test_auto_share_fills_the_room_in_forward_order():
    groups = [_group(n) for n in (100, 50, 200, 10)]
    sixteen = lambda g: SHARE_BYTES  # noqa: E731
    # Room for 160 elements: the first two, not the third (too large), then the fourth.
    chosen = auto_share(groups, 160 * SHARE_BYTES, host_numel=360, arena_fraction=0.0, bytes_per_element=sixteen)
    assert [g.master.numel() for g in chosen] == [100, 50, 10]
    chosen = auto_share(groups, 49 * SHARE_BYTES, host_numel=360, arena_fraction=0.0, bytes_per_element=sixteen)
    assert [g.master.numel() for g in chosen] == [10]  # only the last is small enough
    assert not auto_share(groups, 0, host_numel=360, arena_fraction=0.0, bytes_per_element=sixteen)


def test_auto_share_leaves_the_accumulation_arena_its_room():
    """With accumulation the arena (4 bytes per host-stepped element) comes first; a group moved
    costs 16 bytes and gives its 4 back, so 12 net."""
    groups = [_group(n) for n in (100, 50, 200, 10)]
    host = 360
    arena = 4 * host
    sixteen = lambda g: SHARE_BYTES  # noqa: E731
    assert not auto_share(groups, arena - 1, host_numel=host, arena_fraction=1.0, bytes_per_element=sixteen)
    chosen = auto_share(groups, arena + 150 * 12, host_numel=host, arena_fraction=1.0, bytes_per_element=sixteen)
    assert [g.master.numel() for g in chosen] == [100, 50]
    # A simulated H200 after a GPT-6.7B first step: 141 GiB, 95 GiB at the peak, nothing else on it.
    room = int(SIZED_FRACTION * device_room(free=141 * GiB - 95 * GiB, reserved=95 * GiB, peak_reserved=95 * GiB))
    blocks = [_group(201_326_592) for _ in range(32)]  # 32 blocks of 12 x 4096^2 elements
    chosen = auto_share(blocks, room, host_numel=32 * 201_326_592, arena_fraction=1.0, bytes_per_element=sixteen)
    moved = sum(g.master.numel() for g in chosen)
    assert 0 < len(chosen) < 32 and all(a is b for a, b in zip(chosen, blocks))
    assert 4 * (32 * 201_326_592 - moved) + 16 * moved <= room  # arena and share together fit the room


def test_a_group_whose_parameters_live_off_the_gpu_costs_its_update_buffer_too():
    gpu = torch.device("meta")  # stands for the compute device: a shard there is home already
    assert auto_share_bytes(_group(8, "meta"), gpu, torch.bfloat16) == SHARE_BYTES
    assert auto_share_bytes(_group(8, "cpu"), gpu, torch.bfloat16) == SHARE_BYTES + 2  # params tier "cpu"
    assert auto_share_bytes(_group(8, "cpu", torch.float32), gpu, torch.float32) == SHARE_BYTES  # the master is the update
    assert auto_share_bytes(_group(8), gpu, torch.bfloat16) == SHARE_BYTES  # gathers cast the master


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU device")
def test_on_a_cpu_device_the_default_keeps_every_group_on_the_host_like_torch(stage="zero3"):
    # (test_offload.py's parity tests run every partitioner with the default options too)
    cfg = config(stage)
    cfg["optimizer"] = {**cfg["optimizer"], "name": "cpu_adam"}
    cfg["offload"] = {"optimizer": "cpu"}
    torch.manual_seed(SEED)
    engine = zkernel.initialize(TrickyNet(), cfg)
    losses = _train_steps(engine, STEPS, ACCUM, MICRO, SEED)
    assert engine.optimizer_tier.options.gpu_share == "auto"
    assert engine.optimizer_tier.gpu_share_numel == 0
    assert all(engine.optimizer_tier.steps_on_host(g) for g in engine.groups if g.requires_grad)
    engine.close()
    assert_matches(losses, reference(1), f"{stage} cpu tier, default options, world 1")


@pytest.mark.cuda
@pytest.mark.parametrize(("stage", "tier"), [("zero1", "cpu"), ("zero3", "cpu"), ("zero3", "nvme"), ("zero2", "nvme")])
def test_on_cuda_the_default_moves_the_first_groups_after_the_first_step(stage, tier, tmp_path):
    """GPU machine: with the default options this small model's whole optimizer fits the room the
    first step left, so it moves to the GPU (the nvme tier's from disk) and steps there from the
    second step, as torch does."""
    from tests.kernel import test_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = test_cuda._offload_config(stage, "cpu_adam")
    cfg["offload"] = {"optimizer": tier}  # the defaults
    if tier == "nvme":
        cfg["offload"]["nvme_path"] = str(tmp_path)
    torch.manual_seed(test_cuda.SEED)
    engine = zkernel.initialize(TrickyNet(), cfg)
    losses = _train_steps(engine, test_cuda.STEPS, test_cuda.ACCUM, test_cuda.MICRO, test_cuda.SEED)
    optimizer_tier = engine.optimizer_tier
    trainable = [g for g in engine.groups if g.requires_grad]
    assert not any(optimizer_tier.steps_on_host(g) for g in trainable)
    assert optimizer_tier.gpu_share_numel == sum(g.master.numel() for g in trainable)
    engine.close()
    for i, (a, b) in enumerate(zip(losses, test_cuda._reference(1))):
        assert abs(a - b) <= 2e-5 * abs(b), f"{stage} step {i}: {a} vs {b}"


def _rebalanced_run(stage: str, tier: str, tmp_path, optimizer: str) -> dict:
    """Train with ``tier`` and its default options; after the first step, `rebalance` with room for
    about half of the trainable elements (what `after_first_step` does on CUDA with the room the
    step left; on the CPU the compute device is host memory, so the moved groups step there as the
    ``none`` tier's do)."""
    cfg = config(stage)
    cfg["optimizer"] = {**cfg["optimizer"], "name": optimizer}
    cfg["offload"] = {"optimizer": tier, "optimizer_options": {"device_accumulation": 0.0}}
    if tier == "nvme":
        cfg["offload"]["nvme_path"] = str(tmp_path)
    torch.manual_seed(SEED)
    engine = zkernel.initialize(TrickyNet(), cfg)
    tier_obj = engine.optimizer_tier
    trainable = [g for g in engine.groups if g.requires_grad]
    total = sum(g.master.numel() if g.master is not None else tier_obj.read_master(g).numel() for g in trainable)
    seen = {}

    def after_step() -> None:
        if seen:
            return
        engine.pipeline.wait_all()
        seen["disk_before"] = tier_obj._disk.numel() if tier == "nvme" else 0
        tier_obj.rebalance(trainable, room=SHARE_BYTES * total // 2)
        seen["share"] = tier_obj.gpu_share_numel
        seen["disk_after"] = tier_obj._disk.numel() if tier == "nvme" else 0

    losses = _train_steps(engine, STEPS, ACCUM, MICRO, SEED, after_step=after_step)
    seen["on_host"] = [tier_obj.steps_on_host(g) for g in trainable]
    engine.close()
    return {"losses": losses, "total": total, **seen}


@pytest.mark.skipif(torch.cuda.is_available(), reason="rebalances onto the CPU as the compute device")
@pytest.mark.parametrize(("stage", "tier", "optimizer"), [("zero3", "cpu", "cpu_adam"), ("zero2", "cpu", "adamw"), ("zero3", "nvme", "cpu_adam"), ("zero1", "nvme", "adamw")])
def test_auto_moves_the_first_groups_mid_run_and_training_matches_torch(stage, tier, optimizer, tmp_path):
    """The move of "auto" (the nvme tier's from disk: read back, off the disk from then on) keeps the
    masters' and moments' values: the run trains as torch does."""
    run = _rebalanced_run(stage, tier, tmp_path, optimizer)
    assert 0 < run["share"] <= run["total"] // 2 + 1
    assert not run["on_host"][0] and any(run["on_host"])  # the first-needed group moved, not every one
    if tier == "nvme":
        assert run["disk_before"] == run["total"] and run["disk_after"] == run["total"] - run["share"]
    assert_matches(run["losses"], reference(1), f"{stage} {tier} {optimizer}, gpu_share auto moved after step 1")
