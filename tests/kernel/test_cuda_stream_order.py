"""Side-stream transfers wait for the work that produced their data, however far the GPU lags the host."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zkernel
from tests.support.slow_backward import SlowBackward

pytestmark = pytest.mark.cuda

STEPS, SEED, LR = 4, 7, 1e-2
SLEEP_CYCLES = 300_000_000  # ~0.2 s of GPU time per backward: the host runs far ahead meanwhile



class LaggingNet(nn.Module):
    """The first layer's gradients are produced only after the GPU has slept: their reduce, landing and
    download are queued by the host long before the GPU gets to them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.second = nn.Linear(64, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, x, y):
        h = SlowBackward.apply(torch.tanh(self.first(x)), SLEEP_CYCLES)
        return F.cross_entropy(self.head(torch.tanh(self.second(h))), y)


def _data():
    gen = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randn(16, 32, generator=gen), torch.randint(0, 5, (16,), generator=gen)) for _ in range(STEPS)]


def _reference():
    torch.manual_seed(SEED)
    model = LaggingNet().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _data():
        loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def _train_matching(engine, expected_losses) -> None:
    """Train ``engine`` on `_data`, close it, and check its losses against torch's, step by step."""
    losses = []
    for x, y in _data():
        loss = engine(x.cuda(), y.cuda())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    for i, (a, b) in enumerate(zip(losses, expected_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: {a} vs {b}"


@pytest.mark.parametrize("offload", [{"optimizer": "cpu"}, {"optimizer": "cpu", "params": "cpu"}, {"optimizer": "nvme", "params": "cpu"}])
def test_gradient_download_waits_for_a_lagging_backward(offload, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    expected_losses, expected_params = _reference()
    torch.manual_seed(SEED)
    model = LaggingNet().cuda()
    offload = dict(offload)
    offload["optimizer_options"] = {"gpu_share": 0.0}  # the host (and disk) path, every step
    if offload["optimizer"] == "nvme":
        offload["nvme_path"] = str(tmp_path)
    config = {
        "partitioner": "zero3",
        "partitioner_options": {"persistence_threshold": 0},
        "optimizer": {"name": "cpu_adam", "lr": LR, "weight_decay": 0.01},
        "offload": offload,
    }
    engine = zkernel.initialize(model, config)
    _train_matching(engine, expected_losses)
    for p, q in zip(model.parameters(), expected_params):
        torch.testing.assert_close(p.detach().cpu(), q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
def test_host_accumulation_is_timed(grad_dtype):
    """Later micro-batches' gradients are added on the host: the timeline shows those adds with their bytes."""
    from zkernel.telemetry.timeline import SpanKind

    accum = 3
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).cuda()
    numel = sum(p.numel() for p in model.parameters())
    config = {
        "partitioner": "zero2",
        "gradient_accumulation_steps": accum,
        "timeline": True,
        "optimizer": {"name": "cpu_adam", "lr": 1e-3},
        "offload": {"optimizer": "cpu", "optimizer_options": {"grad_dtype": grad_dtype, "device_accumulation": 0.0, "gpu_share": 0.0}},
    }
    engine = zkernel.initialize(model, config)
    x = torch.randn(32, 64, device="cuda")
    losses = []
    for _ in range(3 * accum):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    assert losses[-1] < losses[0]
    last = engine.timeline.summaries[-1]
    width = 4 if grad_dtype == "fp32" else 2
    assert last.count[SpanKind.GRAD_ACCUMULATE] >= accum - 1
    added = last.nbytes[SpanKind.GRAD_ACCUMULATE]
    assert (accum - 1) * numel * width <= added <= (accum - 1) * (numel + 4096) * width


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_device_accumulation_crosses_once_and_adds_as_the_host_does(stage):
    """[Note: device accumulation] From the second step on, a window's gradient adds up on the GPU
    and crosses to the host once: a third of the bytes of host accumulation over 3 micro-batches, no
    host adds, and the same fp32 sums, so without clipping both runs train bit for bit alike, and as
    torch does. The lagging backward checks that the final add on the d2h stream waits for the
    compute stream's adds."""
    from zkernel.telemetry.timeline import SpanKind

    torch.backends.cuda.matmul.allow_tf32 = False
    accum = 3
    gen = torch.Generator().manual_seed(SEED + 2)
    data = [(torch.randn(16, 32, generator=gen), torch.randint(0, 5, (16,), generator=gen)) for _ in range(STEPS * accum)]
    torch.manual_seed(SEED)
    model = LaggingNet().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    expected = []
    for step in range(STEPS):
        total = 0.0
        for x, y in data[step * accum : (step + 1) * accum]:
            loss = model(x.cuda(), y.cuda()) / accum
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        expected.append(total)
    runs = {}
    for share in (0.0, 1.0):
        torch.manual_seed(SEED)
        model = LaggingNet().cuda()
        config = {
            "partitioner": stage,
            "gradient_accumulation_steps": accum,
            "timeline": True,
            "optimizer": {"name": "cpu_adam", "lr": LR, "weight_decay": 0.01},
            "offload": {"optimizer": "cpu", "optimizer_options": {"device_accumulation": share, "gpu_share": 0.0}},
        }
        if stage == "zero3":
            config["partitioner_options"] = {"persistence_threshold": 0}
        engine = zkernel.initialize(model, config)
        losses = []
        for step in range(STEPS):
            total = 0.0
            for x, y in data[step * accum : (step + 1) * accum]:
                loss = engine(x.cuda(), y.cuda())
                engine.backward(loss)
                engine.step()
                total += loss.item() / accum
            losses.append(total)
        on_gpu = sum(n for place, n in engine.memory_report()["grads"].items() if place.startswith("cuda"))
        engine.close()
        assert not any(t.name.startswith("zkernel-accumulate") for t in threading.enumerate())
        runs[share] = (losses, [p.detach().cpu().clone() for p in model.parameters()], engine.timeline.summaries[-1])
        if share:  # the arena: one fp32 sum per element, counted as gradients on the GPU
            assert on_gpu >= 4 * sum(p.numel() for p in model.parameters())
    (host_losses, host_params, host_last), (device_losses, device_params, device_last) = runs[0.0], runs[1.0]
    assert device_losses == host_losses
    for p, q in zip(device_params, host_params):
        assert torch.equal(p, q)
    for i, (a, b) in enumerate(zip(device_losses, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: {a} vs {b}"
    assert host_last.count.get(SpanKind.GRAD_ACCUMULATE, 0) >= accum - 1
    assert device_last.count.get(SpanKind.GRAD_ACCUMULATE, 0) == 0
    assert host_last.nbytes[SpanKind.D2H] == accum * device_last.nbytes[SpanKind.D2H]


def test_speculative_early_steps_run_while_the_backward_still_runs():
    """A speculative step started during backward checks its own group's gradient norm without
    waiting for the compute stream: the second layer's host step finishes while the
    GPU still sleeps in the first layer's backward (each used to wait for the whole queued
    backward, which left the whole CPU step exposed), and training still matches torch."""
    torch.backends.cuda.matmul.allow_tf32 = False
    expected_losses, _ = _reference()
    torch.manual_seed(SEED)
    model = LaggingNet().cuda()
    config = {
        "partitioner": "zero3",
        "partitioner_options": {"persistence_threshold": 0},
        "gradient_clipping": 1e6,  # on, so the coefficient waits for the norm; never reached
        "optimizer": {"name": "cpu_adam", "lr": LR, "weight_decay": 0.01},
        "offload": {"optimizer": "cpu", "optimizer_options": {"speculate": "always", "gpu_share": 0.0}},
    }
    engine = zkernel.initialize(model, config)
    pipeline = engine.pipeline
    compute = torch.cuda.current_stream()
    gpu_busy_after_early_step = []
    early_step = pipeline._early_step

    def recording_early_step(*args, **kwargs):
        result = early_step(*args, **kwargs)
        gpu_busy_after_early_step.append(not compute.query())
        return result

    pipeline._early_step = recording_early_step
    _train_matching(engine, expected_losses)
    assert pipeline.early_steps == 3 * STEPS and pipeline.rollbacks == 0
    # Per step, the second layer's gradient lands just before the host queues the sleep: its step
    # ends while the GPU sleeps (the head's may end before the sleep is queued, the first's after it).
    assert sum(gpu_busy_after_early_step) >= STEPS, f"per early step (head, second, first): {gpu_busy_after_early_step}"
