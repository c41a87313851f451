"""``zkernel estimate``: the row "auto" picks, the notes under the table, the rates, a model path from here."""

from __future__ import annotations

import re
import sys

import pytest

import zkernel
from zkernel.cli.commands import format_size, main
from zkernel.sizing.estimator import totals
from zkernel.sizing.planning import plan

# Llama-2 7B's numbers (an untied head): the model of the puzzle, on one 80 GB GPU.
LLAMA_7B = [
    "--style", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000",
    "--sequence", "4096", "--intermediate", "11008", "--untied",
]  # fmt: skip
ONE_GPU = ["--precision", "bf16", "--world-size", "1", "--gpus", "1", "--gpu-memory", "80GiB", "--ram", "256GiB"]
LLAMA_NUMBERS = {"style": "llama", "layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "sequence": 4096, "intermediate": 11008, "tied_embeddings": False}


def _rows(out: str) -> dict[tuple[str, str], str]:
    return {
        tuple(line.split()[:2]): line
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in ("none", "zero1", "zero2", "zero3")
    }


def _auto_column(out: str) -> list[tuple[str, str]]:
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("PARTITIONER"))
    at = header.index("AUTO")
    return [key for key, line in _rows(out).items() if line[at : at + 4].strip() == "*"]


def test_the_row_auto_would_choose_is_marked(capsys, restore_zkernel_logger):
    assert main(["estimate", *LLAMA_7B, *ONE_GPU]) == 0
    out = capsys.readouterr().out
    config = {"precision": "bf16", "planner": {"gpu_memory": "80GiB", "ram": "256GiB"}}
    decision = plan(LLAMA_NUMBERS, config, 1, gpus=1)
    expected = (decision.partitioner, f"{decision.offload_optimizer}/{decision.offload_params}")
    assert _auto_column(out) == [expected], out
    assert f"AUTO *: what partitioner/offload = \"auto\" would choose here (planner 'default'): {decision.placement}" in out

    # Nothing fits: no row is marked, and the table says why.
    assert main(["estimate", *LLAMA_7B, "--precision", "bf16", "--gpus", "1", "--gpu-memory", "1GiB", "--ram", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert _auto_column(out) == [] and "AUTO: no row; the planner chose none: no placement fits" in out, out


def test_parameters_offloaded_beside_an_optimizer_on_the_gpu_are_explained(capsys, restore_zkernel_logger):
    """zero3 none/cpu keeps more on the GPU than zero3 none/none: the master stays there and each
    update is staged there; the note says so with the estimate's own numbers."""
    assert main(["estimate", *LLAMA_7B, *ONE_GPU]) == 0
    out = capsys.readouterr().out

    def cuda(optimizer, params):
        cfg = {"partitioner": "zero3", "precision": "bf16", "offload": {"optimizer": optimizer, "params": params}}
        return totals(zkernel.estimate(LLAMA_NUMBERS, cfg, 1, device="cuda"))["cuda"]

    offloaded, kept, both = cuda("none", "cpu"), cuda("none", "none"), cuda("cpu", "cpu")
    assert offloaded > kept  # the puzzle itself
    note = next(line for line in out.splitlines() if line.startswith("note: zero3 none/cpu "))
    assert f"({format_size(offloaded)} vs {format_size(kept)})" in note, note
    assert f"adds {format_size(offloaded - kept)} of staging copies of each update" in note, note
    assert "fp32 master" in note and f"zero3 cpu/cpu keeps {format_size(both)} there" in note, note
    # Rows that offload and do free the GPU get no note.
    assert not any(line.startswith("note: zero3 cpu/cpu") for line in out.splitlines())


def test_rates_of_the_described_machine_are_used_or_the_output_says_whose_they_are(capsys, restore_zkernel_logger):
    machine = [*LLAMA_7B, *ONE_GPU, "--plan"]
    assert main(["estimate", *machine, "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "note: the measured rates are this machine's" in out and "--cpu-adam-rate" in out, out

    assert main(["estimate", *machine, "--gpu-memory", "24GiB", "--cpu-adam-rate", "2e9"]) == 0
    out = capsys.readouterr().out
    assert "given: cpu adam 2.00 G elements/s" in out, out
    seconds = float(re.search(r"host optimizer step ([\d.]+) s", out)[1])
    assert main(["estimate", *machine, "--gpu-memory", "24GiB", "--cpu-adam-rate", "4e9"]) == 0
    assert float(re.search(r"host optimizer step ([\d.]+) s", capsys.readouterr().out)[1]) == pytest.approx(seconds / 2, rel=1e-3)

    with pytest.raises(SystemExit):
        main(["estimate", *machine, "--cpu-adam-rate", "fast"])
    assert "'fast' is not a size" in capsys.readouterr().err


def test_a_model_path_resolves_from_the_current_directory(tmp_path, monkeypatch, capsys, restore_zkernel_logger):
    (tmp_path / "estimate_here_model.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make_model():\n"
        "    with torch.device('meta'):\n"
        "        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "estimate_here_model", raising=False)
    assert main(["estimate", "estimate_here_model:make_model", "--gpus", "0"]) == 0
    assert "estimate_here_model:make_model, 4,680 parameters" in capsys.readouterr().out
