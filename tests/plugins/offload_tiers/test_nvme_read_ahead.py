"""The nvme optimizer tier reads the next step's state ahead into its pool ([Note: read-ahead] in
``_nvme_optimizer``): the reads leave the step, the updates stay torch AdamW's (accumulation,
clipping, two gloo ranks, pools that hold a few groups, an order that changes), and a checkpoint
load or a refused write while state is read ahead loses nothing."""

from __future__ import annotations

import pytest
import torch

import zkernel
from tests.plugins.offload_tiers.test_nvme import SMALL_IO, optimizer_on_nvme
from tests.plugins.partitioners.test_partitioners import ACCUM, MICRO, SEED, STEPS, assert_matches, reference
from tests.support.branch_scenarios import BranchNet, branch_of, reference_branching
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches
from tests.support.nvme_scenarios import RUN_GLOB, write_failure
from tests.support.scenarios import train, train_many

# Each small group's file image is four 4 KiB-aligned segments (master, two moments, step): a pool of
# this many bytes holds two groups at once, fewer than the models have.
TWO_GROUPS = 4096 * 8


def _refused_write_with_a_small_pool(nvme_path: str) -> dict:
    return write_failure(nvme_path, "optimizer", buffer_bytes=TWO_GROUPS)


def _settle(engine) -> None:
    """Every update, write-back and read-ahead started so far done."""
    engine.pipeline.wait_all()
    engine.optimizer_tier.wait_writes()


@pytest.mark.parametrize("pool", ["every group", "two groups"])
def test_the_next_steps_state_is_read_before_its_step(pool, tmp_path):
    """After a step settles, the pool holds the next step's first groups (every group, where it has
    room for all: their written-back blocks are kept, and no read is issued at all), so nothing is
    read while the next window computes; each step writes each group once and reads each group at
    most once. fp32 against torch; bf16 (where a block goes back to the pool as soon as its writes
    end, [Note: block reuse]) against the ``cpu`` tier bit for bit."""
    options = {} if pool == "every group" else {"buffer_bytes": TWO_GROUPS}
    precision = "fp32" if pool == "every group" else "bf16"
    cfg = optimizer_on_nvme("zero3", "cpu_adam", tmp_path, **options)
    cfg["precision"] = precision
    torch.manual_seed(SEED)
    engine = zkernel.initialize(TrickyNet(), cfg)
    tier = engine.optimizer_tier
    data = batches(SEED + 1, STEPS, ACCUM, 1, MICRO)
    footprint = tier.nbytes_on_disk
    ahead = footprint if pool == "every group" else TWO_GROUPS
    read_per_step = 0 if pool == "every group" else footprint
    losses = []

    def window(step, before) -> None:
        total = torch.zeros((), device=engine.device)  # (summed as `scenarios._train_steps` does)
        for micro in step:
            tokens, targets = (t.to(engine.device) for t in micro[0])
            loss = engine(tokens, targets)
            engine.backward(loss)
            if micro is step[-1] and before is not None:
                assert (tier.bytes_read, tier.bytes_written) == before  # nothing read while it computed
            engine.step()
            total += loss.detach().float() / len(step)
        losses.append(total.item())

    window(data[0], None)
    for step in data[1:]:
        _settle(engine)
        assert tier.read_ahead_bytes == ahead
        before = tier.bytes_read, tier.bytes_written
        window(step, before)
        _settle(engine)
        read = tier.bytes_read - before[0]
        # Each group is read at most once a step. Through the small pool, a block whose write-back ends
        # before the read-ahead needs its room is kept as its group's next read instead of read again:
        # whether it does depends on the disk's timing, so up to a pool's worth fewer bytes are read.
        assert read_per_step - (ahead if read_per_step else 0) <= read <= read_per_step, (read, read_per_step)
        assert tier.bytes_written - before[1] == footprint
    assert tier.read_ahead_evictions == 0
    engine.close()
    if precision == "fp32":
        assert_matches(losses, reference(1), f"read-ahead through a pool of {pool}")
    else:
        host = optimizer_on_nvme("zero3", "cpu_adam", tmp_path)
        host["offload"] = {"optimizer": "cpu", "optimizer_options": {"speculate": "never", "gpu_share": 0.0}}  # as the nvme tier
        host["precision"] = "bf16"
        assert losses == train(host, STEPS, ACCUM, MICRO, SEED)["losses"]


def test_pools_of_two_groups_match_torch_on_two_ranks(tmp_path):
    """Accumulation and clipping on two gloo ranks, zero2 and zero3, with a pool that holds two groups:
    the read-ahead takes the room this step's last writes give back, and never a wanted group's."""
    configs = [optimizer_on_nvme(stage, "cpu_adam", tmp_path, buffer_bytes=TWO_GROUPS) for stage in ("zero2", "zero3")]
    for cfg in configs:
        cfg["partitioner_options"] = {"bucket_size": 300} if cfg["partitioner"] == "zero2" else {"persistence_threshold": 0}
    for rank_results in run_ranks(2, train_many, configs, STEPS, ACCUM, MICRO, SEED):
        for cfg, result in zip(configs, rank_results):
            assert_matches(result["losses"], reference(2), f"{cfg['partitioner']} two-group pool world 2")
    assert not sorted(tmp_path.glob(RUN_GLOB))


def test_an_order_that_changes_evicts_read_ahead_and_matches_torch(tmp_path):
    """Branches taken in turn (the group stepped now was not stepped last time, so it was not read
    ahead) through a pool of two groups full of read-ahead: the wanted group takes the room of the
    newest read-ahead, and the losses are torch's."""
    cfg = {
        "partitioner": "zero3",
        "optimizer": {"name": "cpu_adam", "lr": 2e-2},
        "partitioner_options": {"persistence_threshold": 0},
        "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path),
                    "optimizer_options": dict(SMALL_IO, buffer_bytes=TWO_GROUPS)},
    }
    torch.manual_seed(3)
    engine = zkernel.initialize(BranchNet(), cfg)
    losses = []
    for i, step in enumerate(batches(9, 6, 1, 1, 3)):
        tokens, targets = step[0][0]
        loss = engine(tokens, targets, branch=branch_of(i))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    evictions = engine.optimizer_tier.read_ahead_evictions
    engine.close()
    expected = reference_branching(6, 1, 2e-2)
    for i, (a, b) in enumerate(zip(losses, expected, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: {a} vs {b}"
    assert evictions > 0


def test_a_checkpoint_loaded_over_read_ahead_state_is_the_one_trained_on(tmp_path):
    """State read ahead for the next step is the pre-load state: a load into the same engine drops it,
    so training after the load repeats the steps after the save exactly."""
    (tmp_path / "swap").mkdir()
    cfg = optimizer_on_nvme("zero3", "cpu_adam", tmp_path / "swap", buffer_bytes=TWO_GROUPS)
    torch.manual_seed(SEED)
    engine = zkernel.initialize(TrickyNet(), cfg)
    data = batches(SEED + 1, 6, ACCUM, 1, MICRO)

    def run(steps) -> list[float]:
        losses = []
        for step in steps:
            total = 0.0
            for micro in step:
                tokens, targets = micro[0]
                loss = engine(tokens, targets)
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total)
        return losses

    run(data[:2])
    engine.save_checkpoint(tmp_path / "ckpt")
    first = run(data[2:4])
    _settle(engine)
    assert engine.optimizer_tier.read_ahead_bytes > 0
    engine.load_checkpoint(tmp_path / "ckpt")
    again = run(data[2:4])
    engine.close()
    assert again == first


def test_a_refused_write_while_reading_ahead_loses_nothing(tmp_path):
    """The disk refuses writes from step 3 on while later groups are read ahead through a small pool:
    the step is taken on no group, the error names the file, and the model given back is that of
    exactly the steps taken (`nvme_scenarios.write_failure`, here with a pool of two groups)."""
    out = run_ranks(1, _refused_write_with_a_small_pool, str(tmp_path))[0]
    assert out["errno"] == 27 and out["filename"].endswith(".swap"), out  # EFBIG
    assert any("kept in host memory" in note for note in out["notes"]), out
    assert out["steps"] == 3 and out["same_as_clean_steps"], out
    assert out["left_after_close"] == [], out


@pytest.mark.cuda
def test_cuda_read_ahead_through_two_group_pools_equals_the_cpu_tier_bit_for_bit(tmp_path):
    """On the GPU (blocks page-locked, updates uploaded on side streams): bf16 through a pool of two
    groups, with the parameters in host memory or on disk too, equals the ``cpu`` tier exactly."""
    from tests.kernel import test_cuda
    from tests.plugins.offload_tiers.test_nvme import _cuda_config

    for params in ("none", "cpu", "nvme"):
        disk = _cuda_config("zero3", "nvme", params, tmp_path, "bf16")
        disk["offload"]["optimizer_options"]["buffer_bytes"] = TWO_GROUPS
        host = _cuda_config("zero3", "cpu", "cpu" if params == "nvme" else params, tmp_path, "bf16")
        host["offload"]["optimizer_options"]["speculate"] = "never"  # the nvme tier never speculates
        a, b = (train(c, test_cuda.STEPS, test_cuda.ACCUM, test_cuda.MICRO, test_cuda.SEED)["losses"] for c in (host, disk))
        assert a == b, f"params {params}: {a} vs {b}"
