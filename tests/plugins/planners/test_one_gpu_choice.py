"""The default planner's choice for the GPT shapes BENCHMARKS.md measures on one H200 ([Note: one rank]).

The machine is described, not detected: one GPU of 141 GiB, 125 GiB of RAM,
no NVMe path; the bandwidth probes are off, so only the bytes decide. On one
rank zero1 comes first as over ranks: it keeps the parameters whole and so
neither casts the master at each gather nor copies each gradient, the
fastest placement measured on GPT-6.7B at micro-batches of 8 once every block
is recomputed (BENCHMARKS.md, issue 46, goal 3).
"""

from __future__ import annotations

import pytest

from zkernel.sizing.planning import plan

H200 = {"gpu_memory": "141GiB", "ram": "125GiB"}
GPT_1_3B = {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50304, "sequence": 1024}
GPT_6_7B = {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 50304, "sequence": 1024}


def auto_config(micro_batch: int, machine: dict = H200) -> dict:
    """The README's automatic placement: every key "auto", bf16, the [planner] hints and the machine."""
    return {
        "partitioner": "auto",
        "precision": "bf16",
        "offload": {"optimizer": "auto", "params": "auto"},
        "planner": {"micro_batch": micro_batch, "options": {"measure": False}, **machine},
    }


def placement(decision) -> tuple:
    return decision.partitioner, decision.offload_optimizer, decision.offload_params, decision.activation_checkpointing


def test_gpt_1_3b_on_one_h200_is_zero1_without_offload_or_checkpointing():
    decision = plan(GPT_1_3B, auto_config(16), 1, gpus=1)
    assert placement(decision) == ("zero1", "none", "none", None)
    assert decision.rejected == ()  # the first candidate tried fits
    assert dict(decision.optimizer_options) == {}


def test_gpt_6_7b_on_one_h200_recomputes_blocks_instead_of_offloading():
    decision = plan(GPT_6_7B, auto_config(8), 1, gpus=1)
    assert placement(decision) == ("zero1", "none", "none", (("_Block",), "none"))
    device = decision.bytes["device"]
    assert sum(device.values()) <= decision.budgets["device"]
    # Every partitioner without checkpointing was tried first, zero3 too, and is short of device
    # memory; checkpointed, zero1 (the first tried) fits.
    assert [line.split(" (")[0] for line in decision.rejected] == [
        f"{p} optimizer@device params@device" for p in ("zero1", "zero2", "zero3")
    ]
    assert all("(no checkpointing)" in line for line in decision.rejected)


@pytest.mark.parametrize("gpu_memory", ["139GiB", "141GiB"])  # torch reports an H200 as ~139.8 GiB
def test_the_choice_holds_on_the_memory_torch_reports(gpu_memory):
    machine = {**H200, "gpu_memory": gpu_memory}
    assert placement(plan(GPT_6_7B, auto_config(8, machine), 1, gpus=1))[:3] == ("zero1", "none", "none")


def test_two_ranks_keep_the_order_that_communicates_least():
    """Over ranks, as on one, the partitioner that divides less comes first: zero1 for 1.3B on two H200s."""
    decision = plan(GPT_1_3B, auto_config(16), 2, gpus=2)
    assert placement(decision) == ("zero1", "none", "none", None)


def test_an_h100_offloads_the_optimizer_with_a_gpu_share():
    """Where 6.7B does not fit an 80 GiB GPU even recomputed, the optimizer goes to the cpu tier with
    the first groups' optimizer kept on the GPU (sized by the planner)."""
    decision = plan(GPT_6_7B, auto_config(8, {"gpu_memory": "79GiB", "ram": "125GiB"}), 1, gpus=1)
    assert placement(decision)[:3] == ("zero1", "cpu", "none")
    assert 0 < decision.optimizer_options["gpu_share"] < 1
