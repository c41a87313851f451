"""A DeepSpeed config is checked against DeepSpeed's own schema: a typo is an error with the key it meant.

Before this check a misspelled key trained with a default (or, for a misspelled
``zero_optimization``, with no partitioning at all) after a warning calling it a
key "with no equivalent in zkernel".
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

import zkernel
from zkernel.compat.deepspeed import schema
from zkernel.spec.config import ConfigError

pytestmark = pytest.mark.usefixtures("zkernel_debug_logs")

ADAMW = {"type": "AdamW", "params": {"lr": 1e-4}}


def mapped(raw):
    with capture_logs() as logs:
        config = zkernel.from_deepspeed_config(raw)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) <= 1, warnings
    return config, (warnings[0] if warnings else None)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        # The three typos of issue 44.
        (
            {"zero_optimization": {"stage": 3, "stage3_param_persistance_threshold": 1e5}, "optimizer": ADAMW},
            "zero_optimization.stage3_param_persistance_threshold is not a key DeepSpeed 0.19.8 knows in "
            "zero_optimization; did you mean 'stage3_param_persistence_threshold'?",
        ),
        (
            {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"learning_rate": 1e-4}}},
            "optimizer.params.learning_rate is not a key DeepSpeed 0.19.8 knows in optimizer.params; did you mean 'lr'?",
        ),
        (
            {"zero_optimisation": {"stage": 3}, "train_micro_batch_size_per_gpu": 4, "optimizer": ADAMW},
            "zero_optimisation is not a key DeepSpeed 0.19.8 knows at the top level; did you mean 'zero_optimization'?",
        ),
        # One in each other checked section.
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
            "zero_optimization.offload_optimizer.pin_memroy is not a key DeepSpeed 0.19.8 knows in "
            "zero_optimization.offload_optimizer; did you mean 'pin_memory'?",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_sise": 1e8}}},
            "did you mean 'buffer_size'?",
        ),
        ({"fp16": {"enabled": True, "initial_scale_pow": 12}}, "fp16.initial_scale_pow is not a key DeepSpeed 0.19.8 knows in fp16; did you mean 'initial_scale_power'?"),
        ({"bf16": {"enable": True}}, "bf16.enable is not a key DeepSpeed 0.19.8 knows in bf16; did you mean 'enabled'?"),
        (
            {"bf16": {"enabled": True}, "activation_checkpointing": {"partition_activation": True}},
            "activation_checkpointing.partition_activation is not a key DeepSpeed 0.19.8 knows in activation_checkpointing; "
            "did you mean 'partition_activations'?",
        ),
        ({"bf16": {"enabled": True}, "gradient_clip": 1.0}, "gradient_clip is not a key DeepSpeed 0.19.8 knows at the top level; did you mean 'gradient_clipping'?"),
        ({"bf16": {"enabled": True}, "optimizer": {"typ": "AdamW"}}, "optimizer.typ is not a key DeepSpeed 0.19.8 knows in optimizer; did you mean 'type'?"),
        (
            {"bf16": {"enabled": True}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
            "scheduler.params.warmup_num_step is not a parameter of WarmupLR; valid: warmup_min_lr, warmup_max_lr, "
            "warmup_num_steps, warmup_type, last_batch_iteration (did you mean 'warmup_num_steps'?)",
        ),
        # Nothing close: the error lists what is valid.
        ({"bf16": {"enabled": True, "xyz": 1}}, "bf16.xyz is not a key DeepSpeed 0.19.8 knows in bf16; valid: bf16_master_weights_and_grads, bf16_optimizer_states, check_grad_overflow, enabled, immediate_grad_update"),
        # Keys DeepSpeed 0.19.8 removed, and rejects itself.
        ({"bf16": {"enabled": True}, "sparse_attention": {"mode": "fixed"}}, "sparse_attention was removed from DeepSpeed"),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "zero_optimization.mics_shard_size was removed from DeepSpeed"),
    ],
)
def test_a_key_deepspeed_does_not_know_is_an_error_naming_the_closest(raw, message):
    with pytest.raises(ConfigError) as info:
        zkernel.from_deepspeed_config(raw)
    assert message in str(info.value)


def test_a_misspelled_zero_optimization_section_is_still_a_deepspeed_config():
    # What issue 44 saw: the file is taken as a DeepSpeed config, so the error is the typo's.
    raw = {"zero_optimisation": {"stage": 3}, "train_micro_batch_size_per_gpu": 4}
    assert zkernel.compat.deepspeed.config.is_deepspeed_config(raw)
    with pytest.raises(ConfigError, match="did you mean 'zero_optimization'"):
        zkernel.from_deepspeed_config(raw)


def test_every_key_the_reader_maps_is_in_the_schema():
    # A key the mapping reads but the schema lacks would make a valid config an error.
    mapped_keys = {
        "": {"zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "aio", "gradient_clipping",
             "gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu"},
        "zero_optimization": {"stage", "offload_optimizer", "offload_param", "cpu_offload", "reduce_bucket_size",
                              "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
                              "allgather_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                              "sub_group_size", "overlap_comm", "contiguous_gradients"},
        "zero_optimization.offload_optimizer": {"device", "nvme_path", "pin_memory", "buffer_count", "fast_init", "ratio"},
        "zero_optimization.offload_param": {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"},
        "fp16": {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
                 "consecutive_hysteresis", "fp16_master_weights_and_grads", "auto_cast"},
        "bf16": {"enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"},
    }
    for section, keys in mapped_keys.items():
        assert keys <= schema.SECTIONS[section], (section, keys - schema.SECTIONS[section])


def test_a_key_deepspeed_knows_and_zkernel_does_not_map_warns_once_with_its_reason():
    raw = {
        "bf16": {"enabled": True, "immediate_grad_update": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "bias_correction": False}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "activation_checkpointing": {"partition_activations": True},
        "tensorboard": {"enabled": True, "output_path": "runs"},
        "gradient_clipping": 1.0,
    }
    config, warning = mapped(raw)
    assert config.partitioner == "zero3" and config.precision == "bf16" and config.optimizer.lr == 1e-4
    assert warning["event"] == "zkernel.deepspeed.unmapped"
    assert warning["ignored"] == [
        "bf16.immediate_grad_update (no equivalent in zkernel)",
        "optimizer.params.bias_correction (no equivalent in zkernel)",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save (no equivalent in zkernel)",
        "activation_checkpointing.partition_activations (no equivalent in zkernel)",
        "tensorboard.enabled (no equivalent in zkernel)",
        "tensorboard.output_path (no equivalent in zkernel)",
    ]
    # The same config with one of those keys misspelled is not a DeepSpeed config: an error, not a warning.
    raw["bf16"] = {"enabled": True, "immediate_grad_updates": True}
    with pytest.raises(ConfigError, match="bf16.immediate_grad_updates .* did you mean 'immediate_grad_update'"):
        zkernel.from_deepspeed_config(raw)


def test_auto_values_outside_a_trainer_are_listed_with_the_value_each_took():
    raw = {
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    config, warning = mapped(raw)
    assert warning["auto_values"] == {
        "fp16.enabled": "precision=fp32",
        "zero_optimization.reduce_bucket_size": "the zero2 partitioner's default",
        "optimizer.params.lr": 1e-3,
        "optimizer.params.betas": (0.9, 0.999),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "scheduler.params.warmup_max_lr": "[optimizer] lr=0.001",
        "scheduler.params.warmup_num_steps": 0,
    }
    assert config.optimizer.lr == 1e-3 and config.optimizer.weight_decay == 0.1 and config.gradient_clipping == 0.0


def test_gradient_clipping_defaults_to_deepspeeds():
    # DeepSpeed's default since its PR #8068: 1.0 in 0.19.8 (GRADIENT_CLIPPING_DEFAULT).
    assert mapped({"bf16": {"enabled": True}})[0].gradient_clipping == 1.0
    assert mapped({"bf16": {"enabled": True}, "gradient_clipping": 0.0})[0].gradient_clipping == 0.0, "asked for: no clipping"
    assert mapped({"bf16": {"enabled": True}, "gradient_clipping": 0.5})[0].gradient_clipping == 0.5
    assert zkernel.Config().gradient_clipping == 0.0, "a zkernel config keeps zkernel's default"
