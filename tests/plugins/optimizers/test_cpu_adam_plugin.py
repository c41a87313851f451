"""The ``cpu_adam`` optimizer plugin, called through the hook on hand-built groups."""

from __future__ import annotations

import pytest
import torch

from zkernel.spec.config import Config, ConfigError
from zkernel.spec.options import build_options
from zkernel.platform.distributed import DistInfo
from zkernel.spec.groups import ParamGroup, StepOptions
from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager, new_plugin_manager
from zkernel.spec.registry import Family
from zkernel.spec.runtime import RuntimeContext
from zkernel_plugins.optimizers import adamw as adamw_plugin
from zkernel_plugins.optimizers import cpu_adam

N = 10_001


def _context(**options) -> RuntimeContext:
    return RuntimeContext(
        config=Config(),
        dist=DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None),
        compute_dtype=torch.bfloat16,
        options=cpu_adam.CpuAdamOptions(**options),
    )


def _group(master: torch.Tensor, grad: torch.Tensor, copy_out: torch.Tensor | None = None) -> ParamGroup:
    """One parameter's group (a step count per parameter)."""
    return ParamGroup(index=0, name="g0", params=(torch.nn.Parameter(master.clone()),), param_names=("w",),
                      requires_grad=True, master=master, grad=grad, copy_out=copy_out)


def _runtime_manager(plugin):
    pm = new_plugin_manager()
    pm.register(plugin, name="optimizer")
    pm.check_pending()
    return pm


def test_registered_under_its_entry_point_with_validated_options():
    registry = collect_components(get_plugin_manager(autoload=False))
    component = registry.get(Family.OPTIMIZER, "cpu_adam")
    assert component is not None and component.factory is cpu_adam.CpuAdam
    opts = build_options("optimizer", component.options_cls, {"threads": 2, "decoupled_weight_decay": False})
    assert opts == cpu_adam.CpuAdamOptions(threads=2, decoupled_weight_decay=False)
    with pytest.raises(ConfigError, match=r"optimizer.threads 0 is not valid; valid: an integer >= 1, or null"):
        build_options("optimizer", component.options_cls, {"threads": 0})
    with pytest.raises(ConfigError, match="unknown config key optimizer.adamw_mode; valid: decoupled"):
        build_options("optimizer", component.options_cls, {"adamw_mode": True})


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_offload_step_matches_torch_and_rounds_copy_out(decoupled):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(N, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    torch_opt = cls([ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    group = _group(p0.clone(), torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16))
    pm = _runtime_manager(cpu_adam.CpuAdam(_context(threads=2, decoupled_weight_decay=decoupled)))
    for step in range(1, 21):
        group.grad.copy_(torch.randn(N, generator=gen) * 512)
        grad_before = group.grad.clone()
        options = StepOptions(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                              grad_scale=1 / 512 * 0.7)
        assert pm.hook.zkernel_step_optimizer(group=group, options=options) is True
        ref.grad = group.grad.float() * options.grad_scale
        torch_opt.step()
        assert torch.equal(group.grad, grad_before), "the gradient is read, not scaled in place"
        assert torch.equal(group.copy_out, group.master.to(torch.bfloat16))
    state = group.optim_state
    assert state["step"].item() == 20 and state["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(group.master, ref.detach(), rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(state["exp_avg_sq"], torch_opt.state[ref]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_resumes_state_written_by_the_adamw_optimizer():
    """Same state keys and types as ``adamw``: a checkpoint of one continues with the other."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(N, generator=gen)
    grads = [torch.randn(N, generator=gen) for _ in range(10)]
    ref = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, foreach=False)
    for g in grads:
        ref.grad = g.clone()
        torch_opt.step()
    group = _group(p0.clone(), torch.empty(N))
    options = StepOptions(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    torch_plugin = adamw_plugin.TorchAdamW(_context())
    torch_plugin.options = adamw_plugin.AdamWOptions(implementation="for_loop")
    ours = cpu_adam.CpuAdam(_context())
    for i, g in enumerate(grads):
        group.grad.copy_(g)
        (torch_plugin if i < 5 else ours).zkernel_step_optimizer(group=group, options=options)
    torch.testing.assert_close(group.master, ref.detach(), rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_master_off_cpu_is_a_clear_error():
    group = _group(torch.empty(8, device="meta"), torch.empty(8, device="meta"))
    options = StepOptions(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    # The message names what is wrong (where the shard lives) and the valid alternative.
    with pytest.raises(RuntimeError, match=r'cpu_adam steps master shards on the CPU.*keeps its master shard on meta.*offload.optimizer = "cpu"'):
        cpu_adam.CpuAdam(_context()).zkernel_step_optimizer(group=group, options=options)


def test_fp16_copy_out_and_fp32_grads():
    gen = torch.Generator().manual_seed(2)
    group = _group(torch.randn(N, generator=gen), torch.randn(N, generator=gen), torch.empty(N, dtype=torch.float16))
    options = StepOptions(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_scale=0.5)
    before = group.master.clone()
    cpu_adam.CpuAdam(_context()).zkernel_step_optimizer(group=group, options=options)
    assert not torch.equal(group.master, before)
    assert torch.equal(group.copy_out, group.master.to(torch.float16))
