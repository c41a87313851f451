"""`zkernel.deepspeed.utils` on a GPU: the gradient read from the device tier, from host landing buffers
filled by device-to-host copies (with the window's earlier micro-batches summed on the GPU: [Note: device
accumulation]) and from groups the GPU share took after the first step, against torch on the same GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ACCUM, WINDOWS, DIM, LR = 2, 3, 64, 1e-2
CLOSE = {"rtol": 1e-4, "atol": 1e-5}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def _batch(window: int, micro: int):
    g = torch.Generator().manual_seed(100 * window + micro)
    return torch.randn(4, DIM, generator=g).cuda(), torch.randn(4, DIM, generator=g).cuda()


def _engine(kind: str):
    import zkernel
    import zkernel.deepspeed as deepspeed

    if kind == "host_landing":  # no GPU share: every group lands on the host, summed on the GPU first
        config = {"partitioner": "zero3", "gradient_accumulation_steps": ACCUM,
                  "optimizer": {"name": "cpu_adam", "lr": LR, "weight_decay": 0.0},
                  "offload": {"optimizer": "cpu", "optimizer_options": {"gpu_share": 0.0}}}  # fmt: skip
        engine = zkernel.initialize(Net(), config)
        deepspeed.zero.track(engine)  # as zkernel.deepspeed.initialize records its engines
        return engine
    offload = "cpu" if kind == "gpu_share" else "none"
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": offload}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    return engine


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["device", "gpu_share", "host_landing"])
def test_full_grads_and_masters_on_the_gpu_are_torchs(kind):
    from zkernel.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    torch.manual_seed(0)
    engine = _engine(kind)
    reference = Net().cuda()
    reference.load_state_dict(engine.state_dict())
    opt = torch.optim.Adam(reference.parameters(), lr=LR)
    for window in range(WINDOWS):
        for micro in range(ACCUM):
            engine.backward(engine(*_batch(window, micro)))
            if micro == ACCUM - 1:
                grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            engine.step()
        torch.stack([reference(*_batch(window, m)) for m in range(ACCUM)]).mean().backward()
        for name, p in reference.named_parameters():
            assert grads[name].device.type == "cuda"
            torch.testing.assert_close(grads[name], p.grad, **CLOSE, msg=f"window {window} {name}")
        opt.step()
        opt.zero_grad()
        for name, p in engine.module.named_parameters():
            expected = reference.get_parameter(name)
            torch.testing.assert_close(safe_get_full_fp32_param(p), expected, **CLOSE, msg=f"window {window} {name}")
    engine.close()
