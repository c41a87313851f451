"""Activation checkpointing: same training as without it, one gather per unit under zero3, inputs offloaded."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import zkernel
from tests.support.transform_scenarios import Stack, stack_batches, train_stack
from zkernel_plugins.activation.recompute import CheckpointedForward

STEPS, ACCUM, SEED = 4, 2, 7
PARTITIONERS = ("none", "zero1", "zero2", "zero3")


def _config(partitioner: str, modules=(), offload: str = "none", **extra) -> dict:
    cfg = {"partitioner": partitioner, "activation_checkpointing": {"modules": list(modules), "offload": offload}, **extra}
    if partitioner == "zero3":
        cfg["partitioner_options"] = {"persistence_threshold": 0}
    return cfg


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_checkpointing_trains_exactly_like_no_checkpointing(partitioner):
    """Dropout, a tensor keyword, a non-tensor keyword, a tuple holding a parameter, a tied head, accumulation."""
    plain = train_stack(_config(partitioner), STEPS, ACCUM, SEED)
    by_class = train_stack(_config(partitioner, ["Block"]), STEPS, ACCUM, SEED)
    offloaded = train_stack(_config(partitioner, ["blocks.*"], "cpu"), STEPS, ACCUM, SEED)
    assert _close(by_class, plain, 1e-6), (by_class, plain)
    assert _close(offloaded, plain, 1e-6), (offloaded, plain)
    if partitioner == "zero3":  # the reference (the other partitioners are checked against it elsewhere)
        torch_losses = train_stack(None, STEPS, ACCUM, SEED)
        assert _close(plain, torch_losses, 1e-5), (plain, torch_losses)
        assert torch_losses[-1] < torch_losses[0]


class SelfCheckpointingStack(Stack):
    """A model that calls torch.utils.checkpoint itself (as Hugging Face models do), no plugin involved."""

    def forward(self, tokens, targets, mask):
        x = self.embed(tokens)
        gain = torch.tensor(0.5, device=x.device)
        for block in self.blocks:
            x = checkpoint(block, x, (self.shift, gain), mask=mask, scale=0.75, use_reentrant=False)
        logits = torch.nn.functional.linear(x, self.embed.weight)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab).float(), targets.reshape(-1))


def _train_counting_gathers(config: dict, steps: int = 3, model_cls=Stack) -> tuple[int, collections.Counter, list]:
    """Train Stack under zero3; the scheduler's trace length and the all-gathers started in the last backward."""
    torch.manual_seed(SEED)
    model = model_cls()
    engine = zkernel.initialize(model, config)
    partitioner = engine.plugin_manager.get_plugin("partitioner:zero3")
    started: collections.Counter = collections.Counter()
    start_gather = partitioner._start_gather

    def counting(group):
        started[group.name] += 1
        return start_gather(group)

    partitioner._start_gather = counting
    in_backward: collections.Counter = collections.Counter()
    for tokens, targets, mask in (step[0] for step in stack_batches(SEED, steps, 1)):
        loss = engine(tokens, targets, mask)
        started.clear()
        engine.backward(loss)
        in_backward = collections.Counter(started)  # step() starts the next forward's first gathers
        engine.step()
    trace = [g.name for g in engine.scheduler.trace]
    engine.close()
    return len(trace), in_backward, trace


@pytest.mark.parametrize("prefetch_bytes", [0, 1 << 20])
def test_zero3_recompute_gathers_each_unit_once_and_keeps_the_trace(prefetch_bytes):
    base = _config("zero3", prefetch_bytes=prefetch_bytes)
    plain_len, plain_gathers, plain_trace = _train_counting_gathers(base)
    ckpt_len, ckpt_gathers, ckpt_trace = _train_counting_gathers({**base, "activation_checkpointing": {"modules": ["Block"]}})
    units = 2 + 4 * 3  # the root (it holds ``shift``), embed, and norm/up/down of 4 blocks
    assert plain_len == units == len(set(plain_trace))
    assert ckpt_trace == plain_trace, "recomputations must not enter the trace"
    # One gather per unit in backward: for its recomputation and its gradients together.
    assert ckpt_gathers == plain_gathers
    assert max(ckpt_gathers.values()) == 1 and len(ckpt_gathers) >= 4 * 3
    # The same when the model checkpoints itself: the scheduler needs no word from a plugin.
    _, own_gathers, own_trace = _train_counting_gathers(base, model_cls=SelfCheckpointingStack)
    assert own_trace == plain_trace and own_gathers == plain_gathers


def test_offload_keeps_saved_inputs_on_host_and_the_device_one_block_deep():
    depth = 6

    def run(offload: str):
        torch.manual_seed(SEED)
        model = Stack(depth=depth)
        engine = zkernel.initialize(model, _config("zero3", ["Block"], offload))
        plugin = engine.plugin_manager.get_plugin("activation checkpointing:recompute")
        offloader = plugin.offloader
        if offloader is not None:
            offloader.record_events = True
        in_backward = []

        def probe(block):
            if torch._C._current_graph_task_id() != -1:  # a recomputation
                alive = sum(r() is not None for b in model.blocks for r in b.inputs)
                in_backward.append((alive, offloader.stats.resident if offloader else None))

        for block in model.blocks:
            block.probe = probe
        tokens, targets, mask = stack_batches(SEED, 1, 1)[0][0]
        loss = engine(tokens, targets, mask)
        after_forward = sum(r() is not None for b in model.blocks for r in b.inputs)
        engine.backward(loss)
        engine.step()
        engine.close()
        return after_forward, in_backward, offloader

    kept, _, _ = run("none")
    assert kept == depth, "plain checkpointing keeps every block's input on the device"

    after_forward, in_backward, offloader = run("cpu")
    stats = offloader.stats
    # Each block's input goes to the host; the mask keyword and the gain inside the tuple, which every
    # block receives, only once (the first block's); the parameter in the tuple stays.
    assert stats.offloaded_tensors == depth + 2 and stats.kept_tensors >= depth + 2 * (depth - 1)
    assert after_forward == 0, "no block input is left on the compute device after forward"
    assert len(in_backward) == depth
    for alive, resident in in_backward:
        assert alive <= 1, in_backward  # the input being recomputed ...
        assert resident <= 2 + 2, in_backward  # ... plus the next block's, prefetched (+ the first block's mask, gain)
    assert stats.max_resident <= 2 + 2 and stats.resident == 0
    # Prefetched in the traced order: block k-1's inputs start coming back before block k's are used.
    events = stats.events
    for seq in range(depth - 1):
        assert events.index(("prefetch", seq)) < events.index(("restore", seq + 1)), events


def test_close_gives_modules_their_forward_back_and_config_errors_are_clear():
    model = Stack()
    engine = zkernel.initialize(model, _config("none", ["Block"], "cpu"))
    assert all(isinstance(b.__dict__.get("forward"), CheckpointedForward) for b in model.blocks)
    engine.close()
    assert all("forward" not in b.__dict__ for b in model.blocks)
    cases = [
        ({"activation_checkpointing": {"modules": ["Blok"]}}, ["activation_checkpointing.modules 'Blok' matches no module", "Block", "Stack"]),
        ({"activation_checkpointing": {"modules": ["Block"], "offload": "nvme"}}, ["activation_checkpointing.offload 'nvme' is not valid; valid: none, cpu"]),
        ({"activation_checkpointing": {"modules": "Block"}}, ["activation_checkpointing.modules must be a list of strings"]),
        ({"activation_checkpointing": {"prefetch": -1}}, ["activation_checkpointing", "prefetch"]),
        ({"activation_checkpointing": {"prefech": 2}}, ["unknown config key activation_checkpointing.prefech", "modules, offload", "prefetch, pin_memory"]),
        ({"activation_checkpointing": {"name": "selective"}}, ["activation_checkpointing.name 'selective' is not installed; installed: recompute"]),
    ]
    for raw, fragments in cases:
        with pytest.raises(zkernel.ConfigError) as info:
            zkernel.initialize(Stack(), raw)
        for fragment in fragments:
            assert fragment in str(info.value), (raw, str(info.value))


class _CachingBlock(torch.nn.Module):
    """Grows a cache at every call, as a key/value cache does: its recomputation differs from its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.cache: list[torch.Tensor] = []

    def forward(self, x):
        for past in self.cache:
            x = x * torch.sigmoid(past)
        h = self.proj(x)
        self.cache.append(h.detach())
        return h


@pytest.mark.parametrize("partitioner", ["zero2", "zero3"])
def test_a_module_that_changes_state_when_recomputed_fails_with_the_cause_and_the_module(partitioner):
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _CachingBlock())
    engine = zkernel.initialize(model, _config(partitioner, ["1"]))
    loss = engine(torch.randn(3, 4)).square().mean()
    with pytest.raises(torch.utils.checkpoint.CheckpointError) as info:
        engine.backward(loss)
    message = str(info.value)
    assert "computed something different when recomputed in backward" in message, message
    assert "use_cache=False" in message and "torch: torch.utils.checkpoint:" in message, message
    if partitioner == "zero3":  # the scheduler saw which module was recomputing
        assert "the last module whose recomputation began: '1.proj', a Linear" in message, message
    engine.close()


@pytest.mark.cuda
def test_cuda_offload_moves_inputs_to_pinned_host_memory_and_saves_device_memory():
    torch.backends.cuda.matmul.allow_tf32 = False
    depth, batch, seq = 8, 64, 256

    def run(offload: str):
        torch.manual_seed(SEED)
        model = Stack(depth=depth)
        engine = zkernel.initialize(model, _config("zero3", ["Block"], offload))
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 23, (batch, seq), generator=g)
        mask = (torch.rand(batch, seq, 40, generator=g) > 0.1).float()
        losses, after_forward = [], []
        for _ in range(3):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = engine(tokens, (tokens * 5 + 2) % 23, mask)
            torch.cuda.synchronize()
            after_forward.append(torch.cuda.memory_allocated() - before)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        offloader = engine.plugin_manager.get_plugin("activation checkpointing:recompute").offloader
        engine.close()
        return losses, max(after_forward), offloader

    kept_losses, kept_bytes, _ = run("none")
    losses, offloaded_bytes, offloader = run("cpu")
    assert _close(losses, kept_losses, 1e-6), (losses, kept_losses)
    assert offloader.stats.pinned_tensors == offloader.stats.offloaded_tensors > 0
    per_block = batch * seq * 12 * 4  # the input x of one block, fp32 (the mask is shared by all blocks)
    assert kept_bytes - offloaded_bytes >= (depth - 2) * per_block, (kept_bytes, offloaded_bytes, per_block)
