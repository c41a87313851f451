"""`zkernel.compat.torch_optim`: a torch Adam/AdamW read as zkernel's ``[optimizer]``, the same for the
DeepSpeed, Trainer and Lightning paths: the base section, the per-group overrides stated against the
section they extend, and one set of refusals."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from zkernel.compat.torch_optim import Origin, TorchAdam
from zkernel.errors import ConfigError
from zkernel.spec.sections import OptimizerConfig

ORIGIN = Origin(whose="the test's", instead="a config section")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))


def _decay_groups(model: nn.Module, lr: float = 0.01) -> list[dict]:
    """The Trainer's two groups, the no-decay one first (the base is still the decay group)."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": rest, "weight_decay": 0.0}, {"params": matrices, "weight_decay": 0.1, "lr": lr}]


def test_the_base_section_is_the_largest_rate_and_the_decay_group():
    model = _model()
    optimizer = torch.optim.AdamW(_decay_groups(model), lr=0.01, betas=(0.8, 0.9), eps=1e-6)
    mapping = TorchAdam(optimizer, model, ORIGIN)
    assert mapping.deepspeed_section() == {
        "type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1},
    }
    section = mapping.with_groups(OptimizerConfig(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1))
    assert section.no_weight_decay == ("0.bias", "1.weight", "1.bias", "2.bias") and section.param_groups == ()


def test_an_adam_is_coupled_decay():
    model = _model()
    mapping = TorchAdam(torch.optim.Adam(model.parameters(), weight_decay=0.1), model, ORIGIN)
    assert not mapping.decoupled
    assert mapping.deepspeed_section()["type"] == "Adam"
    assert mapping.deepspeed_section()["params"]["adam_w_mode"] is False


def test_groups_that_differ_otherwise_are_entries_against_the_section_given():
    model = _model()
    optimizer = torch.optim.AdamW(_decay_groups(model, lr=0.02), lr=0.01)
    optimizer.param_groups[0]["betas"] = (0.5, 0.9)
    section = TorchAdam(optimizer, model, ORIGIN).with_groups(OptimizerConfig(lr=0.02, weight_decay=0.1))
    (entry,) = section.param_groups
    assert entry.lr_scale == pytest.approx(0.5) and entry.weight_decay == 0.0 and entry.betas == (0.5, 0.9)
    assert entry.eps is None and not section.no_weight_decay  # eps equals the section's: left to it
    # Against a section whose weight decay is another (a DeepSpeed JSON filled from the arguments), the
    # decay group is an entry too: every parameter keeps its group's values.
    other = TorchAdam(optimizer, model, ORIGIN).with_groups(OptimizerConfig(lr=0.02, weight_decay=0.3))
    assert [g.weight_decay for g in other.param_groups] == [0.0, 0.1]


def test_a_scheduler_s_initial_rate_is_read_and_ties_and_odd_names_are_exact():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight
            self.register_parameter("scale[0]", nn.Parameter(torch.ones(4)))

    model = Tied()
    optimizer = torch.optim.AdamW(
        [{"params": [model.embed.weight], "lr": 0.01}, {"params": [getattr(model, "scale[0]")], "lr": 0.005}]
    )
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)  # a warm-up at 0: no ratio in "lr"
    mapping = TorchAdam(optimizer, model, ORIGIN)
    assert mapping.group_names == [("embed.weight", "head.weight"), ("scale[0]",)]
    assert mapping.base()[0] == 0.01 and [v.lr for v in mapping.values()] == [0.0, 0.0]
    (entry,) = mapping.with_groups(OptimizerConfig(lr=0.01, weight_decay=0.01)).param_groups
    assert entry.params == ("scale[[]0]",) and entry.lr_scale == pytest.approx(0.5)


def test_param_hyper_gives_every_name_its_group_s_values():
    model = _model()
    mapping = TorchAdam(torch.optim.AdamW(_decay_groups(model, lr=0.02), lr=0.01), model, ORIGIN)
    hyper = mapping.param_hyper(mapping.values(), rate=0.02)
    assert hyper["0.bias"].lr_scale == pytest.approx(0.5) and hyper["0.bias"].weight_decay == 0.0
    assert hyper["0.weight"].lr_scale == 1.0 and hyper["0.weight"].weight_decay == 0.1


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), ConfigError,
         r"the test's optimizer SGD cannot be mapped \(torch.optim.sgd.SGD\).*valid: torch.optim.AdamW or "
         r"torch.optim.Adam.*; or a config section"),
        (lambda m: _MyAdamW(m.parameters()), ConfigError, "optimizer _MyAdamW cannot be mapped"),
        (lambda m: (lambda params: torch.optim.AdamW(params)), ConfigError, "optimizer factory"),
        (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), ConfigError,
         r"param_groups\[0\] sets amsgrad=True.*valid: .*amsgrad=False"),
        (lambda m: torch.optim.Adam(m.parameters(), maximize=True), ConfigError, "maximize=True"),
        (lambda m: torch.optim.Adam([{"params": [m[0].weight], "decoupled_weight_decay": True},
                                     {"params": [p for n, p in m.named_parameters() if n != "0.weight"]}]),
         ConfigError, "mix decoupled_weight_decay"),
        (lambda m: torch.optim.AdamW(list(m.parameters())[:2]), ConfigError,
         r"\['1.weight', '1.bias', '2.weight', '2.bias'\] of the model require grad but are in no parameter group"),
        (lambda m: torch.optim.AdamW([*m.parameters(), nn.Parameter(torch.zeros(3))]), ConfigError,
         r"holds a tensor \(shape \(3,\)\) that is not a parameter of the model"),
    ],
    ids=["sgd", "subclass", "factory", "amsgrad", "maximize", "mixed-decoupled", "left-out", "foreign"],
)
def test_what_cannot_be_mapped_says_what_is_valid(make, error, message):
    model = _model()
    with pytest.raises(error, match=message):
        TorchAdam(make(model), model, ORIGIN)


def test_frozen_parameters_need_no_group_and_a_zero_section_rate_is_refused():
    model = _model()
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    mapping = TorchAdam(optimizer, model, ORIGIN)
    with pytest.raises(ConfigError, match="optimizer.lr is 0"):
        mapping.with_groups(attrs.evolve(OptimizerConfig(), lr=0.0))
