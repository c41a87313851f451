"""The ``adamw`` optimizer and the device flag ([Note: a non-finite flag read one step late] in
`zkernel.kernel.found_inf`), called through the hooks on a hand-built group on the CPU, where torch's fused
AdamW takes ``found_inf`` too."""

from __future__ import annotations

import attrs
import pytest
import torch

from zkernel.kernel.plugin_manager import new_plugin_manager
from zkernel.platform.distributed import DistInfo
from zkernel.spec.config import Config
from zkernel.spec.groups import Fragment, ParamGroup, ShardLayout, StepOptions
from zkernel.spec.runtime import RuntimeContext
from zkernel_plugins.optimizers import adamw as adamw_plugin

N = 1_001
OPTIONS = StepOptions(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _manager(implementation: str = "auto"):
    context = RuntimeContext(
        config=Config(),
        dist=DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None),
        compute_dtype=torch.bfloat16,
        options=adamw_plugin.AdamWOptions(implementation=implementation),
    )
    pm = new_plugin_manager()
    pm.register(adamw_plugin.TorchAdamW(context), name="optimizer")
    pm.check_pending()
    return pm


def _group(seed: int) -> ParamGroup:
    """Two parameters in one flat shard, with a bf16 copy-out."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(N, generator=gen)
    params = (torch.nn.Parameter(torch.empty(500)), torch.nn.Parameter(torch.empty(N - 500)))
    return ParamGroup(index=0, name="g0", params=params, param_names=("a", "b"), requires_grad=True, master=master,
                      grad=torch.randn(N, generator=gen), copy_out=torch.zeros(N, dtype=torch.bfloat16))


def _snapshot(group: ParamGroup) -> dict[str, torch.Tensor]:
    return {"master": group.master.clone(), "copy_out": group.copy_out.clone(),
            **{k: v.clone() for k, v in group.optim_state.items()}}


def test_declared_only_for_the_kernels_that_honour_the_flag():
    declared = {impl: _manager(impl).hook.zkernel_declare_optimizer(numel=N, param_count=2).takes_found_inf
                for impl in ("auto", "fused", "foreach", "for_loop")}
    assert declared == {"auto": True, "fused": True, "foreach": False, "for_loop": False}


def test_a_set_flag_changes_nothing_and_uncount_takes_the_count_back():
    pm = _manager()
    group = _group(0)
    pm.hook.zkernel_step_optimizer(group=group, options=OPTIONS)  # one real step first: counts at 1
    before = _snapshot(group)
    group.grad[3] = float("nan")
    flagged = attrs.evolve(OPTIONS, found_inf=torch.ones(()))
    assert pm.hook.zkernel_step_optimizer(group=group, options=flagged) is True
    after = _snapshot(group)
    for name in ("master", "copy_out", "exp_avg", "exp_avg_sq"):
        assert torch.equal(after[name], before[name]), name
    assert after["step"].tolist() == [2.0, 2.0]  # counted on the host side until the flag is read
    assert pm.hook.zkernel_uncount_step(group=group, options=flagged) is True
    assert group.optim_state["step"].tolist() == [1.0, 1.0]

    # The next step is the second, as if the flagged one had never been called.
    group.grad[3] = 0.0
    twin = _group(0)
    pm_twin = _manager()
    pm_twin.hook.zkernel_step_optimizer(group=twin, options=OPTIONS)
    twin.grad.copy_(group.grad)
    pm.hook.zkernel_step_optimizer(group=group, options=attrs.evolve(OPTIONS, found_inf=torch.zeros(())))
    pm_twin.hook.zkernel_step_optimizer(group=twin, options=OPTIONS)
    for name, value in _snapshot(twin).items():
        assert torch.equal(_snapshot(group)[name], value), name


def test_uncount_spares_the_parameters_the_step_skipped():
    """A parameter no rank gave a gradient (``skip_params``) was not counted, so it is not uncounted."""
    pm = _manager()
    group = _group(1)
    group.shard_layout = ShardLayout(numel=N, fragments=(Fragment(0, 0, 500, 0), Fragment(1, 0, N - 500, 500)))
    pm.hook.zkernel_step_optimizer(group=group, options=OPTIONS)
    flagged = attrs.evolve(OPTIONS, found_inf=torch.ones(()), skip_params=frozenset({0}))
    pm.hook.zkernel_step_optimizer(group=group, options=flagged)
    assert group.optim_state["step"].tolist() == [1.0, 2.0]
    pm.hook.zkernel_uncount_step(group=group, options=flagged)
    assert group.optim_state["step"].tolist() == [1.0, 1.0]


def test_a_kernel_that_cannot_honour_the_flag_refuses_it():
    pm = _manager("foreach")
    group = _group(2)
    with pytest.raises(RuntimeError, match="cannot honour"):
        pm.hook.zkernel_step_optimizer(group=group, options=attrs.evolve(OPTIONS, found_inf=torch.zeros(())))
