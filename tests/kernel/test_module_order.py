"""ZeRO-3 follows the model: evaluation passes, data-dependent branches, exceptions, diverging ranks."""

from __future__ import annotations

from tests.support.paths import REPO
import os
import subprocess
import sys
import time

import pytest

from tests.support.branch_scenarios import aliased_outputs, deferred_statements, deferred_statements_then_close, diverge, reference_branching, train_branching
from tests.support.harness import _free_port, gpus_hidden_if_short, run_ranks

STEPS, LR = 6, 2e-2


def _config(params: str = "none", optimizer: str = "none", **extra) -> dict:
    cfg = {
        "partitioner": "zero3",
        "optimizer": {"name": "cpu_adam" if optimizer != "none" else "adamw", "lr": LR},
        "partitioner_options": {"persistence_threshold": 0},
        "prefetch_bytes": 4096,
        "offload": {"optimizer": optimizer, "params": params},
    }
    cfg.update(extra)
    return cfg


def _check(losses, expected, label):
    for i, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{label} step {i}: {a} vs {b}"


CASES = [("none", "none", False), ("none", "none", True), ("cpu", "none", False), ("cpu", "cpu", False)]


@pytest.mark.parametrize(("params", "optimizer", "direct"), CASES)
def test_branches_eval_pass_and_a_failing_forward_match_torch(params, optimizer, direct):
    """``direct``: every call is ``engine.module(...)``, as Hugging Face's generate calls the model."""
    result = train_branching(_config(params, optimizer), STEPS, eval_first=True, fail_at=2, direct=direct)
    _check(result["losses"], reference_branching(STEPS, 1, LR), f"params {params} optimizer {optimizer} direct {direct}")
    # Nothing stays gathered between steps: not a unit prefetched for the other branch, not one
    # prefetched in backward and never used (the frozen unit), not one the failed forward held.
    assert result["leftovers"] == [0] * (STEPS + 1)
    assert result["retraces"] >= STEPS - 1, "the order changes every step and the trace follows it"


def test_branches_on_two_ranks_match_torch():
    results = run_ranks(2, train_branching, _config("cpu", "cpu"), STEPS, True, None)
    for r in results:
        _check(r["losses"], reference_branching(STEPS, 2, LR), "2 ranks")


def test_units_whose_outputs_alias_their_parameters_stay_whole_while_the_output_is_read():
    """[Note: outputs that alias a parameter]: a unit returning a view of its parameter (Perceiver's
    latents) or the parameter's own memory was released after its forward, and the next unit read freed
    memory (garbage or a crash, without autograd). Eval passes and training on two ranks match torch."""
    config = {**_config(), "optimizer": {"name": "adamw", "lr": LR, "weight_decay": 0.0}, "precision": "fp32"}
    for result in run_ranks(2, aliased_outputs, config, 3):
        tolerance = 1e-5 if result["device"] == "cpu" else 1e-4  # the engine's GPU kernels against torch on the CPU
        for kind in ("eval", "train"):
            for i, (a, b) in enumerate(zip(result[kind], result[f"{kind}_plain"], strict=True)):
                assert abs(a - b) <= tolerance * abs(b), f"{kind} {i}: {a} vs {b}"


def test_ranks_that_run_different_modules_stop_with_an_error_naming_them():
    start = time.monotonic()
    # A unit of the same size (the gathers would "succeed" with the wrong values) and one of
    # another size (the collectives would mismatch): either way every rank stops at once.
    for branch, module in (("right", "right"), ("wide", "wide.0")):
        errors = run_ranks(2, diverge, _config(collective_timeout=20.0), branch, timeout=120)
        for rank, text in enumerate(errors):
            assert "micro-step 1" in text, (branch, rank, text)
            # Rank 0's 'left' was prefetched already; its next own collective is what it names.
            assert "rank 0 was about to" in text, text
            assert f"rank 1 was about to gather for forward '{module}'" in text, text
    assert time.monotonic() - start < 60


TRANSPORTS = ["shared", "ring"]


def _deferred_runs() -> dict:
    """The deferred path check's runs for every transport in one pair of processes (one spawn, not
    six): the NCCL form (statements in host shared memory or on a device ring, compared by a
    watchdog thread), over gloo. Each run opens and closes checks of its own."""
    quiet = deferred_statements(1100, None, TRANSPORTS)  # past one turn of the ring
    said = deferred_statements(1100, 1034, TRANSPORTS)
    return {
        transport: {"quiet": quiet[transport], "said": said[transport], "closed": deferred_statements_then_close(40, transport)}
        for transport in TRANSPORTS
    }


@pytest.fixture(scope="module")
def deferred_runs() -> list[dict]:
    return run_ranks(2, _deferred_runs, timeout=120)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deferred_path_check_names_the_divergence_and_tolerates_agreement(deferred_runs, transport):
    runs = [by_transport[transport] for by_transport in deferred_runs]
    assert [r["quiet"] for r in runs] == ["no error", "no error"]
    for text in [r["said"] for r in runs]:
        assert "micro-step 103" in text, text
        assert "rank 0 was about to gather for forward 'layers.0'" in text, text
        assert "rank 1 was about to gather for forward 'layers.2'" in text, text

    # Diverged into units of equal sizes and ended before the watchdog looked: close still says so.
    for text in [r["closed"] for r in runs]:
        assert "micro-step 7: rank 0 was about to gather for forward 'layers.0', rank 1 was about to gather for forward 'layers.2'" in text, text


def test_deferred_path_check_reports_while_a_thread_holds_the_interpreter_lock():
    """A rank hung in a collective may hold the lock; the native watcher then reports and ends it
    (the watcher reads rows the same way whichever transport wrote them: here, shared memory)."""
    code = "import sys; from tests.support.branch_scenarios import deferred_statements_lock_held as f; print(f(12, 'shared'))"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
         "--no-python", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, cwd=str(REPO),
        env=gpus_hidden_if_short(2),
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "no error" not in proc.stdout
    assert "written by the native watchdog" in proc.stderr, proc.stderr[-3000:]
    expected = ("ranks took different module paths in micro-step 5: rank 0 was about to gather for forward "
                "'layers.0', rank 1 was about to gather for forward 'layers.2'")
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 25  # not the 30 s the lock was held


def test_prefetcher_starts_each_gather_once_per_pass():
    """A look-ahead spanning many units does not revisit the gathers it already started
    (walking them again cost a hook call per unit ahead, per unit: quadratic in the units)."""
    import torch
    from torch import nn

    import zkernel
    from zkernel.spec.hookspecs import hookimpl

    class Counter:
        def __init__(self) -> None:
            self.calls = 0

        @hookimpl
        def zkernel_prefetch_params(self, group, phase):
            self.calls += 1

    layers = 24
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(layers)))
    engine = zkernel.initialize(model, _config(prefetch_bytes=2**30))  # every unit fits the look-ahead
    counter = Counter()
    x = torch.randn(4, 16)
    for step in range(3):
        if step == 2:
            engine.plugin_manager.register(counter)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    # Forward prefetches every unit after the first once; backward finds them released and does the same.
    assert counter.calls <= 2 * layers, counter.calls
    engine.close()


def test_lookahead_hands_each_unit_to_each_stage_once_per_pass_within_its_budget():
    """The prefetch stages' windows ([Note: lookahead windows]): each stage gets the units within its
    bytes after the current one and beyond the nearer stage's, each once per pass however large the
    window (walking it anew before every unit was quadratic), again on request, and anew in a new pass."""
    from types import SimpleNamespace

    from zkernel.kernel.lookahead import Lookahead, Stage

    sizes = [10, 10, 30, 10, 10, 10, 40, 10]
    order = [SimpleNamespace(index=i, nbytes=n) for i, n in enumerate(sizes)]
    lookahead = Lookahead(lambda g: g.nbytes)
    handed = {stage: [] for stage in Stage}

    def take(position, budgets):
        ranges = lookahead.take(order, position, budgets)
        for stage, indices in zip(Stage, ranges):
            handed[stage].extend(indices)
        return [list(r) for r in ranges]

    # After unit 0: gathers for units 1-2 (bytes 0 and 10 ahead are under 20), uploads while under 50
    # (unit 3; unit 4 starts at 50), reads while under 70 (units 4-5).
    assert take(0, (20, 50, 70)) == [[1, 2], [3], [4, 5]]
    # After unit 1 the gather window is unit 2 alone (30 bytes), handed already; the upload window
    # grew by unit 4, the read window by unit 6. After unit 2 units 3-4 are gathered, 5-6 uploaded.
    assert take(1, (20, 50, 70)) == [[], [4], [6]]
    assert take(2, (20, 50, 70)) == [[3, 4], [5, 6], []]
    for position in range(2, len(order)):
        take(position, (20, 50, 70))
    assert handed[Stage.GATHER] == list(range(1, len(order)))  # each unit once, in order
    assert len(handed[Stage.DEVICE]) == len(set(handed[Stage.DEVICE]))
    assert len(handed[Stage.HOST]) == len(set(handed[Stage.HOST]))

    # A window over the whole order: each unit once, the total work linear in the units.
    lookahead.restart()
    everything = [take(p, (10**9, 10**9, 10**9))[0] for p in range(len(order))]
    assert everything[0] == list(range(1, len(order))) and not any(everything[1:])

    # A unit the stage could not take is handed again on its next call; a new pass starts over.
    lookahead.restart()
    assert take(0, (20, 20, 20))[0] == [1, 2]
    lookahead.again(Stage.GATHER, 2)
    assert take(1, (20, 20, 20))[0] == [2]
    lookahead.restart()
    assert take(0, (20, 20, 20))[0] == [1, 2]
    assert take(len(order) - 1, (20, 20, 20)) == [[], [], []]
    assert take(0, (0, 0, 0)) == [[], [], []]  # no budget, no look-ahead

    # A unit that runs twice: its second occurrence is known, so the scheduler can ask for it again.
    twice = [order[0], order[1], order[0]]
    lookahead.take(twice, 0, (100, 100, 100))
    assert [lookahead.repeats(i) for i in range(3)] == [False, False, True]


def test_a_weight_read_outside_its_module_is_fetched_by_its_trap_and_whole_weights_cost_nothing():
    """A weight read outside its module (the tied head) is fetched by its released parameter's trap
    ([Note: fetch on first read]), also under a mode the user enters inside the forward; no
    operation on a whole parameter calls into Python (the first step's head read is the only one),
    and outside the engine's forward and backward the trap raises."""
    import pytest
    import torch
    from torch import nn
    from torch.overrides import TorchFunctionMode

    import zkernel
    from zkernel.params import released

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.blocks = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))

        def forward(self, idx):
            return nn.functional.linear(self.blocks(self.embed(idx)), self.embed.weight)

    calls = {"trap": 0, "user": 0}

    class UserMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls["user"] += 1
            return func(*args, **(kwargs or {}))

    class Wrapped(Tied):
        def forward(self, idx):
            with UserMode():
                return super().forward(idx)

    trap = released._ReleasedMixin.__dict__["__torch_function__"]

    def counting(cls, func, types, args=(), kwargs=None):
        calls["trap"] += 1
        return trap.__func__(cls, func, types, args, kwargs)

    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    losses = {}
    for cls in (Tied, Wrapped, "torch"):
        torch.manual_seed(0)
        model = (Tied if cls == "torch" else cls)()
        if cls == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # zkernel's default
            run = []
            for _ in range(3):
                loss = model(idx).logsumexp(-1).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                run.append(loss.item())
            losses[cls] = run
            continue
        engine = zkernel.initialize(model, _config())
        run = []
        calls["trap"] = 0
        released._ReleasedMixin.__torch_function__ = classmethod(counting)
        try:
            for _ in range(3):
                loss = engine(idx).logsumexp(-1).mean()
                engine.backward(loss)
                engine.step()
                run.append(loss.item())
        finally:
            released._ReleasedMixin.__torch_function__ = trap
        assert engine.scheduler.external == {g.index for g in engine.groups if g.name == "embed"}
        # Step 1: F.linear on the released embedding weight, fetched and run again; the embedding
        # is then kept whole in forward, and the six Linear units' ops never reach the trap.
        assert calls["trap"] == 1, calls
        with pytest.raises(released.ReleasedParameterError, match="embed.weight"):
            model.embed.weight.sum()  # released between steps, outside the engine: not fetched
        engine.close()
        losses[cls.__name__] = run
    assert calls["user"] > 0  # the user's mode ran above the trap
    _check(losses["Tied"], losses["torch"], "tied head")
    _check(losses["Wrapped"], losses["torch"], "tied head under a user's mode")


def _embed_blocks_net():
    """A root owning a tied embedding and a norm, over three Linear blocks (units = "blocks")."""
    import torch
    from torch import nn

    class EmbedBlocksNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(40, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.norm = nn.LayerNorm(16)

        def forward(self, idx):
            h = self.embed(idx)
            for block in self.blocks:
                h = torch.tanh(block(h))
            return nn.functional.linear(self.norm(h), self.embed.weight).logsumexp(-1).mean()

    return EmbedBlocksNet()


def _embed_blocks_runs(**config):
    """The same `_embed_blocks_net` twice: torch's AdamW over one, a zero3 engine (one unit per
    block) over the other, plus ``config``; returns (reference, optimizer, engine)."""
    import torch

    import zkernel

    torch.manual_seed(0)
    reference = _embed_blocks_net()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(0)
    engine = zkernel.initialize(_embed_blocks_net(), {
        "partitioner": "zero3", "partitioner_options": {"units": "blocks", "persistence_threshold": 0},
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01}, **config,
    })
    return reference, opt, engine


def test_root_groups_stay_whole_from_forward_into_backward():
    """The root module's own groups are gathered once per training step, not released at the end
    of forward and gathered again by the first backward hook ([Note: root kept for backward]); an
    evaluation forward, or a forward whose backward never comes, still leaves them released, and
    training matches torch throughout."""
    import torch

    from zkernel.spec.groups import Phase
    from zkernel.spec.hookspecs import hookimpl

    class Gathers:
        def __init__(self) -> None:
            self.root = []

        @hookimpl
        def zkernel_fetch_params(self, group, phase):
            if group.name == "<root>" and not group.gathered:
                self.root.append(phase)

    idx = torch.randint(0, 40, (4, 5), generator=torch.Generator().manual_seed(0))
    reference, opt, engine = _embed_blocks_runs()
    gathers = Gathers()
    engine.plugin_manager.register(gathers)
    root = next(g for g in engine.groups if g.name == "<root>")
    for step in range(4):
        loss = engine(idx)
        assert root.gathered  # kept for the backward
        engine.backward(loss)
        assert not root.gathered
        engine.step()
        expected = reference(idx)
        expected.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), (step, loss.item(), expected.item())
        with torch.no_grad():
            engine(idx)
        assert not root.gathered  # no backward follows an evaluation forward
    assert gathers.root == [Phase.FORWARD, Phase.FORWARD] * 4  # the training forward's and the evaluation's
    engine(idx)  # a forward with autograd, then no backward: the step releases what it kept
    assert root.gathered
    engine.step()
    assert not root.gathered
    engine.close()


def test_first_units_of_the_next_forward_are_gathered_during_the_step():
    """After each optimizer step the units the next training forward starts with (within
    ``prefetch_bytes``) are being gathered already, started as soon as their update was queued
    ([Note: prefetch across the step]); the forward then starts no gather of its own for them, an
    evaluation forward of another batch size in between consumes or drops them, and training
    matches torch throughout."""
    import torch

    from zkernel.spec.groups import Phase
    from zkernel.spec.hookspecs import hookimpl

    class Prefetches:
        def __init__(self) -> None:
            self.where, self.started = "", []

        @hookimpl
        def zkernel_prefetch_params(self, group, phase):
            if phase is Phase.FORWARD:
                self.started.append((self.where, group.name))

    root_bytes = (40 * 16 + 2 * 16) * 4  # the embedding and the final norm: the root's own unit
    idx = torch.randint(0, 40, (4, 5), generator=torch.Generator().manual_seed(0))
    reference, opt, engine = _embed_blocks_runs(prefetch_bytes=root_bytes + 1)  # the root and one block
    prefetches = Prefetches()
    engine.plugin_manager.register(prefetches)
    for step in range(4):
        prefetches.where = ("forward", step)
        loss = engine(idx)
        engine.backward(loss)
        prefetches.where = ("step", step)
        engine.step()
        in_flight = sorted(g.name for g in engine.groups if g.layout.gathering is not None)
        assert in_flight == ["<root>", "blocks.0"], (step, in_flight)
        expected = reference(idx)
        expected.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), (step, loss.item(), expected.item())
        if step == 1:
            prefetches.where = ("evaluation", step)
            with torch.no_grad():
                engine(idx[:3])  # an evaluation forward of another shape takes what the step started
            assert all(g.layout.gathering is None and not g.gathered for g in engine.scheduler.bound), "nothing left gathered"
    # After the first step (which starts them in trace order once it is done) each starts as its
    # update is queued, and the root's gradient lands last, so it steps after the blocks
    # ([Note: the last landing]).
    started = [name for (kind, _), name in prefetches.started if kind == "step"]
    assert started == ["<root>", "blocks.0"] + ["blocks.0", "<root>"] * 3
    # A training forward after a step starts neither gather itself (after the evaluation forward,
    # which took them, the third one does).
    for step in (1, 3):
        assert not [name for where, name in prefetches.started if where == ("forward", step) and name in ("<root>", "blocks.0")]
    assert ("forward", 2) in {where for where, name in prefetches.started if name == "blocks.0"}
    engine.close()


def _backward_gathers(engine, reference, opt, loss_of):
    """Three training steps of ``engine`` and of torch (``reference`` under ``opt``) on the loss
    ``loss_of(model)``, whose losses must match; returns, per step, the engine's backward gather
    events in order: ("prefetch", unit) when the prefetcher starts one, ("wait", unit) when a
    unit's own backward hook finds its gather not started and issues it then."""
    from zkernel.spec.groups import Phase
    from zkernel.spec.hookspecs import hookimpl

    class Gathers:
        def __init__(self) -> None:
            self.events = []

        @hookimpl
        def zkernel_prefetch_params(self, group, phase):
            if phase is Phase.BACKWARD:
                self.events.append(("prefetch", group.name))

        @hookimpl
        def zkernel_fetch_params(self, group, phase):
            if phase is Phase.BACKWARD and not group.gathered and group.layout.gathering is None:
                self.events.append(("wait", group.name))

    gathers = Gathers()
    engine.plugin_manager.register(gathers)
    per_step = []
    for step in range(3):
        gathers.events = []
        loss = loss_of(engine)
        engine.backward(loss)
        engine.step()
        per_step.append(gathers.events)
        expected = loss_of(reference)
        expected.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), (step, loss.item(), expected.item())
    engine.close()
    return per_step


def test_backward_prefetches_in_the_reverse_of_the_order_modules_finished():
    """The backward reaches units in the reverse of the order their forwards finished ([Note:
    backward order]): the root, which owns the embedding and the output head, is reached first
    and the last block right after it, so the root's backward hook prefetches the last block; a
    module with parameters of its own around a child's (one unit per module) is reached before
    that child, which it prefetches. No unit waits for a gather its own hook issues once the
    trace is known, and training matches torch."""
    import torch
    from torch import nn

    import zkernel

    # A root over blocks: the last block's gather starts at the root's backward hook.
    idx = torch.randint(0, 40, (4, 5), generator=torch.Generator().manual_seed(0))
    block_bytes = (16 * 16 + 16) * 4
    reference, opt, engine = _embed_blocks_runs(prefetch_bytes=block_bytes)  # one block ahead

    events = _backward_gathers(engine, reference, opt, lambda model: model(idx))
    assert events[0] == [("wait", "blocks.2"), ("wait", "blocks.1"), ("wait", "blocks.0")]  # no trace yet
    for later in events[1:]:
        assert later == [("prefetch", "blocks.2"), ("prefetch", "blocks.1"), ("prefetch", "blocks.0")], later

    # A module owning a parameter of its own around a child (units = "modules"): it starts before
    # the child and finishes after it, so the backward reaches it first and the child next.
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(16, 16)
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

        def forward(self, x):
            return torch.tanh(self.inner(x)) * self.scale

    def scaled_net():
        return nn.Sequential(nn.Linear(16, 16), Scaled(), nn.Linear(16, 1))

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = scaled_net()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    torch.manual_seed(0)
    config = _config(prefetch_bytes=(16 * 16 + 16) * 4)
    config["optimizer"]["weight_decay"] = 0.01  # torch's AdamW default
    engine = zkernel.initialize(scaled_net(), config)

    events = _backward_gathers(engine, reference, opt, lambda model: model(x).pow(2).mean())
    for later in events[1:]:
        assert ("wait", "1.inner") not in later and ("prefetch", "1.inner") in later, later
        assert not [e for e in later if e[0] == "wait"], later
