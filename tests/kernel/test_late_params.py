"""Parameters added to the model after ``initialize`` are refused at the next forward, on every rank, before
any collective ([Note: parameters added after initialize] in `zkernel.kernel.late_params`): a module
attached, a module replaced, a parameter registered on a module of the model would otherwise fill
``.grad`` and never train."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.harness import run_ranks

WORLD, DIM, MICRO = 2, 8, 3


class Growing(nn.Module):
    """Runs ``extra`` when one was attached and scales by ``fc1.gain`` when one was registered."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, 1)
        self.extra = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.extra is not None:
            h = self.extra(h)
        gain = getattr(self.fc1, "gain", None)
        if gain is not None:
            h = h * gain
        return F.mse_loss(self.fc2(h), y)


def _attach(model: Growing) -> None:
    model.extra = nn.Linear(DIM, DIM)


def _replace(model: Growing) -> None:
    model.fc1 = nn.Linear(DIM, DIM)


def _register(model: Growing) -> None:
    model.fc1.gain = nn.Parameter(torch.ones(DIM))


CHANGES = {"a module attached": _attach, "a module replaced": _replace, "a parameter registered": _register}
CONFIGS = {
    "none": {"partitioner": "none"},
    "zero2": {"partitioner": "zero2"},
    "zero3": {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}},  # gathers in forward
}  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    return torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, 1, generator=g)


def _train_step(engine) -> None:
    engine.backward(engine(*_batch()))
    engine.step()


def _change_after_initialize(partitioner: str, change: str) -> list[str]:
    torch.manual_seed(0)
    engine = zkernel.initialize(Growing(), {**CONFIGS[partitioner], "optimizer": {"name": "adamw", "lr": 1e-2}})
    messages = []
    try:
        _train_step(engine)
        CHANGES[change](engine.module)
        for _ in range(2):  # refused again until the model is as it was
            with pytest.raises(zkernel.LateParameterError) as error:
                _train_step(engine)
            messages.append(str(error.value))
    finally:
        engine.close()
    return messages


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("partitioner", list(CONFIGS))
def test_parameters_added_after_initialize_are_refused_on_every_rank(partitioner, change):
    expected = {
        "a module attached": ["'extra.weight'", "'extra.bias'", "new modules: 'extra' (Linear)"],
        "a module replaced": ["'fc1.weight'", "'fc1.bias'", "new modules: 'fc1' (Linear)"],
        "a parameter registered": ["'fc1.gain'"],
    }[change]
    for messages in run_ranks(WORLD, _change_after_initialize, partitioner, change, timeout=120):
        for message in messages:
            for part in expected + ["after zkernel.initialize", "engine.close()", "before zkernel.initialize"]:
                assert part in message, message


def _unchanged_or_undone(partitioner: str) -> dict:
    torch.manual_seed(0)
    model = Growing()
    engine = zkernel.initialize(model, {**CONFIGS[partitioner], "optimizer": {"name": "adamw", "lr": 1e-2}})
    late = engine.scheduler.late
    try:
        _train_step(engine)
        nn.Linear(DIM, DIM)  # a module built outside the model is none of the engine's business
        unrelated = late.changed
        _train_step(engine)
        model.act = nn.Identity()  # a module without parameters: nothing to train
        _train_step(engine)
        _attach(model)
        with pytest.raises(zkernel.LateParameterError):
            _train_step(engine)
        model.extra = None  # undone: training goes on
        _train_step(engine)
        return {"unrelated": unrelated, "changed": late.changed}
    finally:
        engine.close()


@pytest.mark.parametrize("partitioner", list(CONFIGS))
def test_a_model_left_alone_or_changed_back_trains_on(partitioner):
    for result in run_ranks(WORLD, _unchanged_or_undone, partitioner, timeout=120):
        assert result == {"unrelated": False, "changed": False}
