"""The host tiers' GPU share by default ([Note: a share by default] in ``_gpu_share``).

On CPU: the option defaults, the arithmetic that sizes ``"auto"`` from a
described GPU (free memory, the allocator's reserve and peak), and an engine
with the default options stepping every group on the host as before, like
torch. On CUDA: the default moves the first groups' optimizer to the GPU
after the first step and still trains as torch does.
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
    # The nvme tier places its shares as it adopts groups (the planner sizes them): numbers only.
    assert NvmeTierOptions().gpu_share == 0.0 and NvmeTierOptions().device_accumulation == "auto"


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
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_on_a_cpu_device_the_default_keeps_every_group_on_the_host_like_torch(stage):
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
@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_on_cuda_the_default_moves_the_first_groups_after_the_first_step(stage):
    """GPU machine: with the default options this small model's whole optimizer fits the room the
    first step left, so it moves to the GPU and steps there from the second step, as torch does."""
    from tests.kernel import test_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = test_cuda._offload_config(stage, "cpu_adam")
    cfg["offload"] = {"optimizer": "cpu"}  # the defaults
    torch.manual_seed(test_cuda.SEED)
    engine = zkernel.initialize(TrickyNet(), cfg)
    losses = _train_steps(engine, test_cuda.STEPS, test_cuda.ACCUM, test_cuda.MICRO, test_cuda.SEED)
    tier = engine.optimizer_tier
    assert tier.gpu_share_numel == sum(g.master.numel() for g in engine.groups if g.requires_grad)
    assert not any(tier.steps_on_host(g) for g in engine.groups if g.requires_grad)
    engine.close()
    for i, (a, b) in enumerate(zip(losses, test_cuda._reference(1))):
        assert abs(a - b) <= 2e-5 * abs(b), f"{stage} step {i}: {a} vs {b}"
