"""configure_optimizers' torch Adam/AdamW as zkernel's: the mapping, its errors, and torch lr schedulers
driving a real (one-process) engine step for step like torch's own optimizer."""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch
from torch import nn

import zkernel
from zkernel.errors import ConfigError
from zkernel.integrations.lightning.optimizer import OptimizerMap
from zkernel.kernel.torch_optim_sync import TorchOptimizerSync
from zkernel.spec.config import Config

pytest.importorskip("pytorch_lightning")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _groups(model: nn.Module) -> list[dict]:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": 0.004, "betas": (0.8, 0.99), "eps": 1e-6},
    ]


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2)),  # starts at 0
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-4),
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.01], total_steps=6),
}


@pytest.mark.parametrize(
    "kind, schedule",
    [(torch.optim.AdamW, "lambda"), (torch.optim.Adam, "cosine"), (torch.optim.AdamW, "one_cycle")],
    ids=["AdamW-lambda", "Adam-cosine", "AdamW-one_cycle"],
)
def test_a_torch_scheduler_drives_the_engine_like_torch(kind, schedule):
    reference, model = _model(), _model()
    torch_opt = kind(_groups(reference), lr=0.01, betas=(0.9, 0.95))
    torch_schedule = SCHEDULERS[schedule](torch_opt)
    view = kind(_groups(model), lr=0.01, betas=(0.9, 0.95))  # what Lightning keeps; never stepped
    view_schedule = SCHEDULERS[schedule](view)
    mapping = OptimizerMap(view, model)
    config = attrs.evolve(Config(), optimizer=mapping.section(Config().optimizer, offloaded=False))
    engine = zkernel.initialize(model, config)
    sync = TorchOptimizerSync(mapping, engine, owns_rate=True)
    data = torch.randn(6, 4, 6, generator=torch.Generator().manual_seed(2))
    try:
        for x in data:
            loss = reference(x).square().mean()
            loss.backward()
            loss = loss.detach()
            torch_opt.step()
            torch_opt.zero_grad()
            torch_schedule.step()
            sync.sync()
            got = engine(x).square().mean()
            engine.backward(got)
            got = got.detach()
            engine.step()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": the engine stepped
                view_schedule.step()
            assert float(got) == pytest.approx(float(loss), abs=1e-6)
        want = reference.state_dict()
        for name, value in engine.state_dict().items():
            torch.testing.assert_close(value, want[name], atol=2e-6, rtol=1e-5)
    finally:
        engine.close()


def test_groups_become_the_section_and_param_group_entries():
    """The first group (the largest rate and weight decay) is the section; the other differs: an entry."""
    model = _model()
    optimizer = torch.optim.Adam(_groups(model), lr=0.01, betas=(0.9, 0.95))
    section = OptimizerMap(optimizer, model).section(Config().optimizer, offloaded=True)
    assert section.name == "cpu_adam" and section.lr == 0.01 and section.options["decoupled_weight_decay"] is False
    assert section.weight_decay == 0.1 and section.betas == (0.9, 0.95) and not section.no_weight_decay
    (second,) = section.param_groups
    assert second.params == ("0.bias", "1.weight", "1.bias", "3.bias") and second.weight_decay == 0.0
    assert second.lr_scale == pytest.approx(0.4) and second.betas == (0.8, 0.99) and second.eps == 1e-6


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "optimizer SGD"),
        (lambda m: _MyAdamW(m.parameters()), "optimizer _MyAdamW"),
        (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad=True"),
        (lambda m: torch.optim.AdamW(list(m.parameters())[:2]), "are in no parameter group"),
        (lambda m: torch.optim.AdamW([nn.Parameter(torch.zeros(2))]), "not a parameter of the LightningModule"),
    ],
)
def test_what_cannot_be_mapped_is_a_config_error(make, message):
    model = _model()
    with pytest.raises(ConfigError, match=message) as error:
        OptimizerMap(make(model), model)
    if "optimizer " in message:
        assert "torch.optim.AdamW or torch.optim.Adam" in str(error.value)


def test_a_config_value_the_optimizer_contradicts_is_an_error():
    model = _model()
    mapping = OptimizerMap(torch.optim.AdamW(model.parameters(), lr=0.01), model)
    with pytest.raises(ConfigError, match=r"optimizer.lr = 0.5 contradicts .* \(lr = 0.01\)"):
        mapping.section(attrs.evolve(Config().optimizer, lr=0.5), offloaded=False)
    with pytest.raises(ConfigError, match="param_groups or optimizer.no_weight_decay"):
        mapping.section(attrs.evolve(Config().optimizer, no_weight_decay=("*.bias",)), offloaded=False)
    same = mapping.section(attrs.evolve(Config().optimizer, lr=0.01, name="adamw"), offloaded=False)
    assert same.lr == 0.01 and same.name == "adamw"

