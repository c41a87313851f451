"""Sizing a split master ([Note: sizing a split master] in `zkernel.spec.sizing`): 2.125 bytes a
master element wherever the optimizer tier keeps it, where the run is bf16 and the parameter shards
are in memory; 4 elsewhere. fp16 keeps every byte of a bf16 run but the split (its parameter is not
the master's upper half), so it is the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zkernel
from zkernel.spec import DEVICE, Placement, Role, master_bytes, master_kept_split
from zkernel.spec.config import ConfigError
from zkernel.sizing.planning import plan

RATES = {"disk_read": 1.5e9, "disk_write": 1.3e9, "host_to_device": 44e9, "device_to_host": 50e9, "cpu_adam": 8.3e9}
GPT_8x2048 = {"layers": 8, "hidden": 2048, "heads": 16, "vocab": 50304, "sequence": 1024}


def split(numel: int) -> int:
    """A 16-bit low half and a packed tie bit each ([Note: the master's low half])."""
    return 2 * numel + (numel + 7) // 8


def placement(split_master: bool, precision: str, params: str | None) -> Placement:
    on_host = {Role.MASTER: "cpu", Role.GRAD_LANDING: "cpu", Role.OPTIMIZER_STATE: "cpu"}
    return Placement(
        optimizer=on_host, params={Role.PARAM_SHARD: params}, tier=on_host, split_master=split_master, precision=precision
    )


@pytest.mark.parametrize("numel", [1, 8, 9, 4097])
def test_a_placement_counts_a_split_master_only_where_the_run_allows_it(numel):
    for params in (DEVICE, "cpu"):
        assert placement(True, "bf16", params).master_bytes(numel) == split(numel)
    # Not bf16, the parameter shards in swap files (or not kept), or a tier that does not split: 4 bytes.
    for split_master, precision, params in [(True, "fp16", DEVICE), (True, "fp32", DEVICE), (True, "bf16", "nvme"), (True, "bf16", None), (False, "bf16", DEVICE)]:
        assert placement(split_master, precision, params).master_bytes(numel) == 4 * numel
    assert master_bytes(numel, True) == split(numel) and master_kept_split(True, "bf16", {})  # no params tier: on the device


def linears(count: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(count)))


def config(precision: str, tier: str = "nvme", params: str = "none", partitioner: str = "zero3", **options) -> dict:
    return {
        "partitioner": partitioner,
        "precision": precision,
        "partitioner_options": {"persistence_threshold": 0} if partitioner == "zero3" else {"bucket_size": 1},
        "offload": {"optimizer": tier, "params": params, "nvme_path": "/nowhere", "optimizer_options": options},
    }


def test_the_nvme_tier_splits_its_masters_on_the_gpu_in_host_memory_and_on_disk():
    """Ten groups of n: gpu_share 0.3, host_share 0.4, the rest on disk; every other byte as fp16's."""
    n = 64 * 64
    for partitioner in ("zero3", "zero1"):  # zero1's groups do not take the GPU share (placed at adopt)
        bf16 = zkernel.estimate(linears(10), config("bf16", partitioner=partitioner, gpu_share=0.3, host_share=0.4), device="cuda")
        fp16 = zkernel.estimate(linears(10), config("fp16", partitioner=partitioner, gpu_share=0.3, host_share=0.4), device="cuda")
        groups = {place: nbytes // (4 * n) for place, nbytes in fp16["master_weights"].items()}
        assert groups == ({"cuda": 3, "cpu": 4, "nvme": 3} if partitioner == "zero3" else {"cpu": 4, "nvme": 6})
        assert bf16["master_weights"] == {place: count * split(n) for place, count in groups.items()}
        assert {c: r for c, r in bf16.items() if c != "master_weights"} == {c: r for c, r in fp16.items() if c != "master_weights"}


@pytest.mark.parametrize(
    ("tier", "params"),
    [("nvme", "nvme"), ("cpu", "none"), ("cpu", "cpu")],  # the parameters in swap files; the cpu tier's default
)
def test_full_masters_where_the_split_does_not_apply(tier, params):
    n = 64 * 64
    report = zkernel.estimate(linears(4), config("bf16", tier, params), device="cuda")
    assert sum(report["master_weights"].values()) == 4 * 4 * n


def test_the_tiers_answer_their_defaults():
    from zkernel_plugins.offload_tiers._footprint import cpu_footprint, nvme_footprint
    from zkernel_plugins.offload_tiers._nvme_options import NvmeTierOptions
    from zkernel_plugins.offload_tiers.cpu import CpuTierOptions

    assert nvme_footprint("optimizer", NvmeTierOptions()).split_master is True
    assert cpu_footprint("optimizer", CpuTierOptions()).split_master is False


@pytest.mark.xfail(strict=True, raises=ConfigError, reason="needs the tiers' split_master")
def test_the_split_master_option_decides():
    """An explicit ``split_master``: true for the cpu tier, false for the nvme tier."""
    n = 64 * 64
    cpu = zkernel.estimate(linears(4), config("bf16", "cpu", split_master=True), device="cuda")
    assert cpu["master_weights"] == {"cpu": 4 * split(n)}
    nvme = zkernel.estimate(linears(4), config("bf16", "nvme", split_master=False), device="cuda")
    assert nvme["master_weights"] == {"nvme": 4 * 4 * n}


def box(precision: str, gpu_memory: str, ram: str, tmp_path) -> dict:
    return {
        "partitioner": "auto",
        "precision": precision,
        "offload": {"optimizer": "auto", "params": "auto", "nvme_path": str(tmp_path)},
        "planner": {"gpu_memory": gpu_memory, "ram": ram, "disk": "64GB", "micro_batch": 8, "options": {"measure": False}},
    }


def test_the_planner_keeps_more_on_the_gpu_and_in_host_memory_and_less_on_disk(tmp_path):
    """A GPT of 1.6 B on a 6 GB GPU with 5 GiB of host memory: the optimizer spills to disk either
    way; with split masters the same placement keeps larger shares on the GPU and in host memory,
    less on disk, and predicts a shorter disk phase."""
    plans = {p: plan(GPT_8x2048, box(p, "6GB", "5GiB", tmp_path), 1, gpus=1, rates=RATES) for p in ("bf16", "fp16")}
    bf16, fp16 = plans["bf16"], plans["fp16"]
    assert (bf16.partitioner, bf16.offload_optimizer) == (fp16.partitioner, fp16.offload_optimizer) == ("zero3", "nvme")
    assert bf16.offload_params == fp16.offload_params
    shares = {p: (d.optimizer_options["gpu_share"], d.optimizer_options.get("host_share", 0.0)) for p, d in plans.items()}
    assert shares["bf16"][0] > shares["fp16"][0] and sum(shares["bf16"]) > sum(shares["fp16"])
    disk = {p: d.bytes["nvme"]["model_states"] for p, d in plans.items()}
    assert disk["bf16"] < 0.85 * disk["fp16"]
    assert bf16.predicted_seconds["disk"] < fp16.predicted_seconds["disk"]
    assert any("keeps its fp32 masters split" in note for note in bf16.notes)
    assert not any("keeps its fp32 masters split" in note for note in fp16.notes)
    for place, kinds in bf16.bytes.items():
        assert sum(kinds.values()) <= bf16.budgets[place], (place, kinds)


def test_a_split_host_step_downloads_the_bf16_shard(tmp_path):
    """The placement fixed (zero1, the optimizer on nvme, no shares): bf16 and fp16 move the same
    bytes but for the bf16 shard the host step rebuilds its master from, 2 bytes an element more
    from the device a step."""
    seconds = {}
    for precision in ("bf16", "fp16"):
        cfg = box(precision, "80GB", "64GiB", tmp_path)
        cfg.update(partitioner="zero1", offload={"optimizer": "nvme", "params": "none", "nvme_path": str(tmp_path)})
        seconds[precision] = plan(GPT_8x2048, cfg, 1, gpus=1, keys=(), rates=RATES).predicted_seconds
    fixed = {"partitioner": "zero1", "precision": "fp16", "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path)}}
    numel = zkernel.estimate(GPT_8x2048, fixed, device="cuda")["master_weights"]["nvme"] // 4
    extra = seconds["bf16"]["host_device_transfers"] - seconds["fp16"]["host_device_transfers"]
    assert extra == pytest.approx(2 * numel / RATES["device_to_host"], abs=2e-4)
    assert seconds["bf16"]["disk"] < seconds["fp16"]["disk"]
