"""Every partitioner, on 1-4 real gloo processes, against single-process torch AdamW."""

from __future__ import annotations

from tests.support.paths import REPO
import pytest
import torch

import zkernel

from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses, weight_penalty
from tests.support.scenarios import train, train_many, user_access

STEPS, ACCUM, MICRO, SEED = 8, 2, 3, 1234
LR, WD, CLIP = 2e-2, 0.1, 0.5
STAGES = ("none", "zero1", "zero2", "zero3")


def config(stage: str) -> dict:
    cfg = {
        "partitioner": stage,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"name": "adamw", "lr": LR, "weight_decay": WD},
    }
    if stage == "zero3":
        cfg["partitioner_options"] = {"persistence_threshold": 0}
    else:
        cfg["partitioner_options"] = {"bucket_size": 300}  # several buckets
    return cfg


def reference(world: int) -> list[float]:
    torch.manual_seed(SEED)
    model = TrickyNet()
    return reference_losses(model, batches(SEED + 1, STEPS, ACCUM, world, MICRO), LR, WD, CLIP)


def assert_matches(losses, expected, label):
    assert len(losses) == len(expected) == STEPS
    for i, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{label}: step {i}: zkernel {a!r} vs torch {b!r}"
    assert expected[-1] < expected[0], "the reference itself should learn"


@pytest.mark.parametrize("stage", STAGES)
def test_single_process_matches_torch(stage):
    result = train(config(stage), STEPS, ACCUM, MICRO, SEED)
    assert_matches(result["losses"], reference(1), f"{stage} world 1")
    # Only the tied embedding is used outside its own module; every other unit is
    # released after its forward, with prefetch running from step 2 on.
    assert result["external"] == (["embed"] if stage == "zero3" else [])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_multi_rank_matches_torch(world):
    results = run_ranks(world, train_many, [config(s) for s in STAGES], STEPS, ACCUM, MICRO, SEED)
    expected = reference(world)
    for rank_results in results:
        for stage, result in zip(STAGES, rank_results):
            assert_matches(result["losses"], expected, f"{stage} world {world}")


@pytest.mark.parametrize("stage", STAGES)
def test_native_cpu_adam_matches_torch(stage):
    """The native optimizer through the whole engine, on CPU shards."""
    cfg = config(stage)
    cfg["optimizer"] = {**cfg["optimizer"], "name": "cpu_adam"}
    result = train(cfg, STEPS, ACCUM, MICRO, SEED)
    assert_matches(result["losses"], reference(1), f"{stage} cpu_adam world 1")


def test_zero3_unit_variants_match_torch():
    mixed = config("zero3")
    mixed["partitioner_options"] = {"persistence_threshold": 200}  # norm, gain, frozen bias stay whole
    blocks = config("zero3")
    blocks["partitioner_options"] = {"persistence_threshold": 0, "units": "blocks"}
    native = config("zero2")
    native["optimizer"] = {**native["optimizer"], "name": "cpu_adam"}
    results = run_ranks(2, train_many, [mixed, blocks, native], STEPS, ACCUM, MICRO, SEED)
    for rank_results in results:
        assert_matches(rank_results[0]["losses"], reference(2), "zero3 mixed persistence world 2")
        assert_matches(rank_results[1]["losses"], reference(2), "zero3 block units world 2")
        assert_matches(rank_results[2]["losses"], reference(2), "zero2 cpu_adam world 2")


def test_user_code_reads_parameters_between_forward_backward_and_steps():
    """A penalty on a weight outside any forward; full values read between steps; views stay valid."""
    torch.manual_seed(SEED)
    model = TrickyNet()
    expected = reference_losses(
        model, batches(SEED + 1, STEPS, ACCUM, 2, MICRO), LR, WD, CLIP, penalty=weight_penalty
    )
    results = run_ranks(2, user_access, config("zero3"), STEPS, ACCUM, MICRO, SEED)
    for r in results:
        assert_matches(r["losses"], expected, "zero3 with user reads, world 2")
        assert r["released_sizes"] == [0] * STEPS, "between steps ZeRO-3 parameters are released"
        for name, p in model.named_parameters():
            assert torch.allclose(r["values"][name], p.detach(), rtol=1e-4, atol=1e-6), name
        assert torch.equal(r["kept"], r["values"]["block.2.weight"]), "a view kept from the block stays valid"
        assert r["released"] == 0


def _rank_order_inputs(device="cpu"):
    """Three ranks' bf16 contributions whose fp32 sum depends on the order: 2**24 + 1 rounds to 2**24."""
    big = torch.full((5,), 2.0**24, dtype=torch.bfloat16, device=device)
    return [big, torch.ones(5, dtype=torch.bfloat16, device=device), -big]


def test_peer_reduction_sums_the_ranks_in_rank_order_in_fp32():
    """The sum of the peer reductions: each rank's slice in rank order, in fp32, times 1/world; on two
    ranks exactly NCCL's fp32 (a + b) / 2 of the compute-dtype gradients."""
    from zkernel_plugins.partitioners._peer_reduce import mean_of_ranks

    rows = _rank_order_inputs()
    for rank in range(3):
        out = torch.empty(5)
        mean_of_ranks(out, rows[rank], torch.stack([r for i, r in enumerate(rows) if i != rank]), rank, 3)
        assert torch.equal(out, torch.zeros(5)), (rank, out)  # (2**24 + 1) - 2**24 in fp32, not 1/3
    a, b = torch.randn(1000).bfloat16(), torch.randn(1000).bfloat16()
    out = torch.empty(1000)
    mean_of_ranks(out, b, a[None], 1, 2)
    assert torch.equal(out, (a.float() + b.float()) * 0.5)


def test_gradients_copied_into_a_slot_land_flat_with_zeros_where_none():
    """The peer reductions' copy into a slot (`copy_grads_by_copy_engine`): large gradients one copy
    each, small or odd ones together; a parameter without a gradient and the padding read as zeros
    whatever the slot held; every ``.grad`` is dropped and returned for the stream to keep alive."""
    from zkernel_plugins.partitioners._flat import COPY_ENGINE_MIN_BYTES, FlatLayout, copy_grads_by_copy_engine

    big = COPY_ENGINE_MIN_BYTES // 2 + 3  # elements of bf16: at least the threshold in bytes
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (big, 5, 7, big)]
    params.append(torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16)))
    grads = [torch.randn(p.shape).bfloat16() for p in params]
    grads[4] = torch.randn(3, 4).bfloat16().t()  # not contiguous: goes with the small ones
    for p, g in zip(params, grads):
        p.grad = g
    params[2].grad = None  # no gradient in this backward
    flat = FlatLayout.of(params, shards=3, rank=1)
    slot = torch.full((flat.padded,), float("nan"), dtype=torch.bfloat16)  # what an earlier reduction left
    kept = copy_grads_by_copy_engine(params, flat, slot)
    expected = [g if i != 2 else torch.zeros(7, dtype=torch.bfloat16) for i, g in enumerate(grads)]
    for view, want in zip(flat.views(slot), expected):
        assert torch.equal(view, want)
    padding = torch.ones(flat.padded, dtype=torch.bool)
    for offset, numel in zip(flat.offsets, flat.numels):
        padding[offset : offset + numel] = False
    assert flat.gaps and flat.padded > flat.numel  # between the odd sizes, and at the end
    assert torch.equal(slot[padding], torch.zeros(int(padding.sum()), dtype=torch.bfloat16))
    assert all(p.grad is None for p in params)
    assert [id(g) for g in kept] == [id(g) for i, g in enumerate(grads) if i != 2]


def test_every_parameter_and_shard_starts_on_an_aligned_element():
    """[Note: aligned parameters]: odd sizes before a weight do not move it off the boundary, in the
    layout or in the parameters zero3 gathers (views of its flat buffer); the tests above train the
    odd-sized TrickyNet like torch with the gaps."""
    from zkernel_plugins.partitioners._flat import ALIGN, FlatLayout

    params = [torch.zeros(n) for n in (30522, 1, 768 * 768, 3, 5)]
    for shards in (1, 2, 3):
        flat = FlatLayout.of(params, shards=shards, rank=shards - 1)
        assert all(offset % ALIGN == 0 for offset in flat.offsets)
        assert flat.shard_size % ALIGN == 0 and flat.own.start % ALIGN == 0
        assert flat.numel == flat.offsets[-1] + 5 and flat.padded >= flat.numel

    torch.manual_seed(SEED)
    options = {"units": "blocks", "persistence_threshold": 0}
    engine = zkernel.initialize(TrickyNet(), {**config("zero3"), "partitioner_options": options})
    seen = []

    def check(module, args):  # runs after zkernel's own pre-hook has gathered the unit
        seen.extend((name, p.data_ptr() % 16) for name, p in module.named_parameters(recurse=False))

    for module in engine.module.modules():
        module.register_forward_pre_hook(check)
    (tokens, targets), = batches(SEED, 1, 1, 1, MICRO)[0][0]
    engine.backward(engine(tokens, targets))
    engine.step()
    engine.close()
    assert len(seen) >= 8 and [name for name, rest in seen if rest] == []


def test_peer_gathers_auto_pools_every_unit_of_a_model_whose_shards_average_4_mib():
    """``peer_gathers = "auto"`` decides for the model ([Note: peer gathers]): GPT-1.3B at one unit per
    module on two ranks (bf16 shards of 4-17 MB, mean 13.5) gathers every unit through the pool;
    GPT-350m (1-4 MB, mean 3.6), whose step the host bounds, only its 51 MB embedding; with one unit per
    block both pool everything. "always" and "never" hold whatever the sizes."""
    import math
    import sys
    from pathlib import Path

    from zkernel_plugins.partitioners._flat import FlatLayout, module_units
    from zkernel_plugins.partitioners._peer_gather import AUTO_MIN_SHARD_BYTES, pool_threshold

    sys.path.insert(0, str(REPO / "bench"))
    try:
        from gpt_model import GPT, PRESETS
    finally:
        sys.path.pop(0)

    def shard_bytes(preset: str, units: str) -> list[int]:
        with torch.device("meta"):
            model = GPT(**PRESETS[preset], seq=1024)
        parts = [[p for _, p in named] for _, _, named in module_units(model, units)]
        gathered = [ps for ps in parts if sum(p.numel() for p in ps) >= 100_000]  # zero3's default persistence
        return [FlatLayout.of(ps, 2, 0).shard_size * 2 for ps in gathered]

    large, small = shard_bytes("1.3b", "modules"), shard_bytes("350m", "modules")
    assert min(large) < AUTO_MIN_SHARD_BYTES and pool_threshold(large, "auto") == 0
    threshold = pool_threshold(small, "auto")
    assert threshold == AUTO_MIN_SHARD_BYTES and [b for b in small if b >= threshold] == [max(small)]
    assert pool_threshold(shard_bytes("350m", "blocks"), "auto") == 0
    assert pool_threshold(small, "always") == 0 and pool_threshold(large, "never") == math.inf


def test_peer_gathers_fall_back_together_where_memory_cannot_be_mapped():
    """Where a rank cannot map the pool (here: the CPU has no symmetric memory), every rank learns it
    and "auto" gathers with NCCL; "always" raises, naming the key and the way out."""
    from tests.support.scenarios import peer_pool_where_it_cannot_map

    for result in run_ranks(2, peer_pool_where_it_cannot_map):
        assert result["fallback"] is None
        assert "could not map its parameter shards" in result["error"]
        assert 'partitioner_options.peer_gathers = "never"' in result["error"]
