"""Models compiled with torch.compile train under zero3 as compiled plain torch does (see
[Note: hooks under torch.compile] in `zkernel/compiled.py`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zkernel

from tests.support.harness import run_ranks
from tests.support.models import TrickyNet, batches, reference_losses

STEPS, ACCUM, MICRO, SEED, WORLD = 4, 2, 3, 4321, 2
LR, WD, CLIP = 2e-2, 0.1, 0.5
BACKEND = "aot_eager"


def compiled(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """``how``: "whole" compiles the model (its tied head reads the embedding outside its module,
    in the compiled code); "parts" compiles the block (called twice a forward) and the norm in place.

    Dynamo and AOTAutograd are what meet zkernel's hooks and parameters; ``aot_eager`` runs their
    graphs without Inductor's code generation (minutes of C++ compiling on a CI machine)."""
    if how == "whole":
        return torch.compile(model, backend=BACKEND)
    model.block.compile(backend=BACKEND)
    model.norm.compile(backend=BACKEND)
    return model


def train_compiled(how: str) -> dict:
    torch.manual_seed(SEED)
    model = compiled(TrickyNet(), how)
    config = {
        "partitioner": "zero3",
        "partitioner_options": {"persistence_threshold": 0},
        "precision": "fp32",
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"name": "adamw", "lr": LR, "weight_decay": WD},
    }
    engine = zkernel.initialize(model, config)
    rank = dist.get_rank()
    losses, graphs = [], []
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compile this model afresh: code cached for an earlier one could serve it
    counters.clear()
    for step in batches(SEED + 1, STEPS, ACCUM, WORLD, MICRO):
        total = torch.zeros((), device=engine.device)
        for micro in step:
            loss = engine(*micro[rank])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / ACCUM
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
        graphs.append(counters["stats"]["unique_graphs"])
    engine.close()
    return {"losses": losses, "graphs": graphs}


def train_each(hows: list[str]) -> list[dict]:
    return [train_compiled(how) for how in hows]


def test_compiled_models_train_under_zero3_like_compiled_torch():
    hows = ["whole", "parts"]
    results = run_ranks(WORLD, train_each, hows)  # one pair of processes for both (Dynamo's import is slow)
    for index, how in enumerate(hows):
        torch.manual_seed(SEED)
        expected = reference_losses(
            compiled(TrickyNet(), how), batches(SEED + 1, STEPS, ACCUM, WORLD, MICRO), LR, WD, CLIP
        )
        assert expected[-1] < expected[0]
        for rank, rank_results in enumerate(results):
            result = rank_results[index]
            for i, (a, b) in enumerate(zip(result["losses"], expected)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{how}, rank {rank}, step {i}: zkernel {a!r} vs torch {b!r}"
            # The hooks run between graphs: compiled in the first step, never again.
            assert result["graphs"][0] > 0
            assert result["graphs"][-1] == result["graphs"][0], (how, result["graphs"])


def test_a_module_compiled_in_place_is_one_unit_and_the_estimator_agrees():
    from tests.support.models import sized_units
    from zkernel_plugins.partitioners._flat import module_units

    def units(model, policy):
        return {name: [n for n, _ in named] for name, _, named in module_units(model, policy)}

    model = TrickyNet()
    assert {"block.0", "block.2"} <= set(units(model, "modules"))
    model.block.compile(backend=BACKEND)
    for policy in ("modules", "blocks"):
        found = units(model, policy)
        assert found["block"] == ["block.0.weight", "block.0.bias", "block.2.weight", "block.2.bias"], policy
        assert not any(name.startswith("block.") for name in found), policy
        assert sorted(map(len, found.values())) == sorted(sized_units(model, policy)), policy
    # The root compiled in place is left to the policy: one unit would gather the whole model.
    model.compile(backend=BACKEND)
    assert set(units(model, "modules")) == {"", "embed", "block", "norm", "frozen_proj"}
