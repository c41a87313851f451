"""Sizing a split master ([Note: sizing a split master] in `zkernel.spec.sizing`): 2.125 bytes a
master element where the optimizer tier keeps it split (the builtin tiers: on the GPU and in host
memory), where the run is bf16 and the parameter shards are in memory; 4 elsewhere; and the buffers
a split master is rebuilt in. fp16 keeps every byte of a bf16 run but the split (its parameter is
not the master's upper half), so it is the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zkernel
from zkernel.spec import DEVICE, Placement, Role, master_bytes, master_kept_split
from zkernel.sizing.planning import plan
from zkernel.spec.planner import PlacementError

RATES = {"disk_read": 1.5e9, "disk_write": 1.3e9, "host_to_device": 44e9, "device_to_host": 50e9, "cpu_adam": 8.3e9}
GPT_8x2048 = {"layers": 8, "hidden": 2048, "heads": 16, "vocab": 50304, "sequence": 1024}


def split(numel: int) -> int:
    """A 16-bit low half and a packed tie bit each ([Note: the master's low half])."""
    return 2 * numel + (numel + 7) // 8


def placement(split_master: tuple[str, ...], precision: str, params: str | None, where: str = "cpu") -> Placement:
    optimizer = {Role.MASTER: where, Role.GRAD_LANDING: "cpu", Role.OPTIMIZER_STATE: where}
    return Placement(
        optimizer=optimizer, params={Role.PARAM_SHARD: params}, tier=optimizer, split_master=split_master, precision=precision
    )


IN_MEMORY = (DEVICE, "cpu")  # where the builtin tiers split masters


@pytest.mark.parametrize("numel", [1, 8, 9, 4097])
def test_a_placement_counts_a_split_master_only_where_the_run_allows_it(numel):
    for params in (DEVICE, "cpu"):
        for where in IN_MEMORY:
            assert placement(IN_MEMORY, "bf16", params, where).master_bytes(numel) == split(numel)
    # Not bf16, the parameter shards in swap files (or not kept), a master in a place the tier does
    # not split (swap files), a tier that does not split: 4 bytes.
    for places, precision, params, where in [
        (IN_MEMORY, "fp16", DEVICE, "cpu"),
        (IN_MEMORY, "fp32", DEVICE, "cpu"),
        (IN_MEMORY, "bf16", "nvme", "cpu"),
        (IN_MEMORY, "bf16", None, "cpu"),
        (IN_MEMORY, "bf16", DEVICE, "nvme"),
        ((), "bf16", DEVICE, "cpu"),
    ]:
        assert placement(places, precision, params, where).master_bytes(numel) == 4 * numel
    assert master_bytes(numel, True) == split(numel)
    assert master_kept_split(IN_MEMORY, "bf16", {}, DEVICE)  # no params tier: the parameters on the device


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


def test_the_nvme_tier_splits_its_masters_on_the_gpu_and_in_host_memory():
    """Ten groups of n: gpu_share 0.3, host_share 0.4, the rest on disk, whole. Each place of split
    masters rebuilds one at a time into an fp32 buffer (host memory downloads its parameter from the
    GPU into a bf16 one); every other byte is fp16's."""
    n = 64 * 64
    for partitioner in ("zero3", "zero1"):  # zero1's groups do not take the GPU share (placed at adopt)
        bf16 = zkernel.estimate(linears(10), config("bf16", partitioner=partitioner, gpu_share=0.3, host_share=0.4), device="cuda")
        fp16 = zkernel.estimate(linears(10), config("fp16", partitioner=partitioner, gpu_share=0.3, host_share=0.4), device="cuda")
        groups = {place: nbytes // (4 * n) for place, nbytes in fp16["master_weights"].items()}
        assert groups == ({"cuda": 3, "cpu": 4, "nvme": 3} if partitioner == "zero3" else {"cpu": 4, "nvme": 6})
        rebuild = {"cuda": 4 * n, "cpu": (4 + 2) * n, "nvme": 0}
        assert bf16["master_weights"] == {
            place: count * (split(n) if place != "nvme" else 4 * n) + rebuild[place] for place, count in groups.items()
        }
        assert {c: r for c, r in bf16.items() if c != "master_weights"} == {c: r for c, r in fp16.items() if c != "master_weights"}


@pytest.mark.parametrize(
    ("tier", "params", "options"),
    [
        ("nvme", "nvme", {"host_share": 0.5}),  # the parameters in swap files
        ("nvme", "none", {}),  # every master in swap files
        ("cpu", "none", {}),  # the cpu tier's default
        ("cpu", "cpu", {}),
        ("nvme", "none", {"host_share": 0.5, "split_master": False}),
    ],
)
def test_full_masters_where_the_split_does_not_apply(tier, params, options):
    report = zkernel.estimate(linears(4), config("bf16", tier, params, **options), device="cuda")
    assert sum(report["master_weights"].values()) == 4 * 4 * 64 * 64


def test_the_cpu_tier_splits_when_asked():
    n = 64 * 64
    for params, download in (("none", 2 * n), ("cpu", 0)):  # the parameters on the GPU are downloaded
        report = zkernel.estimate(linears(4), config("bf16", "cpu", params, split_master=True), device="cuda")
        assert report["master_weights"] == {"cpu": 4 * split(n) + 4 * n + download}
    # On a CPU compute device the parameters are in host memory already.
    report = zkernel.estimate(linears(4), config("bf16", "cpu", split_master=True), device="cpu")
    assert report["master_weights"] == {"cpu": 4 * split(n) + 4 * n}


def test_the_tiers_answer_their_defaults():
    from zkernel_plugins.offload_tiers._footprint import cpu_footprint, nvme_footprint
    from zkernel_plugins.offload_tiers._nvme_options import NvmeTierOptions
    from zkernel_plugins.offload_tiers.cpu import CpuTierOptions

    assert nvme_footprint("optimizer", NvmeTierOptions()).split_master == IN_MEMORY
    assert nvme_footprint("optimizer", NvmeTierOptions(split_master=False)).split_master == ()
    assert cpu_footprint("optimizer", CpuTierOptions()).split_master == ()
    assert cpu_footprint("optimizer", CpuTierOptions(split_master=True)).split_master == IN_MEMORY


GPT_13B = {"layers": 40, "hidden": 5120, "heads": 40, "vocab": 50304, "sequence": 1024}


def h100_box(precision: str, tmp_path) -> dict:
    """One 80 GB GPU, 125 GiB of RAM, a 64 GB disk; bf16 or fp16 (which keeps whole masters)."""
    return {
        "partitioner": "auto",
        "precision": precision,
        "offload": {"optimizer": "auto", "params": "auto", "nvme_path": str(tmp_path)},
        "planner": {"gpu_memory": "80GB", "ram": "125GiB", "disk": "64GB", "micro_batch": 8, "options": {"measure": False}},
    }


def test_the_planner_keeps_more_on_the_gpu_and_in_host_memory_and_less_on_disk(tmp_path):
    """A 12.8 B GPT whose optimizer spills to disk either way: with split masters the same placement
    keeps larger shares on the GPU and in host memory, about a third less on disk, and predicts a
    shorter disk phase."""
    plans = {p: plan(GPT_13B, h100_box(p, tmp_path), 1, gpus=1, rates=RATES) for p in ("bf16", "fp16")}
    bf16, fp16 = plans["bf16"], plans["fp16"]
    placements = {p: (d.partitioner, d.offload_optimizer, d.offload_params, d.activation_checkpointing) for p, d in plans.items()}
    assert placements["bf16"] == placements["fp16"] == ("zero3", "nvme", "none", (("_Block",), "none"))
    shares = {p: (d.optimizer_options["gpu_share"], d.optimizer_options["host_share"]) for p, d in plans.items()}
    assert shares["bf16"][0] > shares["fp16"][0] and shares["bf16"][1] > shares["fp16"][1]
    disk = {p: d.bytes["nvme"]["model_states"] for p, d in plans.items()}
    assert disk["bf16"] < 0.7 * disk["fp16"]
    assert bf16.predicted_seconds["disk"] < 0.7 * fp16.predicted_seconds["disk"]
    assert any("keeps its fp32 masters on the GPU and in host memory split" in note for note in bf16.notes)
    assert not any("split" in note for note in fp16.notes)
    for place, kinds in bf16.bytes.items():
        assert sum(kinds.values()) <= bf16.budgets[place], (place, kinds)


def test_a_split_host_step_downloads_the_bf16_shard(tmp_path):
    """The placement fixed (zero1, the optimizer on nvme, half of it in host memory): bf16 and fp16
    move the same bytes but for the bf16 shard the host step rebuilds a host master from, 2 bytes an
    element of the host half more from the device a step."""
    seconds = {}
    for precision in ("bf16", "fp16"):
        cfg = {
            "partitioner": "zero1",
            "precision": precision,
            "offload": {"optimizer": "nvme", "params": "none", "nvme_path": str(tmp_path), "optimizer_options": {"host_share": 0.5}},
            "planner": {"gpu_memory": "80GB", "ram": "64GiB", "disk": "64GB", "options": {"measure": False}},
        }
        seconds[precision] = plan(GPT_8x2048, cfg, 1, gpus=1, keys=(), rates=RATES).predicted_seconds
    fixed = {"partitioner": "zero1", "precision": "fp16", "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path)}}
    numel = zkernel.estimate(GPT_8x2048, fixed, device="cuda")["master_weights"]["nvme"] // 4
    extra = seconds["bf16"]["host_device_transfers"] - seconds["fp16"]["host_device_transfers"]
    assert extra == pytest.approx(2 * (numel // 2) / RATES["device_to_host"], abs=2e-4)
    assert seconds["bf16"]["disk"] == seconds["fp16"]["disk"]  # swap files hold whole masters


def test_where_the_rebuild_buffers_do_not_fit_the_planner_keeps_masters_whole(tmp_path):
    """A 1.6 B GPT on a 6 GB GPU with 5 GiB of host memory: its embedding (103 M elements) is the
    largest group, so the buffers a split master is rebuilt in (412 MB on the GPU, 618 MB on the
    host) cost more than the small shares save. The planner turns the split off (the tier's
    split_master false) and finds fp16's placement."""
    box = {"gpu_memory": "6GB", "ram": "5GiB", "disk": "64GB", "micro_batch": 8, "options": {"measure": False}}
    plans = {}
    for precision in ("bf16", "fp16"):
        cfg = {**h100_box(precision, tmp_path), "planner": box}
        plans[precision] = plan(GPT_8x2048, cfg, 1, gpus=1, rates=RATES)
    bf16, fp16 = plans["bf16"], plans["fp16"]
    assert (bf16.partitioner, bf16.offload_optimizer, bf16.offload_params) == (fp16.partitioner, fp16.offload_optimizer, fp16.offload_params)
    assert bf16.offload_optimizer == "nvme" and bf16.optimizer_options == {**fp16.optimizer_options, "split_master": False}
    assert bf16.bytes == fp16.bytes
    assert any("keeps its masters whole (split_master false)" in note for note in bf16.notes)
    # The tier the config fixes with its split asked for is judged as given: nothing fits.
    fixed = {**h100_box("bf16", tmp_path), "planner": box}
    fixed["offload"] = {**fixed["offload"], "optimizer": "nvme", "optimizer_options": {"split_master": True}}
    with pytest.raises(PlacementError, match="no placement fits"):
        plan(GPT_8x2048, fixed, 1, gpus=1, rates=RATES)
