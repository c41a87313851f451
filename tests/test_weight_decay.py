"""``[optimizer] no_weight_decay``: biases and norm gains without decay, as a second torch parameter group."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

import zkernel
from tests.harness import run_ranks
from tests.models import TrickyNet, batches, reference_losses
from tests.scenarios import train
from zkernel import hookimpl
from zkernel.config import ConfigError

STEPS, ACCUM, MICRO, SEED = 6, 2, 3, 99
LR, WD, CLIP = 2e-2, 0.5, 0.5  # a weight decay large enough to move every decayed weight visibly
# The biases by name, the LayerNorm's weight and bias by its class, the 0-dim gain by its own name.
PATTERNS = ["*.bias", "LayerNorm", "gain"]
EXEMPT = {"block.0.bias", "block.2.bias", "frozen_proj.bias", "norm.weight", "norm.bias", "gain"}


def _optimizer(**extra) -> dict:
    return {"lr": LR, "weight_decay": WD, "no_weight_decay": PATTERNS, **extra}


CONFIGS = {
    "zero1": {"partitioner": "zero1", "partitioner_options": {"bucket_size": 200}},
    "zero2": {"partitioner": "zero2", "partitioner_options": {"bucket_size": 200}},
    # Units split between the ranks: a rank's shard holds exempt and decayed parameters side by side.
    "zero3": {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0}},
    "zero3 tiled": {
        "partitioner": "zero3",
        "partitioner_options": {"persistence_threshold": 0},
        "tiling": {"modules": ["block.0"], "tiles": 3},
    },
    "zero3 cpu offload": {
        "partitioner": "zero3",
        "partitioner_options": {"persistence_threshold": 0},
        "offload": {"optimizer": "cpu", "params": "cpu"},
        "optimizer": _optimizer(name="cpu_adam"),
    },
}


def _config(name: str) -> dict:
    config = {"gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP, **CONFIGS[name]}
    config.setdefault("optimizer", _optimizer())
    return config


def _reference(world: int, no_decay=EXEMPT) -> list[float]:
    torch.manual_seed(SEED)
    return reference_losses(TrickyNet(), batches(SEED + 1, STEPS, ACCUM, world, MICRO), LR, WD, CLIP, no_decay=no_decay)


def _assert_close(losses, expected, label):
    for i, (a, b) in enumerate(zip(losses, expected, strict=True)):
        assert a == pytest.approx(b, rel=1e-5), f"{label}: step {i}"


def test_exempt_parameters_train_like_a_torch_group_without_decay_on_two_ranks(tmp_path):
    names = [*CONFIGS, "zero2 nvme"]
    nvme = {"partitioner": "zero2", "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path)}, "optimizer": _optimizer(name="cpu_adam")}
    results = run_ranks(2, _train_many, [_config(n) for n in CONFIGS] + [{**_config("zero2"), **nvme}])
    want = _reference(2)
    everything_decayed = _reference(2, no_decay=())
    assert max(abs(a - b) / b for a, b in zip(want, everything_decayed)) > 1e-3, "the exemption changes training"
    for rank_results in results:
        for name, losses in zip(names, rank_results, strict=True):
            _assert_close(losses, want, name)


def _train_many(configs):
    return [train(c, STEPS, ACCUM, MICRO, SEED)["losses"] for c in configs]


def test_each_group_knows_its_exempt_parameters_by_the_users_names():
    torch.manual_seed(0)
    engine = zkernel.initialize(TrickyNet(), {"partitioner": "zero3", "partitioner_options": {"persistence_threshold": 0},
                                              "tiling": {"modules": ["block.0"], "tiles": 3}, "optimizer": _optimizer()})  # fmt: skip
    exempt = {name for g in engine.groups for i, name in enumerate(g.param_names) if i in g.decay_exempt}
    assert exempt == {"block.0.tiles.0.bias", "block.0.tiles.1.bias", "block.0.tiles.2.bias", "block.2.bias",
                      "norm.weight", "norm.bias", "gain", "frozen_proj.bias"}  # fmt: skip
    engine.close()


@pytest.mark.usefixtures("zkernel_debug_logs")
def test_patterns_that_match_nothing_are_an_error_or_a_warning():
    model = TrickyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError) as info:
        zkernel.initialize(model, {"partitioner": "zero3", "optimizer": _optimizer(no_weight_decay=["*RMSNorm", "*.b"])})
    assert "optimizer.no_weight_decay ['*RMSNorm', '*.b'] matches no parameter" in str(info.value)
    assert "(Embedding, LayerNorm, Linear, TrickyNet)" in str(info.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the model is left as it was"
    # A recipe written for several architectures: what this model lacks is named, the rest applies.
    with capture_logs() as logs:
        engine = zkernel.initialize(model, {"optimizer": _optimizer(no_weight_decay=["*.bias", "*RMSNorm"])})
    (warning,) = [e for e in logs if e["event"] == "zkernel.optimizer.no_weight_decay_unmatched"]
    assert warning["patterns"] == ["*RMSNorm"] and warning["exempt_parameters"] == 4
    engine.close()
    with pytest.raises(ConfigError, match="optimizer.no_weight_decay must be"):
        zkernel.initialize(TrickyNet(), {"optimizer": {"no_weight_decay": "bias"}})


class _PlainSGD:
    """A third-party optimizer that declares nothing, so it cannot exempt parameters."""

    @hookimpl
    def zkernel_register_optimizers(self, registry):
        registry.add("plain_sgd", lambda context: self)

    @hookimpl
    def zkernel_step_optimizer(self, group, options):
        group.master.add_(group.grad, alpha=-options.lr)
        return True


def test_an_optimizer_that_cannot_exempt_parameters_is_refused():
    config = {"optimizer": {"name": "plain_sgd", "no_weight_decay": ["*.bias"]}}
    with pytest.raises(ConfigError, match="optimizer 'plain_sgd' does not declare it"):
        zkernel.initialize(TrickyNet(), config, plugins=[_PlainSGD()])
    zkernel.initialize(TrickyNet(), {"optimizer": {"name": "plain_sgd"}}, plugins=[_PlainSGD()]).close()
