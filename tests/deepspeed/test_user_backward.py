"""`zkernel.deepspeed`'s PyTorch-compatible backward: ``loss.backward()``, ``engine.scale(loss)`` and
``engine.backward(loss, scale_wrt_gas=False)`` as DeepSpeed's engine has them, on 2 gloo ranks with
accumulation and clipping, against ``engine.backward(loss)`` (bit for bit) and torch AdamW with DDP's
gradient ([Note: a backward the engine is not told of] in `zkernel.kernel.user_backward`)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tests.support.harness import run_ranks
from tests.support.user_backward_scenarios import ACCUM, CLIP, LR, MICRO, STEPS, WD, Net, batch, reference

WAYS = ("engine.backward", "loss.backward", "engine.scale", "unscaled")


def _train(stage: int) -> dict:
    import zkernel.deepspeed as deepspeed

    rank = int(os.environ["RANK"])
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage},
    }
    states, returned = {}, []
    for way in WAYS:
        torch.manual_seed(0)
        model = Net()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for step in range(STEPS):
            for micro in range(ACCUM):
                x, y = batch(step, micro, rank)
                loss = F.mse_loss(engine(x), y)
                if way == "engine.backward":
                    returned.append(float(engine.backward(loss)) / float(loss))
                elif way == "loss.backward":
                    loss.backward()
                elif way == "engine.scale":
                    engine.scale(loss).backward()
                else:
                    engine.backward(loss, scale_wrt_gas=False)
                engine.step()
        states[way] = engine.engine.state_dict()
        engine.destroy()
    return {"states": states, "returned": returned}


def _both_stages() -> list[dict]:
    return [_train(1), _train(3)]


def test_plain_backward_scale_and_scale_wrt_gas_through_the_deepspeed_engine():
    for per_rank in run_ranks(2, _both_stages):
        for stage, result in zip((1, 3), per_rank, strict=True):
            states = result["states"]
            for way in ("loss.backward", "engine.scale"):
                for name, value in states["engine.backward"].items():
                    assert torch.equal(states[way][name], value), f"stage {stage}, {way}: {name}"
            for way in WAYS:
                for name, value in reference(way, 2).items():
                    torch.testing.assert_close(states[way][name].float(), value, rtol=1e-5, atol=1e-6,
                                               msg=f"stage {stage}, {way}: {name}")
            # DeepSpeed's backward returns the loss divided by the accumulation steps.
            assert all(abs(r - 1 / ACCUM) < 1e-6 for r in result["returned"])
