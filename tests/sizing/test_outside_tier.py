"""A tier shipped by a distribution of its own is listed, trained, estimated and planned like a builtin.

tests/support/outside_tier/ holds a package (``outside_tier``: the tier
``hostram``) and its ``outside_tier-0.1.dist-info`` (METADATA, entry points of
group ``zkernel``). Put on the PYTHONPATH of a subprocess, it is a real
installed distribution to zkernel's entry-point loading: nothing registers it
in code. The checks run in that subprocess (`outside_checks`); this process
never sees the tier.
"""

from __future__ import annotations

from tests.support.paths import REPO
import json
import os
import pathlib
import subprocess
import sys

import torch

ROOT = REPO
SUPPORT = ROOT / "tests" / "support" / "outside_tier"


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("ZKERNEL_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _exact_configs() -> list[dict]:
    """Every partitioner beside ``hostram``, fp32 and bf16, a window of two micro-batches, model state only."""
    out = []
    for partitioner, options in (("none", {}), ("zero1", {}), ("zero2", {"bucket_size": 4099}), ("zero3", {"persistence_threshold": 5000})):
        for precision in ("fp32", "bf16"):
            out.append(
                {
                    "partitioner": partitioner,
                    "precision": precision,
                    "partitioner_options": options,
                    "gradient_accumulation_steps": 2,
                    "prefetch_bytes": 0,
                    "offload": {"optimizer": "hostram"},
                }
            )
    return out


def outside_checks() -> dict:
    """Run in the subprocess that has the distribution: train, estimate, tabulate, plan."""
    import attrs

    import zkernel
    from tests.support.harness import run_ranks
    from tests.support.scenarios import memory_after_step, small_gpt, train_many
    from tests.sizing.test_estimator import check
    from tests.plugins.partitioners.test_partitioners import ACCUM, MICRO, SEED, STEPS, assert_matches, config, reference
    from zkernel.kernel.config_source import load_config
    from zkernel.sizing.estimator import estimate_table, totals
    from zkernel.sizing.planning import plan

    out: dict = {}
    # Training on two ranks against single-process torch AdamW.
    train_cfgs = [{**config(stage), "offload": {"optimizer": "hostram"}} for stage in ("zero1", "zero2", "zero3")]
    expected = reference(2)
    for rank_results in run_ranks(2, train_many, train_cfgs, STEPS, ACCUM, MICRO, SEED):
        for cfg, result in zip(train_cfgs, rank_results):
            assert_matches(result["losses"], expected, f"{cfg['partitioner']} hostram, world 2")
            assert set(result["memory"]["master_weights"]) == {"cpu"}
    out["trained"] = [c["partitioner"] for c in train_cfgs]

    # zkernel.estimate against memory_report, byte for byte.
    cfgs = _exact_configs()
    with torch.device("meta"):
        meta_gpt = small_gpt()
    measured = run_ranks(2, memory_after_step, "gpt", cfgs)[0]
    inexact = [cfg for cfg, m in zip(cfgs, measured) if not check(zkernel.estimate(meta_gpt, cfg, 2, device="cpu"), m, f"hostram {cfg}")]
    assert not inexact, f"hostram estimated inexactly for {inexact}"
    out["exact"] = len(cfgs)

    # The table has its rows (optimizer role only), the same bytes as estimate, which match memory_report.
    rows = estimate_table(meta_gpt, cfgs[3], 2, device="cpu")
    hostram = {r.partitioner: r for r in rows if r.offload_optimizer == "hostram"}
    assert sorted(hostram) == ["none", "zero1", "zero2", "zero3"], [(r.partitioner, r.offload_optimizer) for r in rows]
    assert not any(r.offload_params == "hostram" for r in rows)
    assert hostram["zero1"].report == zkernel.estimate(meta_gpt, cfgs[3], 2, device="cpu")
    wanted = {c: measured[3]["step"][c] for c in ("params", "master_weights", "optimizer_state")}
    assert {c: hostram["zero1"].report[c] for c in wanted} == wanted
    out["table"] = {p: totals(r.report) for p, r in hostram.items()}

    # "auto" placement: with the builtin host tier blocked, hostram is the one that fits.
    base = {
        "partitioner": "auto",
        "precision": "fp32",
        "prefetch_bytes": 0,
        "partitioner_options": {"persistence_threshold": 0},
        "offload": {"optimizer": "auto", "params": "auto"},
        "blocked_plugins": ["tier_cpu"],
        "planner": {"options": {"measure": False}, "ram": "64GiB"},
    }
    fixed = {"partitioner": "zero3", "precision": "fp32", "partitioner_options": {"persistence_threshold": 0}}
    on_device = totals(zkernel.estimate(meta_gpt, fixed, 2, device="device"))["device"]
    cfg = load_config({**base, "planner": {**base["planner"], "gpu_memory": int(on_device / 0.9)}})
    decision = plan(meta_gpt, cfg, 2, gpus=2)
    assert decision.offload_optimizer == "hostram", decision.placement
    assert any("optimizer@device" in line for line in decision.rejected), decision.rejected
    applied = decision.apply(cfg)
    assert applied.offload.optimizer == "hostram"
    # And it is only a candidate like any other: with room on the device, nothing is offloaded.
    roomy = plan(meta_gpt, attrs.evolve(cfg, planner=attrs.evolve(cfg.planner, gpu_memory=8 << 30)), 2, gpus=2)
    assert roomy.offload_optimizer == "none"
    out["planned"] = decision.placement
    return out


def test_an_outside_tier_is_listed_trained_estimated_and_planned():
    listed = _run("-m", "zkernel", "plugins")
    assert listed.returncode == 0, listed.stderr
    row = [line for line in listed.stdout.splitlines() if " hostram " in line]
    assert row and "entry point" in row[0] and "outside-tier 0.1" in row[0], listed.stdout

    table = _run("-m", "zkernel", "estimate", "tests.support.scenarios:small_gpt", "--world-size", "2", "--gpus", "0")
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines() if "hostram/none" in line]
    assert sorted(r[0] for r in rows) == ["none", "zero1", "zero2", "zero3"], table.stdout

    checked = _run("-c", "import json; from tests.sizing.test_outside_tier import outside_checks; print('RESULT', json.dumps(outside_checks()))")
    assert checked.returncode == 0, checked.stdout[-4000:] + checked.stderr[-8000:]
    result = json.loads(checked.stdout.split("RESULT", 1)[1])
    assert result["trained"] == ["zero1", "zero2", "zero3"] and result["exact"] == 8
    assert result["planned"].startswith("zero") and "optimizer on hostram" in result["planned"]


def test_without_its_distribution_the_tier_is_not_installed():
    """The subprocess's tier comes from the test distribution alone: this process has none."""
    from zkernel.sizing.estimator import installed_tiers
    from zkernel.spec.config import Config

    assert "hostram" not in installed_tiers(Config())


def test_a_tier_that_does_not_answer_for_its_bytes_is_named_not_estimated(tmp_path, monkeypatch, capsys, restore_zkernel_logger):
    from zkernel.cli.commands import main

    (tmp_path / "mute_tier.py").write_text(
        "from zkernel.spec import hookimpl\n\n"
        "@hookimpl\n"
        "def zkernel_register_offload_tiers(registry):\n"
        "    registry.add('mute', lambda context, role: None, description='answers for nothing')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cfg.json").write_text(json.dumps({"plugins": ["mute_tier"]}))
    assert main(["estimate", "tests.support.scenarios:small_gpt", "--world-size", "2", "--gpus", "0", "--config", str(tmp_path / "cfg.json")]) == 0
    out = capsys.readouterr().out
    assert "not estimated: offload tier(s) mute (their plugins do not answer zkernel_size_offload_tier)" in out
    assert not any(line.split()[1:2] and "mute" in line.split()[1] for line in out.splitlines() if line.startswith("zero"))
