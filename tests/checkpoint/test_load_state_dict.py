"""`Engine.load_state_dict`: a plain model's weights written into a live engine, as FSDP's
``set_model_state_dict`` (see [Note: loading weights into a live engine] in `zkernel.checkpoint.state_dict`)."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import VOCAB, TrickyNet, batches, reference_losses

STEPS, ACCUM, MICRO, SEED = 3, 2, 3, 5
LR, WD, CLIP = 2e-2, 0.1, 0.5
FROZEN = [name for name, p in TrickyNet().named_parameters() if not p.requires_grad]


def _config(partitioner: str, **extra) -> dict:
    cfg = {
        "partitioner": partitioner,
        "precision": "fp32",
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"lr": LR, "weight_decay": WD},
        "partitioner_options": {"persistence_threshold": 0} if partitioner == "zero3" else {"bucket_size": 300},
    }
    cfg.update(extra)
    return cfg


CONFIGS = {
    "none": _config("none"),
    "zero2": _config("zero2"),
    "zero3": _config("zero3"),
    "zero3 params and optimizer on cpu": _config(
        "zero3", offload={"optimizer": "cpu", "params": "cpu"}, optimizer={"name": "cpu_adam", "lr": LR, "weight_decay": WD}
    ),
    "zero3 tiled": _config("zero3", tiling={"modules": ["block.0", "block.2", "frozen_proj"], "tiles": 3}),
    "zero3 built on meta": _config("zero3"),  # the root's gain and shift left unset until the load
}


def _weights() -> tuple[dict, TrickyNet]:
    """Another model's values (the frozen weight and the buffer changed too), as a plain state dict."""
    torch.manual_seed(SEED)
    model = TrickyNet()
    with torch.no_grad():
        model.frozen_proj.weight.mul_(-1.5)
        model.shift.add_(0.25)
    return {k: v.clone() for k, v in model.state_dict().items()}, model


def _job(tasks):
    from tests.support.checkpoint_scenarios import job

    return job(tasks)


@pytest.fixture(scope="module", params=[False, True], ids=["every rank's dict", "broadcast from rank 0"])
def loaded(request):
    weights, _ = _weights()
    tasks = [
        ("load_weights", (cfg, weights, STEPS, ACCUM, MICRO, SEED, request.param, name.endswith("on meta")))
        for name, cfg in CONFIGS.items()
    ]
    return weights, run_ranks(2, _job, tasks)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=list(CONFIGS))
def test_loaded_weights_are_the_state_dict_and_train_as_torch_from_them(loaded, index):
    weights, results = loaded
    _, model = _weights()
    data = batches(SEED + 1, STEPS, ACCUM, 2, MICRO)
    expected = reference_losses(model, data, LR, WD, CLIP)
    keys = list(weights)
    for rank in range(2):
        got = results[rank][index]
        # Two halves with strict=False: each names the other half's keys as missing, nothing unexpected.
        assert got["first"] == (sorted(keys[1::2]), []) and got["second"] == (sorted(keys[::2]), [])
        assert got["loaded"].keys() == weights.keys()
        for key, value in weights.items():
            assert torch.equal(got["loaded"][key], value), key
        if rank == 0:
            assert got["rank0_only"].keys() == weights.keys()
            assert all(torch.equal(got["rank0_only"][k], v) for k, v in weights.items())
            # exclude_frozen_parameters: the frozen weight (tiled, in one config) left out, buffers kept
            assert got["trainable_only"].keys() == weights.keys() - set(FROZEN)
            assert all(torch.equal(v, weights[k]) for k, v in got["trainable_only"].items())
        else:
            assert got["rank0_only"] == got["trainable_only"] == {}
        for a, b in zip(got["losses"], expected, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], expected)
        if list(CONFIGS)[index].endswith("on meta"):  # after the first half, the second's keys were unset
            between = got["between"]  # the persistent buffer waited too
            # The layers took their own reset_parameters() before the init_fn, which writes nothing; the
            # root, which has none, left its gain and shift unset.
            assert between and "`shift`" in between and "`gain`" not in between and "`block.0.weight`" not in between
        else:
            assert got["between"] is None


def test_a_bad_state_dict_raises_on_every_rank_and_changes_nothing(loaded):
    _, results = loaded
    for rank in range(2):
        for got in results[rank]:
            shape, unexpected, missing = got["errors"]
            assert shape and "block.0.weight: shape (37, 12) given, (37, 13) in the model" in shape, shape
            assert unexpected and "unexpected keys ['blocks.9.weight']" in unexpected, unexpected
            assert missing and "missing keys ['gain']" in missing, missing
            assert all("changed nothing" in e for e in got["errors"])
            assert got["unchanged"]


def test_weights_into_a_model_built_on_the_meta_device():
    """Pretrained weights into a model zero3 materialised from the meta device with zeros (no random
    initialisation: every value comes from the state dict)."""
    weights, model = _weights()
    with torch.device("meta"):
        empty = TrickyNet()

    def zeros(module: torch.nn.Module) -> None:
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            torch.nn.init.zeros_(tensor)

    engine = zkernel.initialize(empty, _config("zero3"), init_fn=zeros)
    assert tuple(engine.load_state_dict(weights)) == ([], [])
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
    targets = (tokens * 7 + 3) % VOCAB
    with torch.no_grad():
        assert abs(engine(tokens, targets).item() - model(tokens, targets).item()) <= 1e-6
    engine.close()


@pytest.mark.usefixtures("zkernel_debug_logs")
def test_a_non_strict_load_that_matches_no_key_warns():
    """A wrapper's prefix (PEFT's ``base_model.model.``) makes every key unexpected: nothing is written,
    as torch's ``load_state_dict(strict=False)``, and a warning says so instead of silence."""
    weights, _ = _weights()
    engine = zkernel.initialize(TrickyNet(), _config("zero3"))
    before = engine.state_dict()
    prefixed = {"base_model.model." + key: value for key, value in weights.items()}
    with capture_logs() as logs:
        missing, unexpected = engine.load_state_dict(prefixed, strict=False)
    assert unexpected == list(prefixed) and missing == list(weights)
    (warning,) = [e for e in logs if e["event"] == "zkernel.load_state_dict.no_key_matched"]
    assert warning["given"] == len(prefixed) and warning["given_keys"] == list(prefixed)[:3]
    assert warning["model_keys"] == list(weights)[:3] and warning["log_level"] == "warning"
    assert all(torch.equal(value, before[key]) for key, value in engine.state_dict().items())
    # Some keys matched: the returned lists tell the rest, as torch's do, and nothing is logged.
    with capture_logs() as logs:
        missing, unexpected = engine.load_state_dict({**prefixed, "gain": weights["gain"]}, strict=False)
    assert len(unexpected) == len(prefixed) and "gain" not in missing
    assert not [e for e in logs if e["event"] == "zkernel.load_state_dict.no_key_matched"]
    engine.close()
