"""What DeepSpeed example scripts call besides ``initialize``: ``deepspeed.comm`` (``get_rank``, ``barrier``,
``all_reduce``), ``deepspeed.accelerator.get_accelerator()``, ``engine.parameters()`` and
``engine.named_parameters()``, ``engine.device`` and ``engine.destroy()``. A script of ours in the style of
DeepSpeedExamples' benchmark and BERT scripts runs on 2 gloo ranks and in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.harness import run_ranks

DIM = 6


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return self.loss(x, y)


def _script(stage: int) -> dict:
    import zkernel.deepspeed as deepspeed
    from zkernel.deepspeed import comm as dist
    from zkernel.deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = get_accelerator().device_name(dist.get_local_rank())
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "initialized": dist.is_initialized(),
           "device": device, "engine_device": str(engine.device),
           "count": sum(p.ds_numel for p in engine.parameters()),
           "names": [n for n, _ in engine.named_parameters()]}
    dist.barrier()
    g = torch.Generator().manual_seed(out["rank"])
    losses = []
    for _ in range(2):
        x = torch.randn(2, DIM, generator=g).to(device)
        y = torch.randint(0, DIM, (2,), generator=g).to(device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    out["losses"] = losses
    engine.destroy()
    out["closed"] = engine.closed
    with torch.no_grad():  # the model is its own again
        out["usable"] = float(model(torch.zeros(1, DIM), torch.zeros(1, dtype=torch.long)))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, _script, 3)


def test_comm_answers_with_the_process_group(two_ranks):
    assert [o["rank"] for o in two_ranks] == [0, 1]
    assert all(o["world"] == 2 and o["initialized"] for o in two_ranks)
    assert two_ranks[0]["losses"] == two_ranks[1]["losses"]  # all_reduce gave every rank the same mean


def test_engine_parameters_are_the_models_under_module(two_ranks):
    for out in two_ranks:
        assert out["count"] == 2 * (DIM * DIM + DIM)
        assert out["names"] == ["module.layers.0.weight", "module.layers.0.bias", "module.layers.1.weight",
                                "module.layers.1.bias"]


def test_accelerator_names_the_device_the_engine_computes_on(two_ranks):
    for out in two_ranks:
        assert torch.device(out["device"]).type == torch.device(out["engine_device"]).type


def test_destroy_closes_the_engine_and_gives_the_model_back(two_ranks):
    for out in two_ranks:
        assert out["closed"] and out["usable"] > 0


def test_comm_in_one_process_answers_as_a_group_of_one(monkeypatch):
    import zkernel.deepspeed as deepspeed
    from zkernel.deepspeed import comm as dist

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    deepspeed.init_distributed()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), dist.is_initialized()) == (0, 1, 0, False)
    dist.barrier()
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    gathered = [torch.zeros(1)]
    dist.all_gather(gathered, t)
    assert t.item() == 3.0 and gathered[0].item() == 3.0
    with pytest.raises(ValueError, match="rank 1 does not exist"):
        dist.broadcast(t, src=1)
    with pytest.raises(ValueError, match="2 entries for 1 rank"):
        dist.all_gather([torch.zeros(1), torch.zeros(1)], t)
    out = _script(1)
    assert out["world"] == 1 and out["closed"] and len(out["losses"]) == 2


def test_cpu_accelerator_names_the_cpu_whatever_the_index():
    from zkernel.deepspeed.accelerator import Accelerator

    cpu = Accelerator("cpu")
    assert cpu.device_name() == cpu.device_name(1) == cpu.current_device_name() == "cpu"
    cpu.set_device(1)  # nothing to select on the CPU
    assert cpu.communication_backend_name() == "gloo" and cpu.on_accelerator(torch.zeros(1))
    with pytest.raises(AttributeError, match="memory statistics exist only on a GPU"):
        cpu.memory_allocated()
    gpu = Accelerator("cuda")
    assert gpu.device_name(1) == "cuda:1" and gpu.device_name() == "cuda"


def test_checkpoint_tags_are_named_as_deepspeed_names_them(tmp_path):
    import zkernel.deepspeed as deepspeed

    torch.manual_seed(0)
    model = Model()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randn(2, DIM), torch.tensor([0, 1])))
    engine.step()
    engine.save_checkpoint(tmp_path)  # DeepSpeed's default tag: global_step<global steps>
    engine.save_checkpoint(tmp_path, tag=7)  # an integer tag names its directory, as str(tag)
    assert (tmp_path / "global_step1").is_dir() and (tmp_path / "7").is_dir()
    path, _ = engine.load_checkpoint(tmp_path, tag="global_step1")
    assert path == str(tmp_path / "global_step1")
    engine.destroy()


@pytest.mark.cuda
def test_gpu_accelerator_names_the_device_the_engine_computes_on():
    import zkernel.deepspeed as deepspeed
    from zkernel.deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    assert accelerator.device_name() == "cuda" and accelerator.communication_backend_name() == "nccl"
    model = Model()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert torch.device(accelerator.current_device_name()) == engine.device
    assert accelerator.memory_allocated() > 0  # torch.cuda's, on a GPU
    x = torch.randn(2, DIM, device=accelerator.device_name(engine.device.index))
    engine.backward(engine(x, torch.tensor([0, 1], device=x.device)))
    engine.step()
    accelerator.synchronize()
    engine.destroy()
