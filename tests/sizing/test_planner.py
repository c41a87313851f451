"""Automatic placement: the default planner's choices, its error, two ranks agreeing, ``estimate --plan``."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet
from tests.support.planner_scenarios import auto_placement
from tests.support.scenarios import small_gpt
from tests.plugins.partitioners.test_partitioners import ACCUM, MICRO, SEED, STEPS, assert_matches, reference
from zkernel.spec.config import ConfigError
from zkernel.kernel.config_source import load_config
from zkernel.sizing.estimator import installed_tiers, totals
from zkernel.sizing.model_shape import TransformerShape, estimate_activations
from zkernel.spec.hookspecs import hookimpl
from zkernel.platform.sizes import format_bytes
from zkernel.spec.planner import Plan, PlacementError, Planner
from zkernel.sizing.planning import plan

GPT_SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 65, "sequence": 32}  # = small_gpt()
AUTO = {"partitioner": "auto", "offload": {"optimizer": "auto", "params": "auto"}}
RESERVE = 0.1  # the default planner's device_reserve


def stack(depth: int = 16, width: int = 128) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def settings(gpu_memory=None, ram=None, measure=False, **extra) -> dict:
    """An all-auto bf16 config whose [planner] gives the capacities; zero3 shards every unit."""
    planner = {"options": {"measure": measure}}
    planner.update({k: v for k, v in (("gpu_memory", gpu_memory), ("ram", ram)) if v is not None})
    cfg = {
        **AUTO,
        "precision": "bf16",
        "prefetch_bytes": 0,
        "partitioner_options": {"persistence_threshold": 0},
        "planner": planner,
    }
    for key, value in extra.items():
        cfg[key] = {**cfg[key], **value} if isinstance(cfg.get(key), dict) else value
    return cfg


def device_states(model, partitioner, optimizer, params, world=2, precision="bf16", **options) -> int:
    """Model-state bytes per rank on the device, from the estimator (independent of the planner)."""
    cfg = {
        "partitioner": partitioner,
        "precision": precision,
        "offload": {"optimizer": optimizer, "params": params},
        "partitioner_options": options,
    }
    return totals(zkernel.estimate(model, cfg, world, device="device")).get("device", 0)


def gpu_memory_for(budget: int) -> int:
    """The free memory whose usable part (less the device reserve) is ``budget``."""
    return math.ceil(budget / (1 - RESERVE))


def test_no_offload_when_it_fits():
    decision = plan(stack(), settings(gpu_memory="8GiB", ram="16GiB"), 2)
    assert (decision.partitioner, decision.offload_optimizer, decision.offload_params) == ("zero1", "none", "none")
    assert decision.rejected == () and dict(decision.optimizer_options) == {}
    assert decision.partitioner_options == {}  # zero3's persistence_threshold is not zero1's
    assert any("persistence_threshold" in note for note in decision.notes)
    assert decision.bytes["device"]["model_states"] == device_states(stack(), "zero1", "none", "none")
    assert decision.capacities.overridden == ("device", "host")


def test_optimizer_to_cpu_when_the_device_is_short_with_the_gpu_share_sized():
    model = stack()
    offloaded = device_states(model, "zero1", "cpu", "none")  # zero1 keeps no transient of its own
    in_place = device_states(model, "zero3", "none", "none", persistence_threshold=0)  # the least of no offload
    assert offloaded < in_place
    budget = (offloaded + in_place) // 2
    decision = plan(model, settings(gpu_memory=gpu_memory_for(budget), ram="16GiB"), 2)
    assert (decision.partitioner, decision.offload_optimizer, decision.offload_params) == ("zero1", "cpu", "none")
    assert [line.split(":")[0] for line in decision.rejected] == [
        "zero1 optimizer@device params@device",
        "zero2 optimizer@device params@device",
        "zero3 optimizer@device params@device",
    ]
    assert all("device needs" in line for line in decision.rejected)
    # The share of the optimizer kept on the GPU: what the leftover holds at 16 bytes per element.
    master = sum(p.numel() for p in model.parameters()) // 2  # this rank's fp32 master elements
    usable = decision.budgets["device"]
    assert abs(usable - budget) <= 1
    leftover = usable - offloaded
    assert decision.optimizer_options["gpu_share"] == math.floor(min(1.0, leftover / (16 * master)) * 100) / 100 > 0
    assert "gpu_share" in decision.placement


def test_parameters_to_cpu_next_then_the_error_with_the_numbers():
    model = stack()
    only_params = device_states(model, "zero3", "cpu", "none", persistence_threshold=0)  # the parameter shard
    assert only_params > 0 and device_states(model, "zero3", "cpu", "cpu", persistence_threshold=0) == 0
    # One gathered Linear (bf16 values + fp32 gradient) is the working memory of zero3.
    working = (128 * 128 + 128) * (2 + 4)
    assert working < only_params
    decision = plan(model, settings(gpu_memory=gpu_memory_for(only_params), ram="16GiB"), 2)
    assert (decision.partitioner, decision.offload_optimizer, decision.offload_params) == ("zero3", "cpu", "cpu")
    device = decision.bytes["device"]
    assert (device["working"], device["activations"]) == (working, 0)
    # What the parameter shard no longer takes holds the optimizer of the first units (placed at adopt).
    assert decision.optimizer_options["gpu_share"] > 0 and 0 < device["model_states"] <= decision.budgets["device"] - working
    assert decision.rejected[-1].startswith("zero3 optimizer@cpu params@device")

    # A byte less, and each Linear is gathered in two tiles.
    decision = plan(model, settings(gpu_memory=gpu_memory_for(working - 1), ram="16GiB"), 2)
    assert (decision.offload_params, decision.tiling) == ("cpu", (128 * 128, 2))
    assert decision.bytes["device"]["working"] == working // 2

    # A kilobyte cannot hold a tile of 1/64 of a layer: nothing fits.
    with pytest.raises(PlacementError) as info:
        plan(model, settings(gpu_memory=1024, ram="16GiB"), 2)
    message = str(info.value)
    assert "no placement fits: 264,192 parameters, bf16, 2 rank(s)" in message
    assert f"device {format_bytes(int(1024 * 0.9))}, nvme" in message
    assert "zero3 optimizer@cpu params@cpu: device needs" in message
    assert "to make it fit: more ranks" in message

    with pytest.raises(PlacementError, match="more host memory"):  # the host cannot take the offloaded state
        plan(model, settings(gpu_memory=gpu_memory_for(only_params), ram="64KiB"), 2)


def test_fixed_keys_are_kept_and_tiers_must_be_known():
    cfg = settings(gpu_memory="8GiB", ram="16GiB")
    cfg["partitioner"] = "zero3"
    decision = plan(stack(), cfg, 2)
    assert (decision.partitioner, decision.offload_optimizer) == ("zero3", "none")
    assert decision.partitioner_options == {"persistence_threshold": 0}
    applied = decision.apply(load_config(cfg))
    assert (applied.partitioner, applied.offload.optimizer, applied.offload.params) == ("zero3", "none", "none")
    with pytest.raises(PlacementError, match="not offload.optimizer 'faraway'"):
        plan(stack(), {**cfg, "offload": {"optimizer": "faraway", "params": "auto"}}, 2)
    # "auto" parameters with a partitioner that keeps them whole resolve to "none".
    decision = plan(stack(), {**settings(gpu_memory="8GiB", ram="16GiB"), "partitioner": "zero1", "partitioner_options": {}}, 2)
    assert decision.offload_params == "none"


def _nvme_plugin():
    class FarAwayDisk:  # offers the name "nvme" only; plan() never builds a tier
        @hookimpl
        def zkernel_register_offload_tiers(self, registry):
            registry.add("nvme", lambda context, role: None, description="name only (planner test)")

    return FarAwayDisk()


def test_host_memory_short_keeps_the_optimizer_off_the_disk_while_the_gpu_has_room(tmp_path):
    """The host cannot take the offloaded optimizer of zero1/2, nor zero3's without help. The cpu
    tier keeps its first units' optimizer on the GPU from the start (placed at adopt), so zero3 with
    the cpu tier and a GPU share fits before any swap file: nothing on the disk, no page-locked
    stream pool. The disk probes still run (nvme is usable), and leave nothing behind."""
    model = stack()
    plugins = () if "nvme" in installed_tiers(load_config({})) else (_nvme_plugin(),)
    budget = device_states(model, "zero1", "cpu", "none")

    def host(tier: str) -> int:
        offload = {"optimizer": tier, "nvme_path": str(tmp_path)}
        cfg = {"partitioner": "zero1", "precision": "bf16", "offload": offload}
        return totals(zkernel.estimate(model, cfg, 2, device="device"))["cpu"]

    assert host("nvme") < host("cpu")
    ram = math.ceil((host("nvme") + host("cpu")) / 2 * 2 / 0.9)  # two ranks share it, 10% left to others
    cfg = settings(gpu_memory=gpu_memory_for(budget + 4096), ram=ram, offload={"nvme_path": str(tmp_path / "swap")}, measure=True)
    decision = plan(model, cfg, 2, plugins=plugins)
    assert (decision.partitioner, decision.offload_optimizer, decision.offload_params) == ("zero3", "cpu", "none")
    assert any(line.startswith("zero1 optimizer@cpu") and "cpu needs" in line for line in decision.rejected)
    assert 0 < decision.optimizer_options["gpu_share"] < 1 and "nvme" not in decision.bytes
    assert "swap_pools" not in decision.bytes["cpu"]
    for place, kinds in decision.bytes.items():
        assert sum(kinds.values()) <= decision.budgets[place], (place, kinds)
    assert decision.measurements["disk_write"].rate > 0 and decision.measurements["disk_read"].rate > 0
    assert not (tmp_path / "swap").exists()  # the probe removed its file and the directory it made
    # Host memory for no tier's share of this model, and no disk: the error says what would help.
    without = settings(gpu_memory=gpu_memory_for(budget + 4096), ram="64KiB")
    with pytest.raises(PlacementError, match="set offload.nvme_path"):
        plan(model, without, 2, plugins=plugins)


def deep_gpt():
    from zkernel.cli.demo.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=65, seq_len=32, d_model=64, n_layers=8, n_heads=4))


def test_activations_decide_checkpointing_from_the_models_own_structure():
    micro = 64
    numbers = {**GPT_SHAPE, "layers": 8}  # = deep_gpt()
    acts = {c: estimate_activations(numbers, micro, precision="bf16", checkpointing=c)["total"] for c in (False, True)}
    states = device_states(deep_gpt(), "zero1", "none", "none")
    assert acts[True] * 3 < acts[False]
    budget = states + (acts[True] + acts[False]) // 2
    cfg = settings(gpu_memory=gpu_memory_for(budget), ram="16GiB", planner={"micro_batch": micro})
    decision = plan(deep_gpt(), cfg, 2)
    assert decision.activation_checkpointing == (("Block",), "none")
    assert decision.partitioner == "zero1" and decision.offload_optimizer == "none"
    assert decision.bytes["device"]["activations"] == acts[True]
    assert any("recognised as a gpt-like decoder: 8 x Block" in note for note in decision.notes)
    applied = decision.apply(load_config(cfg))
    assert applied.activation_checkpointing.modules == ("Block",)
    # A tiled loss keeps no logits: the planner counts the smaller head ([planner] tiled_loss).
    tiled = estimate_activations(numbers, micro, precision="bf16", checkpointing=True, tiled_loss=True)["total"]
    assert tiled < acts[True]
    decision = plan(deep_gpt(), {**cfg, "planner": {**cfg["planner"], "tiled_loss": True}}, 2)
    assert decision.bytes["device"]["activations"] == tiled
    assert any("the loss tiled" in note for note in decision.notes)
    # Without a micro-batch the plan covers model states only and says so.
    decision = plan(small_gpt(), settings(gpu_memory="8GiB", ram="16GiB"), 2)
    assert decision.activation_checkpointing is None
    assert any(note.startswith("activations not planned") for note in decision.notes)


def test_a_layer_too_large_to_gather_gets_tiles_and_trains():
    model = nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 8))
    cfg = settings(gpu_memory=gpu_memory_for(4 * 512 * 9), ram="16GiB", partitioner="zero3", gradient_clipping=1.0)
    decision = plan(model, cfg, 1)
    assert decision.offload_params == "cpu" and decision.tiling is not None
    min_numel, tiles = decision.tiling
    assert min_numel == 8 * 512 and tiles == math.ceil((8 * 512 + 512) * 6 / (4 * 512 * 9))
    torch.manual_seed(0)
    engine = zkernel.initialize(model, {**cfg, "planner": {**cfg["planner"]}})
    try:
        assert engine.config.tiling.min_numel == min_numel and engine.config.tiling.tiles == tiles
        assert engine.placement_plan.tiling == decision.tiling
        assert len([m for m in engine.module.modules() if type(m).__name__ == "LinearTile"]) == 2 * tiles
        x = torch.randn(4, 8)
        losses = []
        for _ in range(3):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
    finally:
        engine.close()


def test_auto_trains_on_two_ranks_and_they_agree():
    fp32 = {"partitioner": "zero1", "offload": {"optimizer": "none"}}
    need = totals(zkernel.estimate(TrickyNet(), fp32, 2, device="device"))["device"]
    base = {
        **AUTO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.5,
        "optimizer": {"name": "adamw", "lr": 2e-2, "weight_decay": 0.1},
    }
    # zero1 without offload needs `need` bytes; 90% of it is usable: the optimizer has to move.
    config = {**base, "planner": {"gpu_memory": need, "ram": "8GiB"}}
    failing = {**base, "planner": {"gpu_memory": 1, "ram": "8GiB", "options": {"measure": False}}}
    results = run_ranks(2, auto_placement, config, failing, STEPS, ACCUM, MICRO, SEED)
    expected = reference(2)
    for rank, result in enumerate(results):
        kind, message = result["error"]
        assert kind == "PlacementError" and "no placement fits" in message, message
        assert_matches(result["losses"], expected, f"auto placement, rank {rank}")
        assert result["resolved"][:3] == ("zero1", "cpu", "none")
        assert set(result["memory"]["master_weights"]) == {"cpu"}
    assert results[0]["plan"] == results[1]["plan"] and results[0]["resolved"] == results[1]["resolved"]
    assert "failed on rank 0 (PlacementError)" in results[1]["error"][1]
    # One INFO event on rank 0 with the decision and the numbers behind it; none on rank 1.
    (event,) = results[0]["planned_events"]
    assert results[1]["planned_events"] == []
    assert event["log_level"] == "info" and event["offload_optimizer"] == "cpu"
    assert event["capacities"]["device_bytes"] == need and event["budgets"]["device"] == int(need * 0.9)
    assert isinstance(event["measurements"]["cpu_adam"], float) and event["measurements"]["cpu_adam"] > 0
    assert event["measurements"]["host_to_device"].startswith("not measured")
    assert event["predicted_seconds"]["host_optimizer_step"] >= 0


class FixedPlanner(Planner):
    def __init__(self, context) -> None:
        self.options = context.options

    def plan(self, request):
        return Plan(planner="fixed", partitioner="zero2", offload_optimizer="cpu", offload_params="none")


class FixedPlannerPlugin:
    @hookimpl
    def zkernel_register_planners(self, registry):
        registry.add("fixed", FixedPlanner, description="always zero2 with the optimizer on CPU (test)")


def test_a_third_party_planner_is_selected_by_name_and_nothing_else_sees_auto():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    engine = zkernel.initialize(model, {**AUTO, "planner": {"name": "fixed"}}, plugins=[FixedPlannerPlugin()])
    try:
        assert (engine.config.partitioner, engine.config.offload.optimizer, engine.config.offload.params) == ("zero2", "cpu", "none")
        assert engine.placement_plan.planner == "fixed"
    finally:
        engine.close()
    plain = zkernel.initialize(model, {"partitioner": "zero1"})
    assert plain.placement_plan is None
    plain.close()
    with pytest.raises(ConfigError, match="planner.name 'nowhere' is not installed; installed: default"):
        zkernel.initialize(model, {**AUTO, "planner": {"name": "nowhere"}})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"planner": {"gpu_memory": "lots"}}, "planner.gpu_memory must be a size in bytes"),
        ({"planner": {"micro_batch": 0}}, "planner.micro_batch must be an integer >= 1"),
        ({"planner": {"gpu_memroy": 1}}, "unknown config key planner.gpu_memroy; valid: name, micro_batch"),
        ({"partitioner": "zero1", "offload": {"params": "cpu"}}, "needs partitioner 'zero3'"),
    ],
)
def test_planner_config_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        zkernel.initialize(nn.Linear(2, 2), config)


def test_config_sizes_and_auto_combinations():
    with pytest.raises(ConfigError, match="partitioner = 'auto' is resolved by the planner"):
        zkernel.estimate(stack(), {"partitioner": "auto"})
    cfg = load_config({"partitioner": "auto", "offload": {"params": "auto"}, "planner": {"gpu_memory": "1.5GiB", "ram": 10}})
    assert cfg.planner.gpu_memory == int(1.5 * 2**30) and cfg.planner.ram == 10
    assert load_config({"partitioner": "zero1", "offload": {"params": "auto"}}).offload.params == "auto"
    assert load_config({"partitioner": "auto", "offload": {"params": "cpu"}}).partitioner == "auto"


def test_estimate_plan_cli_shows_the_decision_and_the_measurements(capsys, restore_zkernel_logger):
    from zkernel.cli.commands import main

    shape = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "50304", "--sequence", "1024"]
    machine = ["--precision", "bf16", "--world-size", "1", "--gpus", "1", "--ram", "128GiB", "--micro-batch", "16"]
    assert main(["estimate", *shape, *machine, "--gpu-memory", "80GiB", "--plan"]) == 0
    out = capsys.readouterr().out
    plan_text = out[out.index("placement plan"):]
    # [Note: one rank]: on one rank too the partitioner dividing least comes first
    assert "placement plan (planner 'default', 1 rank(s)): zero1, optimizer on the compute device" in plan_text
    assert "device: " in plan_text and "activations" in plan_text
    assert "measured: host to device not measured (no CUDA device)" in plan_text or torch.cuda.is_available()
    assert "cpu adam" in plan_text and "G elements/s" in plan_text

    assert main(["estimate", *shape, *machine, "--gpu-memory", "24GiB", "--plan"]) == 0
    plan_text = capsys.readouterr().out.split("placement plan")[1]
    assert "optimizer on cpu" in plan_text and "does not fit: zero1 optimizer@device" in plan_text
    assert "predicted per optimizer step: host optimizer step" in plan_text

    assert main(["estimate", *shape, *machine, "--gpu-memory", "1GiB", "--plan"]) == 1
    assert "placement plan: no placement fits" in capsys.readouterr().out


def test_infer_shape_matches_the_numbers():
    from zkernel_plugins.planners._activations import infer_shape

    shape, block, what = infer_shape(small_gpt(), None)
    assert block == "Block" and "gpt-like" in what
    expected = TransformerShape(**GPT_SHAPE)
    for micro in (1, 3):
        for ckpt in (False, True):
            assert estimate_activations(shape, micro, checkpointing=ckpt) == estimate_activations(expected, micro, checkpointing=ckpt)
    llama = TransformerShape(layers=2, hidden=64, heads=8, kv_heads=2, vocab=50, sequence=16, style="llama", tied_embeddings=False)
    inferred, block, _ = infer_shape(llama.build(), 16)
    assert inferred.mlp_width == llama.mlp_width and block == "_Block"
    assert estimate_activations(inferred, 2) == estimate_activations(llama, 2)
    assert infer_shape(nn.Linear(3, 3), 8)[0] is None


@pytest.mark.cuda
def test_cuda_measures_copies_and_the_gpu_share_lands_on_the_gpu():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))
    numel = sum(p.numel() for p in model.parameters())
    measured = plan(model, {**AUTO, "precision": "bf16"}, 1)  # this GPU's real free memory
    assert measured.measurements["host_to_device"].rate > 1e9 and measured.measurements["device_to_host"].rate > 1e9
    # Room for the offloaded placement plus half the optimizer at 16 bytes per element: gpu_share 0.5.
    offloaded = device_states(model, "zero1", "cpu", "none", world=1)
    cfg = settings(gpu_memory=gpu_memory_for(offloaded + 8 * numel))
    # The share placed after the first step, under zero1 with zero1's own options.
    cfg["partitioner"] = "zero1"
    cfg["partitioner_options"] = {"bucket_size": 1024 * 1024 + 1024}
    cfg["planner"]["options"]["measure"] = True
    engine = zkernel.initialize(model, cfg)
    try:
        assert (engine.config.partitioner, engine.config.offload.optimizer) == ("zero1", "cpu")
        assert engine.config.offload.optimizer_options["gpu_share"] == 0.5
        assert engine.placement_plan.predicted_seconds["host_device_transfers"] > 0
        x = torch.randn(4, 1024, device=engine.device)
        for _ in range(2):
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        assert engine.optimizer_tier.gpu_share_numel > 0
        masters = engine.memory_report()["master_weights"]
        assert any(place.startswith("cuda") for place in masters) and "cpu" in masters
    finally:
        engine.close()


# -- the nvme tier's spill: gpu_share and host_share sized from what the box has left ------------

GPT_13B = {"layers": 40, "hidden": 5120, "heads": 40, "vocab": 50304, "sequence": 1024}
H100_BOX = {"gpu_memory": "80GB", "ram": "125GiB", "disk": "64GB"}


def box_config(tmp_path, box: dict, **extra) -> dict:
    """bf16, everything 'auto', micro-batch 8, the machine's figures as [planner] overrides, no probes."""
    cfg = {
        **AUTO,
        "precision": "bf16",
        "offload": {**AUTO["offload"], "nvme_path": str(tmp_path)},
        "planner": {**box, "micro_batch": 8, "options": {"measure": False}},
    }
    cfg.update(extra)
    return cfg


def test_13b_on_one_h100_box_spreads_the_optimizer_over_gpu_host_and_disk(tmp_path):
    from zkernel_plugins.offload_tiers._nvme_options import NvmeTierOptions

    numel = sum(p.numel() for p in TransformerShape(**GPT_13B).build().parameters())
    assert numel == 12_848_384_000
    usable = {"device": int(80e9 * 0.9), "cpu": int(125 * 2**30 * 0.9), "nvme": 64_000_000_000}
    # No one tier holds fp32 master and Adam moments (12 bytes per element): not the disk, not the RAM.
    assert 12 * numel > usable["nvme"] and 12 * numel > usable["cpu"]
    decision = plan(GPT_13B, box_config(tmp_path, H100_BOX), 1, gpus=1)
    # The parameters stay on the GPU: host staging copies are the tier's pool (staging_buffers
    # copies as large as the largest), not one per group, so the faster placement fits.
    assert (decision.partitioner, decision.offload_optimizer, decision.offload_params) == ("zero3", "nvme", "none")
    assert decision.activation_checkpointing == (("_Block",), "none")
    g, h = decision.optimizer_options["gpu_share"], decision.optimizer_options["host_share"]
    assert 0.15 < g < 0.25 and 0.5 < h < 0.65
    NvmeTierOptions(**decision.optimizer_options)  # a valid config for the tier: fractions in [0, 1], sum <= 1
    assert f"gpu_share {g:g}, host_share {h:g}" in decision.placement
    assert any(f"gpu_share {g:g} on the GPU, host_share {h:g} in host memory, the rest in swap files" in n for n in decision.notes)
    assert dict(decision.budgets) == usable
    for place, kinds in decision.bytes.items():
        assert sum(kinds.values()) <= usable[place], (place, kinds)
    # Per tier, against the split: the fractions take whole groups, at most a thousandth less each.
    slack = 0.001 * numel
    states = {place: kinds["model_states"] for place, kinds in decision.bytes.items()}
    on_disk = (states["nvme"] - 200 * 4) / 12  # master and two moments (a step counter per group)
    assert numel * (1 - g - h) <= on_disk <= numel * (1 - g - h) + 2 * slack
    # The GPU share's masters are split (bf16, the parameters on the GPU): 2.125 bytes an element,
    # and one fp32 buffer a master is rebuilt in, as large as the largest group there (the embedding).
    rebuild = 4 * 50304 * 5120
    on_gpu = (states["device"] - 2 * numel - 200 * 4 - rebuild) / 14.125  # less the bf16 shards: master, moments, gradient
    assert numel * g - slack <= on_gpu <= numel * g
    # The model states are what `zkernel.estimate` says of the chosen config, place by place.
    chosen = decision.apply(load_config(box_config(tmp_path, H100_BOX)))
    assert states == {p.replace("cuda", "device"): n for p, n in totals(zkernel.estimate(GPT_13B, chosen, 1, device="cuda")).items() if n}
    # Without the spill (the tier fixed to nvme with no fractions) the same box has no placement.
    fixed = box_config(tmp_path, H100_BOX)
    fixed["offload"] = {**fixed["offload"], "optimizer": "nvme"}
    with pytest.raises(PlacementError, match="no placement fits: 12,848,384,000 parameters"):
        plan(GPT_13B, fixed, 1, gpus=1)


def test_a_model_the_cpu_tier_holds_keeps_the_cpu_tier(tmp_path):
    """The spill makes NVMe placements fit more often, not come earlier: a model whose optimizer fits
    in host memory still gets the cpu tier (stage 2), though nvme is usable."""
    model = stack()
    offloaded = device_states(model, "zero1", "cpu", "none")
    cfg = settings(gpu_memory=gpu_memory_for(offloaded + 4096), ram="16GiB", offload={"nvme_path": str(tmp_path)})
    decision = plan(model, cfg, 2)
    assert (decision.partitioner, decision.offload_optimizer) == ("zero1", "cpu")
    assert "host_share" not in decision.optimizer_options and "nvme" not in decision.bytes


def test_no_room_for_a_share_is_the_placement_as_before(tmp_path):
    """Training on the CPU (no GPU share) with host memory for the shards, the landing buffers and the
    stream pool only: host_share 0, every master and moment in swap files, as before the spill."""
    model = stack(depth=32, width=4096)  # 32 zero3 units of 16,781,312 elements
    unit = 4096 * 4096 + 4096
    shard = unit // 2  # per rank, of two
    # Host: bf16 shards and fp32 landing buffers of every unit, the 2 GiB pool (the files hold 3.2 GB),
    # one unit gathered with its gradient.
    host = 32 * shard * (2 + 4) + 2 * 2**30 + unit * (2 + 4)
    cfg = settings(ram=math.ceil((host + 2**20) * 2 / 0.9), offload={"nvme_path": str(tmp_path)})
    decision = plan(model, cfg, 2, gpus=0)
    assert (decision.partitioner, decision.offload_optimizer, decision.offload_params) == ("zero3", "nvme", "none")
    assert dict(decision.optimizer_options) == {}
    assert decision.bytes["cpu"] == {"model_states": 32 * shard * 6, "working": unit * 6, "activations": 0, "swap_pools": 2 * 2**30}
    assert decision.bytes["nvme"] == {"model_states": 32 * (12 * shard + 4 * 2)}  # a step count per weight and bias
    assert not any("_share" in line for line in decision.rejected)  # no room for one anywhere


def test_fractions_the_config_gives_are_kept_and_an_impossible_model_still_gets_the_numbers(tmp_path):
    small_disk = {**H100_BOX, "disk": "16GB"}
    with pytest.raises(PlacementError) as info:
        plan(GPT_13B, box_config(tmp_path, small_disk), 1, gpus=1)
    message = str(info.value)
    assert "no placement fits: 12,848,384,000 parameters, bf16, 1 rank(s)" in message
    assert "nvme 14.90 GiB" in message  # usable per rank
    assert re.search(r"zero3 optimizer@nvme params@cpu \(every block checkpointed\) with gpu_share 0\.\d+, host_share 0\.\d+: nvme needs", message)
    assert "nvme needs" in message and "more GPU or host memory" in message
    # The tier fixed with its fractions given: they are estimated as given, not sized.
    given = box_config(tmp_path, H100_BOX)
    given["offload"] = {**given["offload"], "optimizer": "nvme", "optimizer_options": {"gpu_share": 0.1, "host_share": 0.2}}
    with pytest.raises(PlacementError, match=r"with gpu_share 0.1, host_share 0.2: nvme needs"):
        plan(GPT_13B, given, 1, gpus=1)


def test_a_fixed_placement_is_judged_as_given_and_the_cpu_tiers_gpu_share_counts_under_zero3():
    """``plan(keys=())`` sizes the placement the config fixes (nothing is chosen) and raises when it
    does not fit. The cpu tier places a numeric gpu_share of zero3's units as it adopts them, so
    those elements leave host memory from the first step; under zero1 it moves them after the
    first step, which does not lower what that step needs."""
    model = stack()

    def fixed(partitioner: str, share: float, ram: str = "16GiB") -> dict:
        cfg = settings(gpu_memory="8GiB", ram=ram)
        cfg["partitioner"] = partitioner
        if partitioner != "zero3":
            cfg["partitioner_options"] = {}
        cfg["offload"] = {"optimizer": "cpu", "params": "none", "optimizer_options": {"gpu_share": share}}
        return cfg

    host = {}
    for partitioner in ("zero3", "zero1"):
        for share in (0.0, 0.5):
            decision = plan(model, fixed(partitioner, share), 1, gpus=1, keys=())
            assert (decision.partitioner, decision.offload_optimizer, decision.offload_params) == (partitioner, "cpu", "none")
            host[partitioner, share] = decision.bytes["cpu"]["model_states"]
    numel = 16 * (128 * 128 + 128)
    # Half the elements leave the host: master, two moments and fp32 landing buffer (16 bytes each),
    # a step counter per group aside. The bf16 copies updates are rounded into stay: they are lent
    # from the tier's pool (staging_buffers copies as large as the largest group), not one per group.
    assert host["zero3", 0.0] - host["zero3", 0.5] == pytest.approx(16 * numel / 2, abs=64)
    assert host["zero1", 0.5] >= host["zero1", 0.0]
    with pytest.raises(PlacementError, match="cpu needs"):
        plan(model, fixed("zero3", 0.0, ram="64KiB"), 1, gpus=1, keys=())
    with pytest.raises(ConfigError, match="cannot be planned"):
        plan(model, fixed("zero3", 0.0), 1, gpus=1, keys=("optimizer",))
    with pytest.raises(ConfigError, match="'auto' in the config but not among keys"):
        plan(model, settings(gpu_memory="8GiB", ram="16GiB"), 1, gpus=1, keys=("partitioner",))
