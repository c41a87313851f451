"""Progress bars: on rank 0 for a person (a terminal, or ZKERNEL_PROGRESS=1), silent otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zkernel
from tests.support.scenarios import Wide
from zkernel.telemetry.progress import ENV, NoProgress, progress


def test_quiet_unless_a_terminal_or_forced(monkeypatch, capsys):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    bar = progress(10, "quiet")  # pytest's stderr is not a terminal
    assert isinstance(bar, NoProgress)
    with bar:
        bar.update(5)
    assert capsys.readouterr().err == ""

    monkeypatch.setenv(ENV, "1")
    with progress(3 * 2**20, "forced") as bar:
        bar.update(2**20)
    err = capsys.readouterr().err
    assert "forced" in err and "/3.00M" in err, err  # bytes counted in binary units

    monkeypatch.setenv(ENV, "0")  # the environment wins over a caller's request
    assert isinstance(progress(1, "off", enabled=True), NoProgress)
    monkeypatch.delenv(ENV)
    bar = progress(2, "asked", unit="step", enabled=True)
    bar.update(2)
    bar.close()
    assert "asked" in capsys.readouterr().err

    monkeypatch.setenv(ENV, "1")
    monkeypatch.setenv("RANK", "1")  # never on another rank
    assert isinstance(progress(1, "rank one"), NoProgress)


@pytest.mark.parametrize("forced", [False, True])
def test_checkpoint_save_load_consolidate_and_meta_construction(forced, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    if forced:
        monkeypatch.setenv(ENV, "1")
    else:
        monkeypatch.delenv(ENV, raising=False)
    with torch.device("meta"):
        model = Wide(64, 3)
    engine = zkernel.initialize(model, {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}})
    built = capsys.readouterr().err
    loss = engine(torch.randn(2, 64)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(tmp_path, "one")
    saved = capsys.readouterr().err
    engine.load_checkpoint(tmp_path, "one")
    loaded = capsys.readouterr().err
    engine.close()
    state = zkernel.consolidate(tmp_path, "one")
    consolidated = capsys.readouterr().err
    assert set(state) == {n for n, _ in model.named_parameters()}
    for output, desc in ((built, "building the model"), (saved, "saving checkpoint"), (loaded, "loading checkpoint"), (consolidated, "consolidate")):
        assert (desc in output) == forced, (desc, output)
    if forced:
        assert "B/s" in saved and "tensor" in loaded


def test_consolidate_progress_argument(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    engine = zkernel.initialize(nn.Linear(3, 3), {"partitioner": "zero1"})
    engine.save_checkpoint(tmp_path)
    engine.close()
    capsys.readouterr()
    zkernel.consolidate(tmp_path, progress=True)
    assert "consolidate" in capsys.readouterr().err
    zkernel.consolidate(tmp_path)
    assert capsys.readouterr().err == ""
