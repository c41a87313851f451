"""A plain ``loss.backward()`` on CUDA: the epilogue runs on autograd's device thread with the caller's
streams ([Note: a backward the engine is not told of] in `zkernel.kernel.user_backward`), and must see
every gradient however far the GPU lags, as `Engine.backward` does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.slow_backward import SlowBackward

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 100_000_000  # GPU time per backward: the host runs far ahead meanwhile



class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(SlowBackward.apply(x, SLEEP_CYCLES))))


def _train(config: dict, way: str, side_stream: bool) -> dict:
    torch.manual_seed(0)
    engine = zkernel.initialize(_Net(), config)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for _ in range(2):
            x = torch.randn(16, 64, generator=g).cuda().requires_grad_(True)
            y = torch.randn(16, 64, generator=g).cuda()
            loss = F.mse_loss(engine(x).float(), y)
            stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                if way == "engine.backward":
                    engine.backward(loss)
                elif way == "engine.scale":
                    engine.scale(loss).backward()
                else:
                    loss.backward()
            torch.cuda.current_stream().wait_stream(stream)
            engine.step()
    state = engine.state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize(
    "config",
    [
        {"partitioner": "zero2", "precision": "bf16"},
        {"partitioner": "zero3", "precision": "bf16", "offload": {"optimizer": "cpu", "params": "cpu"}},
        {"partitioner": "zero3", "precision": "fp16", "initial_loss_scale": 1024.0},
    ],
    ids=["zero2", "zero3 offload", "zero3 fp16"],
)
def test_plain_backward_on_cuda_equals_engine_backward(config, side_stream):
    config = {**config, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "optimizer": {"lr": 1e-2}}
    expected = _train(config, "engine.backward", side_stream)
    got = _train(config, "engine.scale" if config["precision"] == "fp16" else "loss.backward", side_stream)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
