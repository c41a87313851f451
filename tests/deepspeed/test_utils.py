"""`zkernel.deepspeed.utils` and the engine's 16-bit save, norm and step accessors, on 2 gloo ranks against torch.

One rank script (module-scoped: the ranks start once) trains the same tiny model
under plain data parallel, zero1, zero2, zero3, and zero3 with the optimizer on
the CPU and on NVMe, with gradient accumulation 2, beside single-process torch
AdamW over the same global batches; it reads every parameter's full gradient
after each window's last backward, the fp32 masters and Adam moments after each
step, sets a master and a moment, and steps once more. The zero3 run leaves a
checkpoint that the tests convert offline (`zero_to_fp32`, in this process,
with no process group); an fp16 engine shows the gradient's loss scale, one
with a NaN window a skipped step, and a bf16 zero3 engine saves its 16-bit
weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.harness import run_ranks

WORLD, MICRO, ACCUM, STEPS, DIM, LR, WD = 2, 2, 2, 2, 5, 1e-2, 0.01
SCENARIOS = {"none": (0, "none"), "zero1": (1, "none"), "zero2": (2, "none"), "zero3": (3, "none"),
             "zero3_cpu": (3, "cpu"), "zero3_nvme": (3, "nvme")}
HOST_STEPPED = ("zero3_cpu", "zero3_nvme")
CLOSE = {"rtol": 1e-4, "atol": 1e-5}


class Net(nn.Module):
    """Uneven sizes (115 trainable elements) and a frozen parameter the engines do not train."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.frozen = nn.Parameter(torch.linspace(0.5, 1.5, DIM), requires_grad=False)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x * self.frozen))), y)


def _batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)


def _config(stage: int, offload: str, precision: str = "fp32", nvme_path: str | None = None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}},
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if offload == "nvme":
        config["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme_path
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def _adam_state(opt, model, key: str) -> dict:
    return {n: opt.state[p][key].clone() for n, p in model.named_parameters() if p.requires_grad}


def _train(stage: int, offload: str, checkpoint: str | None, nvme_path: str) -> dict:
    """One engine beside its torch reference; what the utils answered and what torch has."""
    import zkernel.deepspeed as deepspeed
    from zkernel.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=_config(stage, offload, nvme_path=nvme_path))
    reference = Net()
    reference.load_state_dict(engine.state_dict())
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    named = list(engine.module.named_parameters())
    out = {key: [] for key in ("grads", "grads_ref", "norm", "norm_ref", "applied", "fp32", "fp32_ref", "exp_avg",
                               "exp_avg_ref", "exp_avg_sq", "exp_avg_sq_ref", "mid", "mid_ref", "local")}  # fmt: skip

    def window(step: int) -> None:
        for micro in range(ACCUM):
            engine.backward(engine(*_batch(step, rank, micro)))
            if micro == ACCUM - 1:
                out["grads"].append({n: safe_get_full_grad(p) for n, p in named})
                try:
                    out["mid"].append(safe_get_full_fp32_param(engine.module.fc1.weight))
                except RuntimeError as exc:
                    out["mid"].append(str(exc))
            engine.step()
            out["applied"].append(engine.was_step_applied())
        out["after_step_grad"] = safe_get_full_grad(engine.module.fc1.weight)

    def reference_window(step: int) -> None:
        out["mid_ref"].append(reference.fc1.weight.detach().clone())
        torch.stack([reference(*_batch(step, r, m)) for r in range(WORLD) for m in range(ACCUM)]).mean().backward()
        out["grads_ref"].append({n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None})
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        out["norm_ref"].append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        opt.step()
        opt.zero_grad()

    def read_states() -> None:
        out["fp32"].append({n: safe_get_full_fp32_param(p) for n, p in named})
        out["exp_avg"].append({n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named})
        out["exp_avg_sq"].append({n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in named})
        out["local"].append({n: safe_get_local_fp32_param(p) for n, p in named})
        out["fp32_ref"].append({n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad})
        out["exp_avg_ref"].append(_adam_state(opt, reference, "exp_avg"))
        out["exp_avg_sq_ref"].append(_adam_state(opt, reference, "exp_avg_sq"))

    for step in range(STEPS):
        window(step)
        reference_window(step)
        out["norm"].append(engine.get_global_grad_norm())
        read_states()
    try:
        safe_get_full_optimizer_state(engine.module.fc1.weight, "exp_avgs")
    except KeyError as exc:
        out["bad_key"] = str(exc)

    # A master and a moment set between steps: the next step starts from them, as torch's would.
    new_weight = torch.linspace(-1.0, 1.0, 2 * DIM * DIM).view(2 * DIM, DIM)
    new_moment = torch.full((DIM, 2 * DIM), 0.01)
    safe_set_full_fp32_param(engine.module.fc1.weight, new_weight)
    safe_set_full_optimizer_state(engine.module.fc2.weight, new_moment, "exp_avg")
    out["set_read_back"] = (safe_get_full_fp32_param(engine.module.fc1.weight),
                            safe_get_full_optimizer_state(engine.module.fc2.weight, "exp_avg"))  # fmt: skip
    with torch.no_grad():
        reference.fc1.weight.copy_(new_weight)
        opt.state[reference.fc2.weight]["exp_avg"].copy_(new_moment)
    window(STEPS)
    reference_window(STEPS)
    read_states()
    out["state"] = engine.state_dict()
    out["frozen"] = (safe_get_full_fp32_param(engine.module.frozen), safe_get_full_grad(engine.module.frozen),
                     safe_get_full_optimizer_state(engine.module.frozen, "exp_avg"))  # fmt: skip
    if checkpoint is not None:
        engine.save_checkpoint(checkpoint)
    engine.destroy()
    try:
        safe_get_full_fp32_param(engine.module.fc1.weight)
    except RuntimeError as exc:
        out["closed"] = str(exc)
    return out


def _skipped_step() -> dict:
    """A window whose gradient is not finite is skipped: was_step_applied() says so."""
    import zkernel.deepspeed as deepspeed

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=_config(1, "none"))
    applied = []
    for bad in (False, True):
        for micro in range(ACCUM):
            x, y = _batch(0, 0, micro)
            engine.backward(engine(x * float("nan") if bad else x, y))
            engine.step()
            applied.append(engine.was_step_applied())
    out = {"applied": applied, "skipped": engine.skipped_steps}
    engine.destroy()
    return out


def _fp16_grads() -> dict:
    """Under fp16 the full gradient still holds the loss scale, as DeepSpeed's (zero2, one window)."""
    import zkernel.deepspeed as deepspeed
    from zkernel.deepspeed.utils import safe_get_full_grad

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=_config(2, "none", "fp16"))
    reference = Net()
    reference.load_state_dict(engine.state_dict())
    for micro in range(ACCUM):
        engine.backward(engine(*_batch(0, rank, micro)))
        if micro == ACCUM - 1:
            out = {"scale": engine.loss_scaler.scale,
                   "grads": {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}}  # fmt: skip
        engine.step()
    torch.stack([reference(*_batch(0, r, m)) for r in range(WORLD) for m in range(ACCUM)]).mean().backward()
    out["grads_ref"] = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    engine.destroy()
    return out


def _save_16bit(directory: str) -> dict:
    """A bf16 zero3 engine after one step writes its 16-bit weights on rank 0."""
    import zkernel.deepspeed as deepspeed

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=_config(3, "none", "bf16"))
    for micro in range(ACCUM):
        engine.backward(engine(*_batch(0, rank, micro)))
        engine.step()
    saved = (engine.save_16bit_model(directory),
             engine.save_fp16_model(directory, "model.safetensors"),
             engine.save_16bit_model(directory, "trained.bin", exclude_frozen_parameters=True))  # fmt: skip
    from safetensors.torch import load_file

    out = {"saved": saved, "state": engine.state_dict(),
           "bin": torch.load(f"{directory}/pytorch_model.bin", weights_only=True),
           "safetensors": load_file(f"{directory}/model.safetensors"),
           "trained": torch.load(f"{directory}/trained.bin", weights_only=True)}  # fmt: skip
    fresh = Net()
    fresh.load_state_dict(out["bin"])  # strict: every key of the plain model
    out["loaded"] = {k: v.clone() for k, v in fresh.state_dict().items()}
    engine.destroy()
    return out


def _script(checkpoint: str, sixteen: str, nvme_path: str) -> dict:
    import zkernel.deepspeed as deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {name: _train(stage, offload, checkpoint if name == "zero3" else None, nvme_path)
           for name, (stage, offload) in SCENARIOS.items()}  # fmt: skip
    out["skipped"] = _skipped_step()
    out["fp16"] = _fp16_grads()
    out["16bit"] = _save_16bit(sixteen)
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero3_checkpoint")


@pytest.fixture(scope="module")
def results(checkpoint_dir, tmp_path_factory):
    return run_ranks(WORLD, _script, str(checkpoint_dir), str(tmp_path_factory.mktemp("sixteen")),
                     str(tmp_path_factory.mktemp("nvme")))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_full_grads_are_torchs_after_the_windows_last_backward(results, name):
    for out in (r[name] for r in results):
        for step, (grads, expected) in enumerate(zip(out["grads"], out["grads_ref"])):
            assert grads["frozen"] is None
            for key, value in expected.items():
                torch.testing.assert_close(grads[key], value, **CLOSE, msg=f"step {step} {key}")
        assert out["after_step_grad"] is None  # the step consumed the window's gradient
        torch.testing.assert_close(out["norm"], out["norm_ref"][:STEPS], **CLOSE)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fp32_params_and_adam_state_are_torch_adamws(results, name):
    for out in (r[name] for r in results):
        for step in range(STEPS + 1):
            for kind in ("fp32", "exp_avg", "exp_avg_sq"):
                got, expected = out[kind][step], out[f"{kind}_ref"][step]
                assert got["frozen"] is None
                for key, value in expected.items():
                    torch.testing.assert_close(got[key], value, **CLOSE, msg=f"step {step} {kind} {key}")
        assert out["frozen"] == (None, None, None)
        assert "'exp_avgs'" in out["bad_key"] and "exp_avg_sq" in out["bad_key"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_set_master_and_moment_are_where_the_next_step_starts(results, name):
    for out in (r[name] for r in results):
        weight, moment = out["set_read_back"]
        assert torch.equal(weight, torch.linspace(-1.0, 1.0, 2 * DIM * DIM).view(2 * DIM, DIM))
        assert torch.equal(moment, torch.full((DIM, 2 * DIM), 0.01))
        for key, value in out["fp32_ref"][STEPS].items():  # after the step from the set values
            torch.testing.assert_close(out["state"][key], value, **CLOSE, msg=key)
        assert out["applied"] == [False, True] * (STEPS + 1)


def test_masters_read_in_the_last_backward_are_the_last_steps_or_refused_while_the_host_steps(results):
    for out in (r[name] for r in results for name in ("none", "zero1", "zero2", "zero3")):
        for got, expected in zip(out["mid"], out["mid_ref"]):
            torch.testing.assert_close(got, expected, **CLOSE)
    for out in (r[name] for r in results for name in HOST_STEPPED):
        assert all(isinstance(m, str) and "after engine.step()" in m for m in out["mid"])


def test_a_closed_engines_parameter_is_an_error(results):
    for out in (r[name] for r in results for name in SCENARIOS):
        assert "after engine.close()" in out["closed"]


@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_local_fp32_params_are_this_ranks_elements(results, name):
    runs = [r[name] for r in results]
    assert sum(t.numel() for out in runs for t in out["local"][STEPS].values() if t is not None) == 115
    for key, full in runs[0]["fp32"][STEPS].items():
        if full is None:
            continue
        pieces = [out["local"][STEPS][key] for out in runs]  # rank 0's shard comes first in the flat layout
        assert all(p.dim() == 1 for p in pieces)
        assert torch.equal(torch.cat(pieces), full.reshape(-1)), key


def test_fp16_grads_hold_the_loss_scale(results):
    for out in (r["fp16"] for r in results):
        assert out["scale"] == 2.0**8
        for key, value in out["grads_ref"].items():
            torch.testing.assert_close(out["grads"][key] / out["scale"], value, rtol=2e-2, atol=2e-3, msg=key)


def test_local_fp32_params_of_plain_data_parallel_are_whole(results):
    for out in (r["none"] for r in results):
        for key, full in out["fp32"][STEPS].items():
            if full is not None:
                assert torch.equal(out["local"][STEPS][key], full.reshape(-1)), key


def test_was_step_applied_is_false_after_a_skipped_step(results):
    for r in results:
        assert r["skipped"]["applied"] == [False, True, False, False]
        assert r["skipped"]["skipped"] == 1


def test_save_16bit_model_loads_into_a_fresh_model(results):
    for out in (r["16bit"] for r in results):
        assert out["saved"] == (True, True, True)
        for key, value in out["state"].items():
            expected = value.to(torch.bfloat16)
            assert out["bin"][key].dtype == torch.bfloat16
            assert torch.equal(out["bin"][key], expected), key
            assert torch.equal(out["safetensors"][key], expected), key
            assert torch.equal(out["loaded"][key], value.to(torch.bfloat16).to(value.dtype)), key
        assert set(out["trained"]) == set(out["state"]) - {"frozen"}


# -- zero_to_fp32: offline, in this process, no process group ------------------------------------


def _trained_state(results) -> dict:
    state = results[0]["zero3"]["state"]
    assert all(torch.equal(state[k], results[1]["zero3"]["state"][k]) for k in state)
    return state


def test_get_fp32_state_dict_is_the_trained_models(results, checkpoint_dir):
    from zkernel.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = _trained_state(results)
    assert (checkpoint_dir / "latest").read_text().strip() == f"global_step{STEPS + 1}"
    for tag in (None, f"global_step{STEPS + 1}"):
        got = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
        assert set(got) == set(state)
        for key, value in state.items():
            assert got[key].dtype == torch.float32 and torch.equal(got[key], value), key
    trained = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, exclude_frozen_parameters=True)
    assert set(trained) == set(state) - {"frozen"}


def test_load_state_dict_from_zero_checkpoint_fills_a_fresh_model(results, checkpoint_dir):
    from zkernel.deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    model = load_state_dict_from_zero_checkpoint(Net(), checkpoint_dir)
    for key, value in _trained_state(results).items():
        assert torch.equal(model.state_dict()[key], value), key


def test_convert_writes_files_torch_and_safetensors_load(results, checkpoint_dir, tmp_path):
    from safetensors.torch import load_file

    from zkernel.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    state = _trained_state(results)
    (written,) = convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, tmp_path / "bin")
    assert written == tmp_path / "bin" / "pytorch_model.bin"
    shards = convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, tmp_path / "st", max_shard_size="256B",
                                                        safe_serialization=True)  # fmt: skip
    assert len(shards) > 2 and shards[-1].name == "model.safetensors.index.json"
    merged = {}
    for shard in shards[:-1]:
        merged.update(load_file(shard))
    for got in (torch.load(written, weights_only=True), merged):
        assert set(got) == set(state)
        for key, value in state.items():
            assert torch.equal(got[key], value), key
    with pytest.raises(ValueError, match="valid: a positive number"):
        convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, tmp_path / "x", max_shard_size="five")


def test_the_command_line_writes_one_safetensors_file(results, checkpoint_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    subprocess.run([sys.executable, "-m", "zkernel.deepspeed.utils.zero_to_fp32", str(checkpoint_dir), str(out),
                    "-t", f"global_step{STEPS + 1}"], check=True, capture_output=True)  # fmt: skip
    got = load_file(out)
    for key, value in _trained_state(results).items():
        assert torch.equal(got[key], value), key


def test_the_utils_are_reached_as_deepspeeds_are():
    import zkernel.deepspeed as deepspeed
    from zkernel.deepspeed.utils import safe_get_full_grad
    from zkernel.deepspeed.utils.tensor_fragment import safe_get_full_fp32_param

    assert deepspeed.utils.safe_get_full_grad is safe_get_full_grad
    plain = nn.Linear(2, 2)  # of no engine: DeepSpeed answers .grad for the gradient, None for the rest
    plain(torch.ones(1, 2)).sum().backward()
    assert safe_get_full_grad(plain.weight) is plain.weight.grad and safe_get_full_fp32_param(plain.weight) is None


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_master_set_after_the_last_backward_is_where_that_step_starts(offload):
    """As DeepSpeed's: a master set between the window's last backward and its step is what the step
    updates (the step then applies the window's gradient to it); where the optimizer is on the host
    that step has started, and the set is refused, changing nothing."""
    import zkernel.deepspeed as deepspeed
    from zkernel.deepspeed.utils import safe_get_full_grad, safe_set_full_fp32_param

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=_config(3, offload))
    reference = Net()
    reference.load_state_dict(engine.state_dict())
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    value = torch.full((2 * DIM, DIM), 0.25)
    torch.stack([reference(*_batch(0, 0, m)) for m in range(ACCUM)]).mean().backward()
    for micro in range(ACCUM):
        engine.backward(engine(*_batch(0, 0, micro)))
        if micro < ACCUM - 1:
            engine.step()
    assert safe_get_full_grad(engine.module.fc1.weight) is not None
    if offload == "cpu":
        with pytest.raises(RuntimeError, match="between the last backward of an accumulation window and engine.step"):
            safe_set_full_fp32_param(engine.module.fc1.weight, value)
    else:
        safe_set_full_fp32_param(engine.module.fc1.weight, value)
        with torch.no_grad():
            reference.fc1.weight.copy_(value)
    engine.step()
    opt.step()
    state = engine.state_dict()
    engine.destroy()
    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(state[key], expected, **CLOSE, msg=key)
