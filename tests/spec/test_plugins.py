"""Third-party plugins: found through an entry point or passed in code, selected by name, and run."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pluggy
import pytest
import torch

import zkernel
from zkernel.spec.tiers import OptimizerTier
from zkernel.spec.hookspecs import hookimpl
from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager, list_components
from zkernel.spec.registry import Family


class SignSGD:
    """A toy-free third-party optimizer: sign SGD, easy to check exactly."""

    def __init__(self, context) -> None:
        self.lr = context.config.optimizer.lr
        self.calls = 0

    @hookimpl
    def zkernel_step_optimizer(self, group, options):
        self.calls += 1
        group.master.add_(torch.sign(group.grad), alpha=-options.lr)
        if group.copy_out is not None:
            group.copy_out.copy_(group.master)
        return True


class RecordingTier(OptimizerTier):
    """A complete third-party optimizer tier: state where the master is, events recorded."""

    events: list = []

    def __init__(self, context, role) -> None:
        assert role == "optimizer"
        self.landing: dict[int, torch.Tensor] = {}

    def demand(self, numel, state, compute_dtype):
        return {}

    def adopt(self, group, master, state):
        group.master = master.clone()
        group.optim_state = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in state}
        group.copy_out = group.param_shard
        self.landing[group.index] = torch.zeros_like(group.master)
        RecordingTier.events.append(("adopt", group.name))

    def land(self, group, reduced, final):
        if reduced.work is not None:
            reduced.work.wait()
        landing = self.landing[group.index]
        landing.add_(reduced.tensor) if reduced.accumulate else landing.copy_(reduced.tensor)
        RecordingTier.events.append(("land", group.name, final))

    def flush(self):
        pass

    def grad_sq_norm(self, groups):
        return [float(self.landing[g.index].pow(2).sum()) for g in groups]

    def steps_on_host(self, group):
        return False

    def acquire(self, group):
        group.grad = self.landing[group.index]
        RecordingTier.events.append(("acquire", group.name))

    def release(self, group):
        RecordingTier.events.append(("release", group.name))

    def end_window(self, group):
        group.grad = None

    def read_master(self, group):
        return group.master


class ThirdPartyPlugin:
    @hookimpl
    def zkernel_register_optimizers(self, registry):
        registry.add("sign_sgd", SignSGD, description="sign SGD (test)")

    @hookimpl
    def zkernel_register_offload_tiers(self, registry):
        registry.add("recording", RecordingTier, description="records step traffic (test)")


def test_plugin_in_code_supplies_optimizer_and_tier():
    RecordingTier.events.clear()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    before = model.weight.detach().clone()
    engine = zkernel.initialize(
        model,
        {"optimizer": {"name": "sign_sgd", "lr": 0.125}, "offload": {"optimizer": "recording"}},
        plugins=[ThirdPartyPlugin()],
    )
    x = torch.randn(5, 4)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    optimizer = engine.plugin_manager.get_plugin("optimizer:sign_sgd")
    assert optimizer.calls == len(engine.trainable_groups) == 1
    # sign SGD moves every weight by exactly lr
    assert torch.allclose((model.weight.detach() - before).abs(), torch.full_like(before, 0.125))
    assert RecordingTier.events == [
        ("adopt", "bucket0"), ("land", "bucket0", True), ("acquire", "bucket0"), ("release", "bucket0")
    ]
    # an installed but unselected component never joins the run
    names = [n for n, _ in engine.plugin_manager.list_name_plugin()]
    assert "optimizer:adamw" not in names and "optimizer:sign_sgd" in names


ENTRY_POINT_PLUGIN = textwrap.dedent(
    """
    import torch
    from zkernel.spec import hookimpl

    class HalfStep:
        def __init__(self, context):
            pass

        @hookimpl
        def zkernel_step_optimizer(self, group, options):
            group.master.sub_(group.grad * options.grad_scale * 0.5)
            return True

    @hookimpl
    def zkernel_register_optimizers(registry):
        registry.add("half_step", HalfStep, description="x -= g/2 (entry-point test)")
    """
)


@pytest.fixture
def entry_point_package(tmp_path, monkeypatch):
    """A tiny installed distribution with an entry point in group ``zkernel``."""
    (tmp_path / "zk_thirdparty.py").write_text(ENTRY_POINT_PLUGIN)
    info = tmp_path / "zk_thirdparty-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zk-thirdparty\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[zkernel]\nhalf_step = zk_thirdparty\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    sys.modules.pop("zk_thirdparty", None)


def test_entry_point_plugin_is_selectable_by_name(entry_point_package):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    engine = zkernel.initialize(model, {"optimizer": {"name": "half_step"}})
    loss = engine(torch.ones(1, 2)).sum()  # d loss / d w = 1
    engine.backward(loss)
    engine.step()
    assert torch.equal(model.weight.detach(), torch.full((1, 2), 0.5))
    rows = {(c.name, s.origin, s.distribution) for c, s in list_components(get_plugin_manager())}
    assert ("half_step", "entry point", "zk-thirdparty") in rows


def test_autoload_switch_skips_third_party_entry_points(entry_point_package, monkeypatch):
    monkeypatch.setenv("ZKERNEL_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = collect_components(get_plugin_manager())
    assert "half_step" not in registry.names(Family.OPTIMIZER)
    assert "adamw" in registry.names(Family.OPTIMIZER)  # builtins still load


def test_blocked_plugin_is_not_registered():
    registry = collect_components(get_plugin_manager(config=zkernel.Config(blocked_plugins=("optimizer_cpu_adam",))))
    assert "cpu_adam" not in registry.names(Family.OPTIMIZER)


def test_builtins_come_through_entry_points():
    installed = get_plugin_manager()
    for name in ("partitioner_none", "partitioner_zero3", "optimizer_adamw", "tier_device"):
        assert installed.sources[name].origin == "entry point"
        assert installed.sources[name].distribution == "zkernel"


def test_invalid_hookimpl_is_rejected():
    class Misspelled:
        @hookimpl
        def zkernel_step_optimiser(self, group, options):
            return True

    with pytest.raises(pluggy.PluginValidationError):
        get_plugin_manager([Misspelled()])

    class WrongArgs:
        @hookimpl
        def zkernel_step_optimizer(self, group, options, extra):
            return True

    with pytest.raises(pluggy.PluginValidationError):
        get_plugin_manager([WrongArgs()])


def test_duplicate_component_name_is_an_error():
    class Clash:
        @hookimpl
        def zkernel_register_optimizers(self, registry):
            registry.add("adamw", SignSGD)

    with pytest.raises(ValueError, match="offered twice"):
        collect_components(get_plugin_manager([Clash()]))


def test_hook_tracing_logs_through_structlog(zkernel_debug_logs):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        engine = zkernel.initialize(torch.nn.Linear(2, 2), {"trace_hooks": True})
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
    traced = [e for e in logs if e["event"] == "zkernel.hook.trace"]
    assert any("zkernel_step_optimizer" in e["msg"] for e in traced)
