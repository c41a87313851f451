"""A write to a parameter right after ``step()``, while the step's copies may still be in flight on side
streams, is ordered after them (issue 43: "the write-after-step race on CUDA side streams").

The backward keeps the GPU busy (`LaggingNet`), so when ``step()`` returns the host is far ahead of the
device: an update computed on the CPU is still being uploaded (h2d stream) or published (gathers) when
the script clamps a weight on the compute stream. Were the clamp not ordered after those copies, the
upload would overwrite it, or it would be folded into a master the step had not yet written, and
training would leave torch's AdamW-then-clamp. [Note: writes to gathered parameters] and [Note:
assignments keep the storage] in `zkernel.params.param_writes` say how a write reaches the master.
"""

from __future__ import annotations

import pytest
import torch

import zkernel
from tests.kernel.test_cuda_stream_order import LR, SEED, LaggingNet, _data

pytestmark = pytest.mark.cuda

BOUND = 0.05


def _clamp(weight: torch.nn.Parameter, idiom: str) -> None:
    with torch.no_grad():
        if idiom == "assign":
            weight.data = weight.data.clamp(-BOUND, BOUND)
        else:
            weight.data.clamp_(-BOUND, BOUND)


def _reference(idiom: str):
    torch.manual_seed(SEED)
    model = LaggingNet().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for x, y in _data():
        loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        _clamp(model.head.weight, idiom)
        losses.append(loss.item())
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("idiom", ["inplace", "assign"])
@pytest.mark.parametrize(
    ("stage", "offload", "optimizer"),
    [
        ("zero1", {"optimizer": "cpu"}, "cpu_adam"),
        ("zero2", {"optimizer": "cpu"}, "cpu_adam"),
        ("none", {"optimizer": "cpu"}, "cpu_adam"),
        ("zero2", {"optimizer": "none"}, "adamw"),
        ("zero3", {"optimizer": "cpu"}, "cpu_adam"),
        ("zero3", {"optimizer": "cpu", "params": "cpu"}, "cpu_adam"),
    ],
)
def test_a_clamp_right_after_step_is_ordered_after_the_steps_copies(stage, offload, optimizer, idiom):
    torch.backends.cuda.matmul.allow_tf32 = False
    expected_losses, expected_params = _reference(idiom)
    torch.manual_seed(SEED)
    model = LaggingNet().cuda()
    config = {
        "partitioner": stage,
        "precision": "fp32",
        "gradient_clipping": 0.0,
        "optimizer": {"name": optimizer, "lr": LR, "weight_decay": 0.01},
        "offload": offload,
    }
    if stage == "zero3":
        config["partitioner_options"] = {"persistence_threshold": 0}
    engine = zkernel.initialize(model, config)
    losses = []
    for x, y in _data():
        loss = engine(x.cuda(), y.cuda())
        engine.backward(loss)
        engine.step()
        if stage == "zero3":  # released between steps: written inside a gather, as zero3 requires
            with engine.gathered_parameters():
                _clamp(model.head.weight, idiom)
        else:
            _clamp(model.head.weight, idiom)  # at once: the GPU is still in the backward's sleep
        losses.append(loss.item())
    engine.close()
    for i, (a, b) in enumerate(zip(losses, expected_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: {a} vs {b}"
    got = {n: p.detach().cpu() for n, p in model.named_parameters()}
    assert got["head.weight"].abs().max() <= BOUND
    for name, want in expected_params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
