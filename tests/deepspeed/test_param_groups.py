"""A client torch AdamW with parameter groups passed to `zkernel.deepspeed.initialize` trains like plain
torch with the same groups, and maps to the same ``[optimizer]`` as under the Trainer and Lightning.

On 2 gloo ranks: zero2 with the optimizer on the CPU, no weight decay on biases and norms, a smaller
rate for the head; the groups as mapped at setup, and followed under a client LambdaLR whose first
step is at rate 0 (the groups keep their ratio).
The oracle is single-process torch AdamW over the same groups and batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.harness import run_ranks

WORLD, MICRO, STEPS, DIM, LR, WD = 2, 2, 4, 8, 2e-2, 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x, y):
        return F.mse_loss(self.head(torch.tanh(self.norm(self.fc(x)))), y)


def _groups(model: nn.Module) -> list[dict]:
    """No decay on biases and norms; the head's weight at half the rate."""
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or n.startswith("norm")]
    return [
        {"params": [model.fc.weight]},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": [model.head.weight], "lr": LR / 2},
    ]


def _optimizer(model: nn.Module, scheduled: bool = True):
    optimizer = torch.optim.AdamW(_groups(model), lr=LR, weight_decay=WD)
    if not scheduled:
        return optimizer, None
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 2))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)


def _reference(initial: dict, scheduled: bool) -> dict:
    model = Net()
    model.load_state_dict(initial)
    optimizer, scheduler = _optimizer(model, scheduled)
    for step in range(STEPS):
        torch.stack([model(*_batch(step, r)) for r in range(WORLD)]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return model.state_dict()


def _script(scheduled: bool) -> dict:
    import zkernel.deepspeed as deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = Net()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = _optimizer(model, scheduled)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    section = engine.config.optimizer
    lrs = []
    try:
        for step in range(STEPS):
            lrs.append(engine.get_lr()[0])
            engine.backward(engine(*_batch(step, rank)))
            engine.step()
        state = engine.state_dict()
    finally:
        engine.close()
    return {"state": state, "reference": _reference(initial, scheduled), "lrs": lrs, "section": section}


@pytest.fixture(scope="module")
def results() -> dict[bool, list[dict]]:
    """Each rank's results, with a client scheduler (True) and without (False)."""
    return {scheduled: run_ranks(WORLD, _script, scheduled) for scheduled in (True, False)}


@pytest.mark.parametrize("scheduled", [True, False], ids=["client-scheduler", "static"])
def test_client_groups_train_like_torch(results, scheduled):
    for out in results[scheduled]:
        assert out["lrs"] == pytest.approx([0.0, LR / 2, LR, LR] if scheduled else [LR] * STEPS)
        for key, expected in out["reference"].items():
            torch.testing.assert_close(out["state"][key], expected, rtol=1e-5, atol=1e-6, msg=key)


def test_client_groups_map_as_under_the_trainer_and_lightning(results, tmp_path):
    """The same optimizer gives the same ``[optimizer]`` values and groups on all three paths."""
    pytest.importorskip("pytorch_lightning")
    transformers = pytest.importorskip("transformers")
    from zkernel.integrations.lightning.optimizer import OptimizerMap
    from zkernel.integrations.transformers.config import resolve
    from zkernel.spec.config import Config

    torch.manual_seed(0)
    model = Net()
    optimizer, _ = _optimizer(model)
    lightning = OptimizerMap(optimizer, model).section(Config().optimizer, offloaded=True)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=LR, weight_decay=WD, report_to=[],
                                          use_cpu=True)
    trainer = resolve({}, args, model=model, world_size=1, num_training_steps=None, trainer_optimizer=optimizer)
    trainer = trainer.optimizer
    keys = ("lr", "betas", "eps", "weight_decay", "no_weight_decay", "param_groups")
    deepspeed = results[False][0]["section"]
    for key in keys:
        assert getattr(deepspeed, key) == getattr(lightning, key) == getattr(trainer, key), key
    assert deepspeed.no_weight_decay == ("fc.bias", "norm.weight", "norm.bias", "head.bias")
    (head,) = deepspeed.param_groups
    assert head.params == ("head.weight",) and head.lr_scale == pytest.approx(0.5)
