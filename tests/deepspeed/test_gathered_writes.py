"""Writes inside ``GatheredParameters`` to parameters a partitioner keeps in no group (the frozen parameters of
stages 0, 1 and 2, whole on every rank) are settled like the others: rank r's values with ``modifier_rank=r``,
an error naming the parameter where ranks wrote different values, kept where every rank wrote the same
([Note: parameters in no group] in `zkernel.params.param_writes`). Two gloo ranks, one spawn for all stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.harness import run_ranks

STAGES = (0, 1, 2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # a frozen layer, as a fine-tuning script keeps one
    return model


def _one_stage(stage: int, rank: int) -> dict:
    import zkernel
    import zkernel.deepspeed as deepspeed

    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    frozen = model[0].weight
    out = {"start": frozen.detach().clone()}

    with deepspeed.zero.GatheredParameters(frozen, modifier_rank=0):
        if rank == 0:
            frozen.data.fill_(0.25)
    out["modifier"] = frozen.detach().clone()

    try:
        with deepspeed.zero.GatheredParameters(frozen):
            if rank == 1:
                frozen.data.mul_(3.0)
        out["one_rank"] = None
    except zkernel.ParamWriteError as exc:
        out["one_rank"] = str(exc)
    out["after_error"] = frozen.detach().clone()

    with deepspeed.zero.GatheredParameters(frozen):
        with torch.no_grad():
            frozen.add_(1.0)  # the same write on every rank
    out["alike"] = frozen.detach().clone()

    x = torch.ones(2, 4)
    loss = engine(x).sum()
    engine.backward(loss)
    engine.step()
    out["loss"] = float(loss)
    out["class"] = type(frozen).__name__
    engine.close()
    return out


def _script() -> dict:
    import zkernel.deepspeed as deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    return {stage: _one_stage(stage, rank) for stage in STAGES}


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _script)


@pytest.mark.parametrize("stage", STAGES)
def test_a_modifier_rank_write_to_a_frozen_parameter_reaches_every_rank(results, stage):
    for out in results:
        assert torch.equal(out[stage]["modifier"], torch.full((4, 4), 0.25))


@pytest.mark.parametrize("stage", STAGES)
def test_a_write_to_a_frozen_parameter_on_one_rank_is_an_error(results, stage):
    for out in results:
        assert out[stage]["one_rank"] is not None and "0.weight" in out[stage]["one_rank"]
        assert torch.equal(out[stage]["after_error"], torch.full((4, 4), 0.25))  # no rank keeps the tripled values


@pytest.mark.parametrize("stage", STAGES)
def test_a_write_alike_on_every_rank_is_kept_and_the_ranks_agree(results, stage):
    for out in results:
        assert torch.equal(out[stage]["alike"], torch.full((4, 4), 1.25))
        assert out[stage]["loss"] == results[0][stage]["loss"]
        assert out[stage]["class"] == "Parameter"  # watched only inside the block
