"""A DeepSpeed user points zkernel at their JSON: the documented examples map, warn once, and train."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from structlog.testing import capture_logs

import zkernel
from tests.support.harness import run_ranks
from tests.support.models import TrickyNet
from tests.support.scenarios import train
from tests.plugins.partitioners.test_partitioners import ACCUM, CLIP, LR, MICRO, SEED, STEPS, WD, assert_matches, reference
from zkernel.spec.config import Config, ConfigError, config_from_dict
from zkernel.kernel.config_source import load_config

# The mapping reports at info level; capture_logs sees what the `zkernel` logger's level lets through.
pytestmark = pytest.mark.usefixtures("zkernel_debug_logs")

# The zero_optimization blocks as the DeepSpeed documentation shows them: the ZeRO tutorial's
# stage 1 example, the ZeRO-Offload tutorial's stage 2 + CPU example, and the ZeRO-Infinity
# example of the ZeRO tutorial with both offloads on NVMe (`offload_param`/`offload_optimizer`
# blocks shaped as in the config reference's "Parameter/Optimizer offloading" sections).
ZERO1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}
ZERO2_CPU = {
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
}


def zero3_nvme(path: str) -> dict:
    return {
        "zero_optimization": {
            "stage": 3,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5,
            "reduce_bucket_size": 1e7,
            "sub_group_size": 1e9,
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": 4, "fast_init": False},
            "offload_param": {
                "device": "nvme",
                "nvme_path": path,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": 1e8,
                "max_in_cpu": 1e9,
            },
        }
    }


# What a training script adds around the zero_optimization block (the same run as tests/plugins/partitioners/test_partitioners.py).
TRAINING = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": CLIP,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WD}},
}


def mapped(raw):
    with capture_logs() as logs:
        config = zkernel.from_deepspeed_config(raw)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) <= 1, warnings
    return config, (warnings[0] if warnings else None), logs


def test_zero1_example_maps():
    config, warning, logs = mapped(ZERO1)
    assert config == config_from_dict(
        {"partitioner": "zero1", "partitioner_options": {"bucket_size": 500_000_000}, "gradient_clipping": 1.0}
    ), "no gradient_clipping: DeepSpeed's default, 1.0"
    assert warning["ignored"] == [
        "optimizer (absent: DeepSpeed would step the optimizer passed in code; zkernel uses its default AdamW)"
    ]
    assert [e["event"] for e in logs] == ["zkernel.deepspeed.config", "zkernel.deepspeed.unmapped"]


def test_zero2_cpu_offload_example_maps():
    config, warning, _ = mapped({**ZERO2_CPU, **TRAINING})
    assert config == config_from_dict(
        {
            "partitioner": "zero2",
            "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": CLIP,
            "offload": {"optimizer": "cpu", "params": "none"},
            "optimizer": {"name": "cpu_adam", "lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WD},
        }
    )
    assert warning is None, "contiguous_gradients and overlap_comm are built in; nothing else is unmapped"


def test_zero3_nvme_example_maps(tmp_path):
    raw = {**zero3_nvme(str(tmp_path)), **TRAINING, "bf16": {"enabled": True}}
    config, warning, logs = mapped(raw)
    assert config == config_from_dict(
        {
            "partitioner": "zero3",
            "precision": "bf16",
            "partitioner_options": {"persistence_threshold": 100_000},
            "prefetch_bytes": 10_000_000 * 2,  # elements x bf16 bytes
            "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": CLIP,
            "offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": str(tmp_path)},
            "optimizer": {"name": "cpu_adam", "lr": LR, "eps": 1e-8, "weight_decay": WD},
        }
    )
    assert warning["ignored"] == [
        "zero_optimization.offload_optimizer.buffer_count (the tier sizes its own buffers)",
        "zero_optimization.offload_optimizer.fast_init (no equivalent in zkernel)",
        "zero_optimization.offload_param.buffer_count (the tier sizes its own buffers)",
        "zero_optimization.offload_param.buffer_size (the tier sizes its own buffers)",
        "zero_optimization.offload_param.max_in_cpu (the NVMe tier keeps no parameter cache in CPU memory)",
        "zero_optimization.reduce_bucket_size (zero3 reduces each module's gradients at once)",
        "zero_optimization.stage3_max_live_parameters (zero3 releases each module after use)",
        "zero_optimization.stage3_max_reuse_distance (zero3 releases each module after use)",
        "zero_optimization.sub_group_size (no equivalent in zkernel)",
    ]
    (info,) = [e for e in logs if e["event"] == "zkernel.deepspeed.config"]
    assert info["train_micro_batch_size_per_gpu"] == MICRO


def test_hugging_face_auto_values_take_defaults_and_are_named():
    raw = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        # The Hugging Face Trainer's templates (ds_config_zero2.json, ds_config_zero3.json).
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }
    config, warning, _ = mapped(raw)
    assert config == config_from_dict(
        {
            "partitioner": "zero2",
            "initial_loss_scale": 4096.0,
            "loss_scale_window": 500,
            "lr_schedule": {"name": "warmup", "warmup_num_steps": 0},
        }
    ), "auto values fall back to zkernel's defaults; the warm-up's length to the Trainer's (no warm-up)"
    assert warning["auto_defaults"] == [
        "fp16.enabled",
        "bf16.enabled",
        "zero_optimization.reduce_bucket_size",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
    ]
    assert warning["ignored"] == [
        "zero_optimization.allgather_bucket_size (each bucket is all-gathered in one call)",
        "steps_per_print (no equivalent in zkernel)",
        "wall_clock_breakdown (no equivalent in zkernel)",
    ]


@pytest.mark.parametrize(
    ("adam", "decoupled"),
    [
        ({"type": "Adam"}, True),  # DeepSpeed's Adam runs in AdamW mode unless told otherwise
        ({"type": "Adam", "params": {"adam_w_mode": False}}, False),
        ({"type": "adamw", "params": {"adam_w_mode": False}}, True),  # DeepSpeed's AdamW always decouples
    ],
)
def test_adam_weight_decay_mode(adam, decoupled):
    config, _, _ = mapped({"zero_optimization": {"stage": 0}, "optimizer": adam})
    assert config.partitioner == "none" and config.optimizer.name == "adamw"
    assert config.optimizer.options == ({} if decoupled else {"decoupled_weight_decay": False})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale 128 asks for a static loss scale"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage 4 is not valid; valid: 0, 1, 2, 3"),
        ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage '3' is not valid; valid: an integer >= 0"),
        ({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1.5}}, "zero_optimization.reduce_bucket_size 1.5 is not valid"),
        ({"optimizer": {"type": "Lamb", "params": {}}, "fp16": {"enabled": False}}, "optimizer.type 'Lamb' is not valid here; valid: Adam, AdamW"),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "zero_optimization.offload_param.device 'cpu' needs zero_optimization.stage 3",
        ),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}}, "offload_optimizer.device 'disk' is not valid; valid: none, cpu, nvme"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads is true"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads is true"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"}, "offload_param": {"device": "nvme", "nvme_path": "/b"}}},
            "offload_optimizer.nvme_path and offload_param.nvme_path differ",
        ),
        ({"bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad is true"),
        ({"bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas [0.9] is not valid"),
        ({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 0}, "gradient_accumulation_steps 0 is not valid; valid: an integer >= 1"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, "offload.nvme_path is required"),
        ({"bf16": {"enabled": True}, "scheduler": {"type": "CosineLR"}}, "scheduler.type 'CosineLR' is not valid; valid: WarmupLR, WarmupDecayLR"),
        (
            {"bf16": {"enabled": True}, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
            'scheduler.params.total_num_steps is "auto", and WarmupDecayLR has no default for it',
        ),
        ({"bf16": {"enabled": True}, "scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1}}}, "scheduler.params.cycle_min_lr is absent"),
        (
            {"bf16": {"enabled": True}, "scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}},
            "scheduler.params.total_num_steps is not a parameter of WarmupLR; valid: warmup_min_lr, warmup_max_lr",
        ),
        ({"bf16": {"enabled": True}, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}}, "warmup_type 'cos' is not valid; valid: log, linear"),
        ({"bf16": {"enabled": True}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1.5}}}, "warmup_num_steps 1.5 is not valid"),
    ],
)
def test_values_that_cannot_be_honoured_are_errors_naming_the_key(raw, message):
    with pytest.raises(ConfigError) as info:
        zkernel.from_deepspeed_config(raw)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("scheduler", "schedule", "ignored"),
    [
        # WarmupLR's own default peak (0.001) is not [optimizer] lr, which zkernel's warmup would take.
        ({"type": "WarmupLR"}, {"name": "warmup", "warmup_max_lr": 0.001}, []),
        (
            {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 1e3, "warmup_type": "linear", "last_batch_iteration": -1}},
            {"name": "warmup", "warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 1000, "warmup_type": "linear"},
            [],
        ),
        (
            {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000, "warmup_max_lr": 1e-4, "last_batch_iteration": 99}},
            {"name": "warmup_decay", "total_num_steps": 5000, "warmup_max_lr": 1e-4},
            ["scheduler.params.last_batch_iteration=99 (the schedule follows the engine's applied steps, which a checkpoint restores)"],
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}},
            {"name": "warmup_cosine", "total_num_steps": 5000, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01},
            [],
        ),
        (
            {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_first_stair_count": 4, "cycle_momentum": False}},
            {"name": "one_cycle", "cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_momentum": False},
            ["scheduler.params.cycle_first_stair_count (DeepSpeed's OneCycle does not use it either)"],
        ),
        (
            {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-5, "lr_range_test_staircase": True}},
            {"name": "lr_range_test", "lr_range_test_min_lr": 1e-5, "lr_range_test_staircase": True},
            [],
        ),
    ],
)
def test_schedulers_map_to_the_schedule_of_the_same_definition(scheduler, schedule, ignored):
    raw = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}}, "scheduler": scheduler}
    config, warning, _ = mapped(raw)
    assert config == config_from_dict(
        {"precision": "bf16", "optimizer": {"name": "adamw", "lr": 2e-4}, "lr_schedule": schedule, "gradient_clipping": 1.0}
    )
    assert (warning["ignored"] if warning else []) == ignored
    engine = zkernel.initialize(TrickyNet(), config)  # every mapped schedule builds
    assert engine.lr_schedule is not None
    # and sets the first step's rate, DeepSpeed's at position -1: the minimum (0 for the warmups).
    assert engine.lr == schedule.get("cycle_min_lr", schedule.get("lr_range_test_min_lr", 0.0))
    engine.close()


def test_aio_block_size_goes_to_every_nvme_tier(tmp_path):
    aio = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True}
    config, warning, _ = mapped({**zero3_nvme(str(tmp_path)), "optimizer": {"type": "AdamW"}, "aio": aio})
    assert config.offload.optimizer_options == config.offload.params_options == {"aio_block_size": 1048576}
    assert [k for k in warning["ignored"] if k.startswith("aio.")] == [
        "aio.queue_depth (requests in flight at the disk are offload.<role>_options.aio_threads)",
        "aio.thread_count (requests in flight at the disk are offload.<role>_options.aio_threads)",
        "aio.single_submit (no equivalent in zkernel)",
        "aio.overlap_events (no equivalent in zkernel)",
    ]
    _, warning, _ = mapped({**ZERO2_CPU, "optimizer": {"type": "AdamW"}, "aio": {"block_size": 1048576}})
    assert warning["ignored"] == ["aio.block_size (no offload device is nvme)"]
    with pytest.raises(ConfigError, match="aio.block_size 1000 is not valid here; valid: a positive multiple of 4096"):
        zkernel.from_deepspeed_config({**zero3_nvme(str(tmp_path)), "aio": {"block_size": 1000}})


@pytest.mark.parametrize(
    ("fp16", "hysteresis", "consecutive"),
    [
        ({"enabled": True}, 2, False),  # DeepSpeed's default hysteresis where fp16 is on
        ({"enabled": True, "hysteresis": 1}, 1, False),
        ({"enabled": True, "hysteresis": 4, "consecutive_hysteresis": True}, 4, True),
        ({"enabled": False}, 1, False),
    ],
)
def test_loss_scale_hysteresis_is_deepspeeds(fp16, hysteresis, consecutive):
    config, warning, _ = mapped({"fp16": fp16, "optimizer": {"type": "AdamW"}})
    assert (config.loss_scale_hysteresis, config.loss_scale_consecutive_hysteresis) == (hysteresis, consecutive)
    assert (config.min_loss_scale, config.loss_scale_error_at_min) == (1.0, True)  # DeepSpeed's too
    assert warning is None


def test_min_loss_scale_maps_and_is_checked():
    config, warning, _ = mapped({"fp16": {"enabled": True, "min_loss_scale": 0.25}, "optimizer": {"type": "AdamW"}})
    assert config.min_loss_scale == 0.25 and warning is None
    with pytest.raises(ConfigError, match="fp16.min_loss_scale -1 is not valid; valid: a number >= 0"):
        zkernel.from_deepspeed_config({"fp16": {"enabled": True, "min_loss_scale": -1}})
    with pytest.raises(ConfigError, match="initial_loss_scale 16.0 is below min_loss_scale 32"):
        zkernel.from_deepspeed_config({"fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 32}})


def test_cpu_offload_without_pinned_memory_maps_to_the_tier_option():
    raw = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}, "optimizer": {"type": "AdamW"}}
    config, warning, _ = mapped(raw)
    assert config.offload.optimizer == "cpu" and config.offload.optimizer_options == {"pin_memory": False}
    assert warning is None


def test_settings_of_a_disabled_precision_are_listed_not_errors():
    raw = {"fp16": {"enabled": False, "loss_scale": 128}, "bf16": {"enabled": False, "bf16_optimizer_states": True}, "optimizer": {"type": "AdamW"}}
    config, warning, _ = mapped(raw)
    assert config.precision == "fp32"
    assert warning["ignored"] == ["fp16.loss_scale=128 (fp16 is not enabled)", "bf16.bf16_optimizer_states (bf16 is not enabled)"]


def test_initialize_and_load_config_recognise_a_deepspeed_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**ZERO1, **TRAINING}))
    expected = zkernel.from_deepspeed_config(path)
    assert load_config(path) == load_config(str(path)) == load_config(json.loads(path.read_text())) == expected
    assert expected.partitioner == "zero1" and expected.optimizer.lr == LR
    engine = zkernel.initialize(TrickyNet(), str(path))
    assert engine.config == expected
    # A zkernel config is not mistaken for a DeepSpeed one.
    assert load_config({"partitioner": "zero2", "optimizer": {"name": "adamw"}}).partitioner == "zero2"
    # `zkernel config` prints the mapped config, and the warning goes to stderr through the CLI's logging.
    result = subprocess.run(
        [sys.executable, "-m", "zkernel.cli", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert 'partitioner = "zero1"' in result.stdout and "bucket_size = 500000000" in result.stdout
    assert "zkernel.deepspeed.config" in result.stderr


def test_zero1_example_trains_like_torch_on_two_ranks(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**ZERO1, **TRAINING}))
    # The accumulation steps left out, as DeepSpeed derives them: 2 micro-batches of MICRO on 2 ranks.
    derived = {k: v for k, v in TRAINING.items() if k != "gradient_accumulation_steps"}
    (tmp_path / "derived.json").write_text(json.dumps({**ZERO1, **derived, "train_batch_size": MICRO * ACCUM * 2}))
    for config in (path, tmp_path / "derived.json"):
        results = run_ranks(2, train, str(config), STEPS, ACCUM, MICRO, SEED)
        for result in results:
            assert_matches(result["losses"], reference(2), f"DeepSpeed ZeRO-1 example ({config.name}), world 2")


@pytest.mark.parametrize(
    ("world", "sizes", "accumulation"),
    [
        ("2", {"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, 6),
        (None, {"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, 12),
        ("2", {"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 6}, 6),
        ("4", {"train_batch_size": 48}, 1),
        ("4", {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 3),
        ("2", {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 5}, 5),
    ],
)
def test_accumulation_steps_follow_the_batch_sizes_as_in_deepspeed(monkeypatch, world, sizes, accumulation):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    config, _, logs = mapped({**ZERO1, "optimizer": {"type": "AdamW"}, **sizes})
    assert config.gradient_accumulation_steps == accumulation
    (info,) = [e for e in logs if e["event"] == "zkernel.deepspeed.config"]
    assert info["gradient_accumulation_steps"] == accumulation and info["world_size"] == int(world or 1)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
            "train_batch_size 64 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 4 x world size 2",
        ),
        ({"train_batch_size": 50, "train_micro_batch_size_per_gpu": 4}, "train_batch_size 50 != train_micro_batch_size_per_gpu 4"),
        ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}, "gradient_accumulation_steps 1 x world size 2"),
        ({"train_batch_size": 7}, "train_batch_size 7 is not a multiple of gradient_accumulation_steps 1 x world size 2"),
        ({"train_batch_size": 8.5}, "train_batch_size 8.5 is not valid"),
    ],
)
def test_batch_sizes_that_disagree_are_errors(monkeypatch, sizes, message):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=re.escape(message)):
        zkernel.from_deepspeed_config({**ZERO1, **sizes})


def _skip_unless_tiers_installed(raw: dict) -> None:
    """Skip, naming the tier, exactly when the config's offload tier is not installed yet."""
    try:
        zkernel.initialize(TrickyNet(), raw)
    except ConfigError as exc:
        missing = re.match(r"offload\.(optimizer|params) '(\w+)' is not installed", str(exc))
        if missing:
            pytest.skip(f"offload tier {missing[2]!r} (offload.{missing[1]}) is not installed yet")
        raise


@pytest.mark.parametrize("example", ["zero2_cpu", "zero3_nvme"])
def test_offload_examples_train_like_torch_on_two_ranks(example, tmp_path):
    raw = {**(ZERO2_CPU if example == "zero2_cpu" else zero3_nvme(str(tmp_path / "swap"))), **TRAINING}
    (tmp_path / "swap").mkdir()
    _skip_unless_tiers_installed(raw)
    results = run_ranks(2, train, raw, STEPS, ACCUM, MICRO, SEED)
    for result in results:
        assert_matches(result["losses"], reference(2), f"DeepSpeed {example} example, world 2")
