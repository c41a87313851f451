"""`zkernel.estimate` predicts what `memory_report()` measures, without allocating the model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet
from tests.support.scenarios import memory_after_step, small_gpt
from zkernel.spec.config import ConfigError
from zkernel.sizing.estimator import totals
from zkernel.sizing.model_shape import TransformerShape, estimate_activations

GPT_SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 65, "sequence": 32}  # = small_gpt()


def configs(tiers, nvme_path=None) -> list[dict]:
    out = []
    for tier in tiers:
        for precision in ("fp32", "bf16"):
            for partitioner, options in [
                ("none", {}),
                ("none", {"bucket_size": 5000}),
                ("zero1", {}),
                ("zero1", {"bucket_size": 5001}),
                ("zero2", {}),
                ("zero2", {"bucket_size": 4099}),
                ("zero3", {}),  # default threshold: every unit of this small model stays whole
                ("zero3", {"persistence_threshold": 0}),
                ("zero3", {"persistence_threshold": 5000}),  # the large linears sharded, the rest whole
                ("zero3", {"persistence_threshold": 0, "units": "blocks"}),
            ]:
                out.append(
                    {
                        "partitioner": partitioner,
                        "precision": precision,
                        "partitioner_options": options,
                        "gradient_accumulation_steps": 2,
                        "offload": {"optimizer": tier, **({"nvme_path": nvme_path} if tier == "nvme" else {})},
                    }
                )
    return out


def params_configs(tiers, nvme_path) -> list[dict]:
    """zero3 with the parameter shards offloaded, beside each optimizer tier."""
    out = []
    for params in [t for t in tiers if t != "none"]:
        for optimizer in tiers:
            for precision in ("fp32", "bf16"):
                out.append(
                    {
                        "partitioner": "zero3",
                        "precision": precision,
                        "partitioner_options": {"persistence_threshold": 5000},
                        "offload": {"optimizer": optimizer, "params": params, "nvme_path": nvme_path},
                    }
                )
    return out


def split_configs(nvme_path) -> list[dict]:
    """bf16 with masters kept split ([Note: sizing a split master]): the cpu tier asked to, the nvme
    tier's host share by default; the parameters on the device or in host memory."""
    out = []
    for partitioner, options, params in [
        ("zero1", {"bucket_size": 5001}, "none"),
        ("zero2", {}, "none"),
        ("zero3", {"persistence_threshold": 0}, "none"),
        ("zero3", {"persistence_threshold": 5000}, "cpu"),
    ]:
        for optimizer, tier_options in [("cpu", {"split_master": True}), ("nvme", {"host_share": 0.5})]:
            if optimizer == "nvme" and partitioner != "zero3":
                continue
            offload = {"optimizer": optimizer, "params": params, "nvme_path": nvme_path, "optimizer_options": tier_options}
            out.append({"partitioner": partitioner, "precision": "bf16", "partitioner_options": options, "offload": offload})
    return out


def peak(reports: list[dict], category: str) -> dict:
    """Per place, the most a category held over the reports."""
    out: dict = {}
    for report in reports:
        for place, nbytes in report[category].items():
            out[place] = max(out.get(place, 0), nbytes)
    return out


def assert_close(predicted: dict, measured: dict, label: str) -> None:
    assert set(predicted) == set(measured), f"{label}: places {predicted} vs {measured}"
    for place, nbytes in measured.items():
        assert abs(predicted[place] - nbytes) <= 0.05 * nbytes, f"{label}: predicted {predicted[place]} vs measured {nbytes}"


def check(predicted, measured, label) -> bool:
    """Within 5% per category and place; returns whether every figure is exact."""
    wanted = {c: measured["step"][c] for c in ("params", "master_weights", "optimizer_state")}
    wanted["grads"] = peak(measured["backward"], "grads")  # at their peak, after some backward of the window
    for category, value in wanted.items():
        assert_close(predicted[category], value, f"{label} {category}")
    return predicted == wanted


def test_estimate_matches_memory_report_on_two_ranks(tmp_path):
    """Every partitioner and option, fp32 and bf16, on every installed tier that answers for its bytes
    (for both roles: parameters offloaded under zero3 too), and masters kept split."""
    from zkernel.sizing.estimator import answering_tiers

    tiers = answering_tiers("optimizer")
    assert "none" in tiers
    # The estimate is model state: without the units a step starts gathering for the next forward
    # ([Note: prefetch across the step]), which prefetch_bytes bounds.
    cfgs = configs(tiers, str(tmp_path)) + params_configs(tiers, str(tmp_path)) + split_configs(str(tmp_path))
    cfgs = [{**c, "prefetch_bytes": 0} for c in cfgs]
    with torch.device("meta"):
        meta_gpt = small_gpt()

    def predict() -> tuple[list, list, list]:
        gpt = [zkernel.estimate(meta_gpt, cfg, world_size=2, device="cpu") for cfg in cfgs]
        shape = [zkernel.estimate(GPT_SHAPE, cfg, world_size=2, device="cpu") for cfg in cfgs]
        tricky = [zkernel.estimate(TrickyNet(), cfg, world_size=2, device="cpu") for cfg in cfgs]
        return gpt, shape, tricky

    # The estimates (seconds of one core: each loads the plugins) are made while the ranks measure.
    with ThreadPoolExecutor(1) as pool:
        predictions = pool.submit(predict)
        gpt_results, tricky_results = run_ranks(2, _measure_both, cfgs)[0]
        gpt_predicted, shape_predicted, tricky_predicted = predictions.result()
    inexact = []
    for cfg, predicted, from_shape, measured in zip(cfgs, gpt_predicted, shape_predicted, gpt_results, strict=True):
        if not check(predicted, measured, f"gpt {cfg}"):
            inexact.append(cfg)
        assert from_shape == predicted
    # tied head, frozen weight (which partitioners that keep parameters whole leave out of their
    # groups), 0-dim gain, odd sizes
    for cfg, predicted, measured in zip(cfgs, tricky_predicted, tricky_results, strict=True):
        if not check(predicted, measured, f"TrickyNet {cfg}"):
            inexact.append(cfg)
    assert not inexact, f"the builtin partitioners and tiers are modelled byte for byte; not for {inexact}"
    assert meta_gpt.wte.weight.is_meta  # read, never materialised


def test_the_estimator_and_the_planner_keep_no_model_of_a_builtin():
    """They ask the components ([Note: components answer for their bytes]): no builtin partitioner's
    name, no constant of a builtin's layout, no import of a plugin module in their code."""
    import ast
    import pathlib

    root = pathlib.Path(zkernel.__file__).resolve().parents[1]
    files = [*(root / "zkernel" / "sizing").glob("*.py"), root / "zkernel" / "kernel" / "sizing.py", *(root / "plugins" / "planners").glob("*.py")]
    assert len(files) > 5
    for path in files:
        tree = ast.parse(path.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & {"zero1", "zero2", "zero3"}, path
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"ALIGN", "_ALIGN", "TIER_PLACEMENT", "PARTITIONERS", "STAGES"}, path
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.startswith(("zkernel_plugins.partitioners", "zkernel_plugins.offload_tiers")) for m in imported), path


def _measure_both(cfgs):
    return memory_after_step("gpt", cfgs), memory_after_step("tricky", cfgs)


def test_estimate_at_world_size_one_and_scaling():
    """Sharding divides the sharded categories by the world size (up to padding); `none` replicates."""
    shape = TransformerShape(layers=24, hidden=2048, heads=16, vocab=50304, sequence=1024)
    n = sum(p.numel() for p in shape.build().parameters())
    one = zkernel.estimate(shape, {"partitioner": "none", "precision": "bf16"}, device="cuda")
    assert one["params"] == {"cuda": 2 * n} and one["master_weights"] == {"cuda": 4 * n}
    eight = zkernel.estimate(shape, {"partitioner": "zero3", "precision": "bf16", "partitioner_options": {"persistence_threshold": 0}}, 8, device="cuda")
    assert eight["params"] == {}  # bf16 zero3 gathers by casting the fp32 master: no compute-dtype shard
    assert abs(eight["master_weights"]["cuda"] - 4 * n / 8) < 4 * 8 * 200  # padding: < world per group
    assert abs(totals(eight)["cuda"] - 16 * n / 8) / (16 * n / 8) < 1e-3


def test_llama_shape_counts_its_parameters():
    shape = TransformerShape(style="llama", layers=32, hidden=4096, heads=32, vocab=32000, sequence=4096, tied_embeddings=False)
    n = sum(p.numel() for p in shape.build().parameters())
    assert n == 6_738_415_616  # Llama-2-7B
    assert shape.mlp_width == 11008


def test_model_from_an_import_path_is_built_on_meta():
    predicted = zkernel.estimate("tests.support.scenarios:small_gpt", {"partitioner": "zero2"}, 2, device="cpu")
    assert predicted == zkernel.estimate(GPT_SHAPE, {"partitioner": "zero2"}, 2, device="cpu")


@pytest.mark.parametrize(
    ("model", "config", "message"),
    [
        ("tests.support.scenarios", {}, "must be an import path 'package.module:factory'"),
        ("tests.support.scenarios:nope", {}, "cannot be imported"),
        ({"layers": 2, "hidden": 64}, {}, "heads"),
        ({**GPT_SHAPE, "hiden": 3}, {}, "unknown transformer field 'hiden'"),
        ({**GPT_SHAPE, "heads": 5}, {}, "hidden 64 must be divisible by heads 5"),
        (GPT_SHAPE, {"partitioner": "zero3", "partitioner_options": {"units": "block"}}, "partitioner_options.units 'block' is not valid"),
        (GPT_SHAPE, {"offload": {"optimizer": "tape"}}, "no placement for offload.optimizer 'tape'"),
        (3, {}, "model must be a torch.nn.Module"),
    ],
)
def test_bad_input_is_a_clear_error(model, config, message):
    with pytest.raises((ConfigError, TypeError)) as info:
        zkernel.estimate(model, config)
    assert message in str(info.value)


def test_activation_estimate_is_linear_in_batch_and_checkpointing_saves():
    shape = TransformerShape(layers=24, hidden=2048, heads=16, vocab=50304, sequence=1024)
    one = estimate_activations(shape, 1)
    four = estimate_activations(shape, 4)
    assert four["total"] == 4 * one["total"]
    ckpt = estimate_activations(shape, 4, checkpointing=True)
    assert ckpt["head"] == four["head"] and ckpt["blocks"] < four["blocks"] / 5
    # bf16, per token and layer: ln1 in/out 2h, q/k/v 3h, attention output h, ln2 in/out 2h,
    # GELU in/out 2 x 4h: 16h elements
    assert one["blocks"] == 24 * 1024 * 16 * 2048 * 2


def test_activation_estimate_is_near_what_autograd_saves():
    """Against the bytes autograd actually saves for the demo GPT (fp32, CPU), within the estimate's stated scope."""
    from zkernel.cli.demo.gpt import GPT, GPTConfig

    b, s, h, layers, vocab = 2, 64, 128, 3, 96
    model = GPT(GPTConfig(vocab_size=vocab, seq_len=s, d_model=h, n_layers=layers, n_heads=4))
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    idx = torch.randint(0, vocab, (b, s))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    measured = sum(saved.values())
    predicted = estimate_activations(
        {"layers": layers, "hidden": h, "heads": 4, "vocab": vocab, "sequence": s}, b, precision="fp32"
    )["total"]
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


def test_cli_tabulates_every_partitioner_and_marks_what_fits(tmp_path, capsys, restore_zkernel_logger):
    from zkernel.cli.commands import format_size, main

    shape = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "50304", "--sequence", "1024"]
    # Two backwards per step: none and zero1 hold the window's whole fp32 gradient.
    config = tmp_path / "accumulate.json"
    config.write_text('{"gradient_accumulation_steps": 2}')
    code = main([
        "estimate", *shape, "--precision", "bf16", "--world-size", "8", "--micro-batch", "4",
        "--gpus", "8", "--gpu-memory", "12GiB", "--ram", "64GiB", "--config", str(config),
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "1,313,722,368 parameters" in out and "8 GPU(s) x 12.00 GiB" in out, out
    rows = {tuple(line.split()[:2]): line for line in out.splitlines() if line.split()[:1] and line.split()[0] in ("none", "zero1", "zero2", "zero3")}
    offloads = list(dict.fromkeys(o for _, o in rows))
    # Parameter offload (".../cpu") exists for zero3 only; every optimizer tier for every partitioner.
    expected = [(p, o) for p in ("none", "zero1", "zero2", "zero3") for o in offloads if p == "zero3" or o.endswith("/none")]
    assert "none/none" in offloads and sorted(rows) == sorted(expected), out
    numbers = {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50304, "sequence": 1024}
    for (partitioner, offload), line in rows.items():
        cfg = {
            "partitioner": partitioner,
            "precision": "bf16",
            "gradient_accumulation_steps": 2,
            "offload": dict(zip(("optimizer", "params"), offload.split("/"))),
        }
        for place, nbytes in totals(zkernel.estimate(numbers, cfg, 8, device="cuda")).items():
            assert format_size(nbytes) in line, (partitioner, offload, place, line)
    # States of none (22 GiB) exceed 12 GiB; zero1's (9.2 GiB) fit only with checkpointed activations.
    assert rows["none", "none/none"].endswith("no (cuda)")
    assert rows["zero1", "none/none"].endswith("with checkpointing")
    assert rows["zero2", "none/none"].endswith("yes") and rows["zero3", "none/none"].endswith("yes")
    if ("none", "cpu/none") in rows:  # 8 ranks x 22 GiB of host memory > 64 GiB
        assert rows["none", "cpu/none"].endswith("no (cpu)")
    assert "activations per rank, ESTIMATE" in out

    assert main(["estimate", "--layers", "2"]) == 2
    assert "missing: --hidden, --heads, --vocab, --sequence" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate", *shape, "--gpu-memory", "lots"])
    assert "'lots' is not a size" in capsys.readouterr().err


# -- the optimizer spill: gpu_share / host_share ([Note: optimizer spill]) ----------------------

STEP = 4  # bytes of Adam's step counter, one per trainable group


def split(numel: int) -> int:
    """Bytes of a master of ``numel`` elements kept split: a 16-bit low half and a tie bit each (the
    nvme tier's default on the GPU and in host memory in a bf16 run whose parameters are in memory)."""
    return 2 * numel + (numel + 7) // 8


def linears(*shapes: tuple[int, int]) -> nn.Module:
    """Bias-free Linear layers of the given (in, out) shapes on the meta device: one group each under
    zero3 with persistence_threshold 0, and one bucket each under zero1 with a bucket per layer."""
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in shapes))


def spill_config(partitioner: str, tier: str, precision: str = "bf16", **shares) -> dict:
    options = {"persistence_threshold": 0} if partitioner == "zero3" else {"bucket_size": 1}
    return {
        "partitioner": partitioner,
        "precision": precision,
        "partitioner_options": options,
        "offload": {"optimizer": tier, "nvme_path": "/nowhere", "optimizer_options": shares},
    }


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_spill_bytes_follow_the_split(world):
    """Ten groups of n elements per rank: gpu_share 0.3 keeps the first 3 on the GPU (master, two
    moments, gradient), host_share 0.4 the next 4 in host memory, the last 3 are in swap files.
    The masters on the GPU and in host memory are split (bf16, the parameters on the device), each
    place with a buffer to rebuild one in (and host memory one to download its parameter into)."""
    model = linears(*[(64, 64)] * 10)
    n = 64 * 64 // world
    cfg = spill_config("zero3", "nvme", gpu_share=0.3, host_share=0.4)
    got = totals(zkernel.estimate(model, cfg, world, device="cuda"))
    gpu, host, disk = 3, 4, 3
    # bf16 shards of every group stay on the device (parameters are not offloaded).
    device = 10 * 2 * n + gpu * (split(n) + 8 * n + STEP + 4 * n) + 4 * n
    # Host-kept groups: master, moments, fp32 landing buffer; the disk groups keep only their landing
    # buffer in host memory; the bf16 updates of all seven go through the tier's staging pool
    # (staging_buffers = 4 buffers as large as the largest group).
    cpu = host * (split(n) + 8 * n + STEP + 4 * n) + disk * (4 * n) + 4 * 2 * n + (4 + 2) * n
    nvme = disk * (4 * n + 8 * n + STEP)
    assert got == {"cuda": device, "cpu": cpu, "nvme": nvme}
    # Without any fraction: every group's master and moments are on disk (the tier as it was).
    plain = totals(zkernel.estimate(model, spill_config("zero3", "nvme"), world, device="cuda"))
    assert plain == {"cuda": 10 * 2 * n, "cpu": 10 * 4 * n + 4 * 2 * n, "nvme": 10 * (12 * n + STEP)}


def test_split_master_true_splits_the_nvme_tiers_swap_files_too():
    """``split_master = true``: the swap files hold the three disk groups' masters split as well (2.125
    bytes an element beside the moments), rebuilt in host memory's buffer (as large as the largest
    group there already: nothing more); host memory and the GPU as under "auto"."""
    model = linears(*[(64, 64)] * 10)
    n = 64 * 64
    auto = totals(zkernel.estimate(model, spill_config("zero3", "nvme", gpu_share=0.3, host_share=0.4), 1, device="cuda"))
    cfg = spill_config("zero3", "nvme", gpu_share=0.3, host_share=0.4, split_master=True)
    got = totals(zkernel.estimate(model, cfg, 1, device="cuda"))
    assert got == {"cuda": auto["cuda"], "cpu": auto["cpu"], "nvme": 3 * (split(n) + 8 * n + STEP)}
    assert auto["nvme"] == 3 * (4 * n + 8 * n + STEP)


def test_gpu_share_needs_a_gpu_and_a_host_share_does_not():
    """On a CPU compute device the tier ignores gpu_share; host_share still takes the first groups
    (their updates are written straight into the parameters there: no copy)."""
    model = linears(*[(64, 64)] * 10)
    n = 64 * 64
    got = totals(zkernel.estimate(model, spill_config("zero3", "nvme", gpu_share=0.3, host_share=0.4), 1, device="cpu"))
    # Host-share masters split, rebuilt in one buffer (the parameters are in host memory: no download).
    assert got == {"cpu": 10 * 2 * n + 4 * (split(n) + 12 * n + STEP) + 6 * 4 * n + 4 * n, "nvme": 6 * (12 * n + STEP)}


def test_the_nvme_gpu_share_takes_only_zero3_modules():
    """The nvme tier places its GPU share at adopt, from zero3's module-bound groups only: under
    zero1 (buckets) every master stays on disk."""
    n = 32 * 32
    model = linears((32, 64), (64, 32), (32, 32))
    report = zkernel.estimate(model, spill_config("zero1", "nvme", gpu_share=0.4), 1, device="cuda")
    assert "cuda" not in report["master_weights"]
    assert report["master_weights"]["nvme"] == 4 * 5 * n


@pytest.mark.parametrize(("partitioner", "tier"), [("zero1", "cpu"), ("zero3", "nvme"), ("zero3", "cpu")])
def test_the_spill_takes_groups_in_module_order(partitioner, tier):
    """Groups of 2n, 2n and n elements (zero1 builds its buckets from the last layer): a budget of
    0.4 x 5n = 2n elements holds the first layer; taken from the last, it would hold n only."""
    n = 32 * 32
    model = linears((32, 64), (64, 32), (32, 32))
    report = zkernel.estimate(model, spill_config(partitioner, tier, gpu_share=0.4), 1, device="cuda")
    # The nvme tier splits its GPU share's masters (and rebuilds one at a time); the cpu tier by default not.
    assert report["master_weights"]["cuda"] == (split(2 * n) + 4 * 2 * n if tier == "nvme" else 4 * 2 * n)
    assert report["optimizer_state"]["cuda"] == 8 * 2 * n + STEP
    home = "nvme" if tier == "nvme" else "cpu"
    assert report["master_weights"][home] == 4 * 3 * n


def test_cpu_tier_gpu_share_auto_is_not_modelled_and_bad_fractions_are_errors():
    model = linears(*[(64, 64)] * 4)
    auto = zkernel.estimate(model, spill_config("zero3", "cpu", gpu_share="auto"), 1, device="cuda")
    assert "cuda" not in auto["master_weights"]
    with pytest.raises(ConfigError, match="host_share"):
        zkernel.estimate(model, spill_config("zero3", "nvme", host_share=1.5), 1, device="cuda")
    with pytest.raises(ConfigError, match=r"gpu_share \(0.6\) \+ host_share \(0.6\) is more than 1"):
        zkernel.estimate(model, spill_config("zero3", "nvme", gpu_share=0.6, host_share=0.6), 1, device="cuda")
    with pytest.raises(ConfigError, match="host_share"):  # the cpu tier has no host share
        zkernel.estimate(model, spill_config("zero3", "cpu", host_share=0.5), 1, device="cuda")


def test_table_gives_the_configured_fractions_to_the_configured_tier_only():
    from zkernel.sizing.estimator import estimate_table

    model = linears(*[(64, 64)] * 10)
    cfg = spill_config("zero3", "nvme", host_share=0.5)
    rows = {(r.partitioner, r.offload_optimizer, r.offload_params): r for r in estimate_table(model, cfg, 1, device="cuda", tiers=["none", "cpu", "nvme"])}
    n = 64 * 64
    # The host share's masters split, one rebuilt at a time from its parameter downloaded from the GPU.
    assert rows["zero3", "nvme", "none"].report["master_weights"] == {"cpu": 5 * split(n) + (4 + 2) * n, "nvme": 5 * 4 * n}
    assert rows["zero3", "cpu", "none"].report["master_weights"] == {"cpu": 10 * 4 * n}


@pytest.mark.cuda
def test_nvme_spill_is_what_memory_report_measures_on_cuda(tmp_path):
    """GPU machine: the nvme tier's gpu_share and host_share, predicted and measured after a step."""
    shares = {"gpu_share": 0.3, "host_share": 0.4}
    # Model state only, as in the test on two ranks: prefetch_bytes 0 starts no gathers for the next
    # forward during the step (with the default, the step gathered this small model's every unit).
    cfgs = [
        {
            "partitioner": partitioner,
            "precision": "bf16",
            "partitioner_options": options,
            "prefetch_bytes": 0,
            "gradient_accumulation_steps": 2,
            "offload": {"optimizer": "nvme", "params": params, "nvme_path": str(tmp_path), "optimizer_options": shares},
        }
        for partitioner, options, params in [
            ("zero1", {"bucket_size": 5001}, "none"),
            ("zero3", {"persistence_threshold": 0}, "none"),
            ("zero3", {"persistence_threshold": 0}, "cpu"),
        ]
    ]
    with torch.device("meta"):
        meta_gpt = small_gpt()
    for cfg, measured in zip(cfgs, memory_after_step("gpt", cfgs)):
        predicted = zkernel.estimate(meta_gpt, cfg, 1, device="cuda")

        def by_place(report: dict) -> dict:
            out: dict = {}
            for place, nbytes in report.items():
                key = "cuda" if place.startswith("cuda") else place
                out[key] = out.get(key, 0) + nbytes
            return out

        wanted = {c: by_place(measured["step"][c]) for c in ("params", "master_weights", "optimizer_state")}
        wanted["grads"] = peak([{"grads": by_place(r["grads"])} for r in measured["backward"]], "grads")
        for category, value in wanted.items():
            assert_close(predicted[category], value, f"{cfg['partitioner']}/{cfg['offload']['params']} {category}")


def test_tiled_loss_head_estimate_is_what_autograd_saves():
    """With the loss taken by zkernel.tiled_cross_entropy the head keeps the final norm's input,
    its output's gradient and the head weight's fp32 gradient, not the fp32 log-softmax: the
    estimate's head is what autograd saves, and far below the untiled head's."""
    from zkernel import tiled_cross_entropy

    b, s, h, vocab = 2, 64, 32, 1000
    norm = torch.nn.LayerNorm(h)
    weight = torch.nn.Parameter(torch.randn(vocab, h) * 0.02)
    params = {p.untyped_storage().data_ptr() for p in (*norm.parameters(), weight)}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(b, s, h, requires_grad=True)
    target = torch.randint(0, vocab, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiled_cross_entropy(norm(x), weight, target, tiles=4)
    measured = sum(saved.values())
    shape = {"layers": 1, "hidden": h, "heads": 4, "vocab": vocab, "sequence": s}
    tiled = estimate_activations(shape, b, precision="fp32", tiled_loss=True)
    untiled = estimate_activations(shape, b, precision="fp32")
    assert abs(tiled["head"] - measured) <= 0.05 * measured, (tiled["head"], measured)
    assert tiled["blocks"] == untiled["blocks"] and tiled["head"] * 3 < untiled["head"]
    assert estimate_activations(shape, b, precision="fp32", checkpointing=True, tiled_loss=True)["head"] == tiled["head"]
