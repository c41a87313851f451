"""Writes to whole parameters reach their fp32 masters, as they reach a plain model's
parameters ([Note: writes to gathered parameters] in `zkernel.params.param_writes`): a model that clamps its
own weight's ``.data`` inside forward (Gemma3n's AltUp, FLAVA's ``logit_scale``), an in-place clamp of
a parameter under ``no_grad`` inside forward, a write inside ``engine.gathered_parameters()`` and, for
a parameter kept whole, a clamp between steps (OpenCLIP's ``logit_scale``), wherever the fp32 master
is not the parameter itself (zero3, bf16 compute, the optimizer offloaded)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.harness import in_turn, run_ranks

WORLD, STEPS, MICRO, DIM, LR = 2, 4, 3, 8, 5e-2
BOUND, SCALE_MAX = 0.05, 1.1


class SelfClamping(nn.Module):
    """Clamps its own parameters as it runs: ``coef`` through ``.data``, ``scale`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.coef = nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.coef.weight.data.clamp_(-BOUND, BOUND)  # as Gemma3n's AltUp does
            with torch.no_grad():
                self.scale.clamp_(max=SCALE_MAX)
        h = torch.tanh(self.coef(x)) * self.scale.repeat(DIM // 4)
        return F.mse_loss(self.head(h), y)


class Plain(SelfClamping):
    """The same model without writes: nothing may be folded."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.coef(x)) * self.scale.repeat(DIM // 4)
        return F.mse_loss(self.head(h), y)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * MICRO, DIM, generator=g), torch.randn(WORLD * MICRO, 1, generator=g)


def _between_steps(model: nn.Module) -> None:
    """The user's writes after a step: a clamp and a row reset, on every rank alike."""
    with torch.no_grad():
        model.head.bias.clamp_(-0.01, 0.01)
        model.coef.bias[0] = 0.25


def _reference(model: nn.Module) -> dict:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if type(model) is SelfClamping:
            _between_steps(model)
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _reference_in_process(model_cls) -> dict:
    torch.manual_seed(0)
    return _reference(model_cls())


CONFIGS = {
    "every module split": {"partitioner_options": {"persistence_threshold": 0}},
    "small parameters kept whole": {},
    "params and optimizer on the cpu": {"partitioner_options": {"persistence_threshold": 0},
                                        "offload": {"params": "cpu", "optimizer": "cpu"}},
    "zero2, optimizer on the cpu": {"partitioner": "zero2", "offload": {"optimizer": "cpu"}},
    "zero1": {"partitioner": "zero1"},
}  # fmt: skip
BF16 = ["every module split", "zero1"]  # the configurations also run with bf16 compute


def _config(name: str, precision: str = "fp32") -> dict:
    return {"partitioner": "zero3", "precision": precision, "gradient_clipping": 1.0,
            "optimizer": {"name": "adamw", "lr": LR, "weight_decay": 0.0}, **copy.deepcopy(CONFIGS[name])}  # fmt: skip


def _train(model_cls, name: str, precision: str = "fp32") -> dict:
    torch.manual_seed(0)
    model = model_cls()
    reference = _reference(model) if precision == "fp32" else None
    engine = zkernel.initialize(model, _config(name, precision))
    rank = torch.distributed.get_rank()
    losses = []
    whole = [n for n, p in engine.module.named_parameters() if not zkernel.params.released.is_released(p)]
    for step in range(STEPS):
        x, y = _data(step)
        part = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(x[part], y[part])
        engine.backward(loss)
        engine.step()
        if model_cls is SelfClamping:
            if "head.bias" in whole and "coef.bias" in whole:  # whole between steps: written directly
                _between_steps(engine.module)
            else:
                with engine.gathered_parameters() as gathered:
                    _between_steps(gathered)
        total = torch.tensor([loss.item()], device=engine.device)
        torch.distributed.all_reduce(total)
        losses.append(total.item() / WORLD)
    state = engine.state_dict()
    compared = engine.writes.compared
    tolerance = 1e-5 if engine.device.type == "cpu" else 1e-4  # GPU kernels against torch on the CPU
    engine.close()
    closed = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(type(p) is nn.Parameter for p in model.parameters())  # their own class again
    return {"losses": losses, "state": state, "closed": closed, "reference": reference, "compared": compared,
            "tolerance": tolerance}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_writes_inside_forward_and_between_steps_train_like_torch(runs, name):
    for result in (rank[("writes", name)] for rank in runs):
        reference, tolerance = result["reference"], result["tolerance"]
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=tolerance, atol=0)
        for key, expected in reference["state"].items():
            torch.testing.assert_close(result["state"][key], expected, rtol=tolerance, atol=tolerance / 10, msg=key)
            closed = result["closed"][key].cpu()
            torch.testing.assert_close(closed, expected, rtol=tolerance, atol=tolerance / 10, msg=key)
        assert result["compared"] > 0


@pytest.mark.parametrize("name", BF16)
def test_writes_in_bf16_keep_the_masters_precision_elsewhere(runs, name):
    result = runs[0][("bf16 writes", name)]
    state, reference = result["state"], _reference_in_process(SelfClamping)["state"]
    assert state["coef.weight"].dtype == torch.float32
    for key, expected in reference.items():  # bf16 compute against fp32 torch; unclamped weights are 0.3 off
        torch.testing.assert_close(state[key], expected, rtol=0, atol=3e-2, msg=key)
    assert state["coef.bias"][0] == 0.25
    # a master the writes left alone keeps fp32 values a bf16 copy cannot hold
    assert (state["coef.bias"][1:] != state["coef.bias"][1:].bfloat16().float()).any()


def test_training_without_writes_folds_nothing(runs):
    for result in (rank["no writes"] for rank in runs):
        assert result["compared"] == 0
        torch.testing.assert_close(result["losses"], result["reference"]["losses"], rtol=result["tolerance"], atol=0)


# -- assignments to .data between steps (issue 43, item 1) ------------------------------------------------------------

ASSIGNING = {
    "none": {"partitioner": "none"},
    "zero1": {"partitioner": "zero1"},
    "zero2": {"partitioner": "zero2"},
    "zero3, parameters kept whole": {"partitioner": "zero3"},
    "zero1, optimizer on the cpu": {"partitioner": "zero1", "offload": {"optimizer": "cpu"}},
    "zero3 kept whole, optimizer on the cpu": {"partitioner": "zero3", "offload": {"optimizer": "cpu"}},
}  # fmt: skip
WRONG_SHAPE = ["zero1", "zero3"]  # the partitioners an assignment of another shape is tried under


def _assign_between_steps(model: nn.Module, step: int) -> None:
    """What users write after a step: a clamp assigned to ``.data``, one in place through ``.data``, (once)
    zeros assigned to a bias and (once) a clamp given by ``set_``; on every rank alike."""
    model.coef.weight.data = model.coef.weight.data.clamp(-BOUND, BOUND)
    model.head.weight.data.clamp_(-4 * BOUND, 4 * BOUND)
    if step == 1:
        model.coef.bias.data = torch.zeros_like(model.coef.bias.data)
    if step == 1:
        with torch.no_grad():
            model.head.bias.set_(model.head.bias.detach().clamp(-0.01, 0.01))


def _reference_assigning(model: nn.Module) -> dict:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        _assign_between_steps(model, step)
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _train_assigning(name: str) -> dict:
    torch.manual_seed(0)
    model = Plain()
    reference = _reference_assigning(model)
    config = {"precision": "fp32", "gradient_clipping": 1.0, "optimizer": {"name": "adamw", "lr": LR, "weight_decay": 0.0},
              **copy.deepcopy(ASSIGNING[name])}  # fmt: skip
    engine = zkernel.initialize(model, config)
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        part = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(x[part], y[part])
        engine.backward(loss)
        engine.step()
        _assign_between_steps(engine.module, step)
        total = torch.tensor([loss.item()], device=engine.device)
        torch.distributed.all_reduce(total)
        losses.append(total.item() / WORLD)
    state = engine.state_dict()
    engine.close()
    closed = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(type(p) is nn.Parameter for p in model.parameters())
    return {"losses": losses, "state": state, "closed": closed, "reference": reference}


@pytest.mark.parametrize("name", list(ASSIGNING))
def test_data_assigned_between_steps_trains_like_torch(runs, name):
    """``w.data = w.data.clamp(...)`` after each step, ``w.data.clamp_()`` and zeros assigned to a bias: the
    parameter keeps its storage in the engine, so the next forward, the masters, ``state_dict()`` and
    ``close()`` all see the assignment, as in plain torch."""
    for result in (rank[("assigned", name)] for rank in runs):
        reference = result["reference"]
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=0)
        for key, expected in reference["state"].items():
            torch.testing.assert_close(result["state"][key], expected, rtol=1e-5, atol=1e-6, msg=key)
            torch.testing.assert_close(result["closed"][key].cpu(), expected, rtol=1e-5, atol=1e-6, msg=key)


def _assign_wrong_shape(partitioner: str) -> str:
    torch.manual_seed(0)
    engine = zkernel.initialize(Plain(), {"partitioner": partitioner, "optimizer": {"name": "adamw", "lr": LR}})
    x, y = _data(0)
    engine.backward(engine(x, y))
    engine.step()
    try:
        with pytest.raises(zkernel.ParamAssignmentError) as error:
            engine.module.coef.bias.data = torch.zeros(DIM + 1)
        with pytest.raises(zkernel.ParamAssignmentError):
            engine.module.coef.bias.data = torch.zeros(DIM, dtype=torch.int64)
        bias = engine.module.coef.bias
        bias.data = torch.full((DIM,), 0.5, dtype=torch.float64)  # another floating dtype: cast in, kept
        assert bias.dtype == torch.float32 and (bias.detach() == 0.5).all()
        engine.backward(engine(x, y))  # the refused assignments changed nothing
        engine.step()
        assert engine.module.coef.bias.shape == (DIM,)
        assert engine.state_dict()["coef.bias"].ne(0.5).all()  # stepped from the cast values
    finally:
        engine.close()
    return str(error.value)


@pytest.mark.parametrize("partitioner", WRONG_SHAPE)
def test_data_assignment_of_another_shape_is_refused_another_dtype_cast(runs, partitioner):
    for message in (rank[("wrong shape", partitioner)] for rank in runs):
        assert "'coef.bias'" in message and "(9,)" in message and "engine.close()" in message


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """Every two-rank run of this module in one spawn (each builds and closes its own engine): per rank,
    the results by (kind, configuration)."""
    calls = {
        **{("writes", name): (_train, SelfClamping, name) for name in CONFIGS},
        **{("bf16 writes", name): (_train, SelfClamping, name, "bf16") for name in BF16},
        "no writes": (_train, Plain, "small parameters kept whole"),
        **{("assigned", name): (_train_assigning, name) for name in ASSIGNING},
        **{("wrong shape", partitioner): (_assign_wrong_shape, partitioner) for partitioner in WRONG_SHAPE},
    }
    return run_ranks(WORLD, in_turn, calls)
