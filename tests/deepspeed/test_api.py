"""`zkernel.deepspeed`: a DeepSpeed script with only its import changed trains like plain torch.

One script runs on 2 gloo ranks (module-scoped: the ranks start once): zero.Init construction, a client
torch AdamW mapped into the config, stage 3 with the optimizer offloaded to the CPU, gradient accumulation
and clipping, then checkpoints, an empty directory, and writes inside GatheredParameters. The oracle is
single-process torch AdamW over the same batches."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.harness import run_ranks

WORLD, MICRO, ACCUM, STEPS, DIM, LR, WD, CLIP = 2, 2, 2, 3, 8, 1e-2, 0.01, 0.05


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def _batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)


def _ds_config(persistence: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "stage3_param_persistence_threshold": persistence},
    }


def _reference(initial: dict) -> dict:
    model = Net()
    model.load_state_dict(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        losses = [model(*_batch(step, r, m)) for r in range(WORLD) for m in range(ACCUM)]
        torch.stack(losses).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _script(directory: str, empty: str, persistence: int) -> dict:
    import structlog

    import zkernel
    import zkernel.deepspeed as deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    with deepspeed.zero.Init():
        model = Net()
    meta = all(p.is_meta for p in model.parameters())
    try:  # a write to a meta parameter would be lost when initialize materialises it
        with deepspeed.zero.GatheredParameters(model.fc1.weight, modifier_rank=0):
            pass
        meta_write = None
    except ValueError as exc:
        meta_write = str(exc)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    data = torch.utils.data.TensorDataset(torch.randn(12, DIM), torch.randn(12, DIM))
    engine, opt, loader, sched = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), training_data=data, config=_ds_config(persistence)
    )
    out = {"meta": meta, "meta_write": meta_write, "stage": engine.zero_optimization_stage(), "batch": engine.train_batch_size(),
           "micro": engine.train_micro_batch_size_per_gpu(), "accum": engine.gradient_accumulation_steps(),
           "loader_batch": loader.batch_size, "sampler": type(loader.sampler).__name__, "sched": sched,
           "group_lr": opt.param_groups[0]["lr"], "lr": engine.get_lr()}
    initial = engine.state_dict()
    out["materialised"] = all(v.abs().sum() > 0 for k, v in initial.items() if k.endswith("weight"))
    boundaries = []
    engine.train()
    for step in range(STEPS):
        for m in range(ACCUM):
            boundaries.append(engine.is_gradient_accumulation_boundary())
            loss = engine(*_batch(step, rank, m))
            engine.backward(loss)
            opt.zero_grad()
            engine.step()
    out.update(boundaries=boundaries, steps=engine.global_steps, state=engine.state_dict(),
               reference=_reference(initial))

    with structlog.testing.capture_logs() as logs:
        out["empty"] = engine.load_checkpoint(empty)
    out["empty_warned"] = [e["event"] for e in logs if e.get("log_level") == "warning"]
    engine.save_checkpoint(directory, client_state={"epoch": 3, "position": rank})
    opt.param_groups[0]["lr"] = LR / 2
    out["lr_set"] = engine.get_lr()
    path, client = engine.load_checkpoint(directory)
    out.update(path=path, client=client)

    with deepspeed.zero.GatheredParameters(model.fc1.weight, modifier_rank=0):
        if rank == 0:
            model.fc1.weight.data.fill_(0.5)
    out["modified"] = engine.state_dict()["fc1.weight"]
    with deepspeed.zero.GatheredParameters(model.fc1.weight):  # this rank's own view, gathered again
        out["modified_here"] = model.fc1.weight.detach().clone()
    with deepspeed.zero.GatheredParameters(model.fc2.weight):  # read on one rank only: nothing to settle
        if rank == 0:
            out["read"] = float(model.fc2.weight.data.norm())
    try:
        with deepspeed.zero.GatheredParameters([model.fc2.weight]):
            if rank == 1:
                model.fc2.weight.data.fill_(2.0)
        out["one_rank_write"] = None
    except zkernel.ParamWriteError as exc:
        out["one_rank_write"] = str(exc)
    out["after_error"] = engine.state_dict()["fc2.weight"]
    engine.close()
    return out


@pytest.fixture(scope="module", params=[0, 10**6], ids=["released", "persistent"])
def results(request, tmp_path_factory):
    """Parameters released between steps (persistence threshold 0), and all kept whole."""
    directory, empty = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("empty")
    return run_ranks(WORLD, _script, str(directory), str(empty), request.param)


def test_deepspeed_script_trains_like_torch(results):
    for out in results:
        assert out["meta"] and out["materialised"] and "meta device" in out["meta_write"]
        assert (out["stage"], out["micro"], out["accum"], out["batch"]) == (3, MICRO, ACCUM, MICRO * ACCUM * WORLD)
        assert out["lr"] == [LR] and out["group_lr"] == LR and out["sched"] is None
        assert out["boundaries"] == [False, True] * STEPS and out["steps"] == STEPS
        for key, expected in out["reference"].items():
            torch.testing.assert_close(out["state"][key], expected, rtol=1e-4, atol=1e-5, msg=key)


def test_training_data_is_loaded_in_micro_batches_across_ranks(results):
    assert all(out["loader_batch"] == MICRO and out["sampler"] == "DistributedSampler" for out in results)


def test_save_and_load_return_the_client_state(results):
    for rank, out in enumerate(results):
        assert out["client"] == {"epoch": 3, "position": 0}  # rank 0's, as DeepSpeed saves it
        assert out["path"].endswith(f"/global_step{STEPS}")  # DeepSpeed's default tag
        assert out["lr_set"] == [LR / 2]


def test_load_from_an_empty_directory_returns_none(results):
    for out in results:
        assert out["empty"] == (None, None)
        assert "zkernel.deepspeed.no_checkpoint" in out["empty_warned"]


def test_a_modifier_rank_write_reaches_every_rank(results):
    for out in results:
        for key in ("modified", "modified_here"):
            assert torch.equal(out[key], torch.full_like(out[key], 0.5)), key


def test_a_write_on_one_rank_without_modifier_rank_is_an_error(results):
    for out in results:
        assert "read" in out or out is not results[0]
        assert out["one_rank_write"] is not None and "fc2.weight" in out["one_rank_write"]
        assert not (out["after_error"] == 2.0).any()
        assert torch.equal(out["after_error"], results[0]["after_error"])


def test_warmup_lr_section_drives_get_lr(tmp_path):
    import zkernel.deepspeed as deepspeed

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 4, "warmup_type": "linear"}},
    }))
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", str(path)])
    torch.manual_seed(0)
    model = Net()
    engine, opt, loader, sched = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    assert loader is None and sched is not None
    lrs = []
    try:
        for _ in range(7):
            lrs.append(engine.get_lr()[0])
            assert sched.get_last_lr() == engine.get_lr() == [opt.param_groups[0]["lr"]]
            loss = engine(torch.randn(2, DIM), torch.randn(2, DIM))
            engine.backward(loss)
            engine.step()
            sched.step()
    finally:
        engine.close()
    assert lrs[0] == 0.0 and lrs[-1] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs, lrs[1:])) and len(set(lrs)) > 3


def test_parameters_carry_their_whole_sizes_as_ds_numel():
    """Under stage 3 a released parameter's numel() is 0; ds_numel/ds_shape say its whole size, as in DeepSpeed."""
    import zkernel.deepspeed as deepspeed

    torch.manual_seed(0)
    model = Net()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    try:
        params = dict(engine.module.named_parameters())
        assert any(p.numel() == 0 for p in params.values())
        assert {n: p.ds_shape for n, p in params.items()} == shapes
        assert all(p.ds_numel == shapes[n].numel() for n, p in params.items())
        assert engine.num_parameters() == sum(s.numel() for s in shapes.values())
    finally:
        engine.close()


def test_a_client_optimizer_without_an_equivalent_is_an_error():
    import zkernel.deepspeed as deepspeed
    from zkernel.errors import ConfigError

    model = Net()
    with pytest.raises(ConfigError, match="SGD cannot be mapped"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config={"train_micro_batch_size_per_gpu": 1})


def test_a_client_torch_scheduler_sets_the_rate_of_each_step():
    import zkernel.deepspeed as deepspeed

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                 config={"train_micro_batch_size_per_gpu": 2})
    lrs = []
    try:
        for _ in range(3):
            lrs.append(engine.get_lr()[0])
            engine.backward(engine(torch.randn(2, DIM), torch.randn(2, DIM)))
            engine.step()
    finally:
        engine.close()
    assert sched is scheduler
    assert lrs == pytest.approx([1e-3, 1e-3 / 2, 1e-3 / 3])


def test_a_client_torch_adam_keeps_its_coupled_weight_decay():
    """torch.optim.Adam's weight_decay is an L2 term in the gradient, not AdamW's decay: mapped as such."""
    import zkernel.deepspeed as deepspeed

    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0})
    oracle = torch.optim.Adam(reference.parameters(), lr=1e-2, weight_decay=0.1)
    try:
        for step in range(3):
            x, y = _batch(step, 0, 0)
            engine.backward(engine(x, y))
            engine.step()
            reference(x, y).backward()
            oracle.step()
            oracle.zero_grad()
        state = engine.state_dict()
    finally:
        engine.close()
    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(state[key], expected, rtol=1e-5, atol=1e-6, msg=key)


def test_model_parameters_with_per_group_settings_are_an_error():
    import zkernel.deepspeed as deepspeed

    model = Net()
    groups = [{"params": [model.fc1.weight], "weight_decay": 0.0}, {"params": [model.fc2.weight]}]
    with pytest.raises(ValueError, match="no_weight_decay"):
        deepspeed.initialize(model=model, model_parameters=groups, config={"train_micro_batch_size_per_gpu": 1})
