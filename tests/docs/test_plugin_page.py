"""The plugin author's guide (docs/plugins/writing.md): its third-party optimizer, run as written,
against torch's SGD, and its complete tier, word for word the one tests/sizing/test_outside_tier.py installs."""

from __future__ import annotations

from tests.support.paths import REPO
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.support.models import TrickyNet, batches

PAGE = REPO / "docs" / "plugins" / "writing.md"


@pytest.fixture(scope="module")
def zk_sgd(tmp_path_factory):
    text = PAGE.read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("# zk_sgd.py"))
    path = tmp_path_factory.mktemp("plugin") / "zk_sgd.py"
    path.write_text(block)
    spec = importlib.util.spec_from_file_location("zk_sgd", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _losses(step_fn, model, steps=5):
    losses = []
    for step in batches(7, steps, 1, 1, 4):
        tokens, targets = step[0][0]
        losses.append(step_fn(model, tokens, targets))
    return losses


@pytest.mark.parametrize(("partitioner", "tier"), [("zero2", "none"), ("zero3", "cpu")])
def test_guide_sgd_plugin_matches_torch_sgd(zk_sgd, partitioner, tier):
    import zkernel

    torch.manual_seed(5)
    reference_model = TrickyNet()
    torch.manual_seed(5)
    model = TrickyNet()
    params = [p for p in reference_model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def torch_step(m, tokens, targets):
        loss = m(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    config = {"partitioner": partitioner, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
              "offload": {"optimizer": tier}}
    engine = zkernel.initialize(model, config, plugins=[zk_sgd])

    def engine_step(_m, tokens, targets):
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        return loss.item()

    expected = _losses(torch_step, reference_model)
    got = _losses(engine_step, None)
    engine.close()
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (got, expected)
    assert expected[-1] < expected[0]


def test_guide_tier_example_is_the_tested_outside_tier():
    """The guide's complete tier is, word for word, the one tests/sizing/test_outside_tier.py installs and runs."""
    source = (REPO / "tests" / "support" / "outside_tier" / "outside_tier" / "__init__.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert source in blocks, "docs/plugins/writing.md's third-party tier differs from tests/support/outside_tier"
