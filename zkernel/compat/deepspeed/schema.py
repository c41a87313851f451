"""DeepSpeed's config schema, as data: the keys each section of a DeepSpeed JSON config may hold.

Taken from DeepSpeed 0.19.8 (the release on PyPI on 2026-11-29): the top-level
keys its ``DeepSpeedConfig`` reads (``deepspeed/runtime/config.py``,
``constants.py`` and the section readers it calls), the fields and aliases of
its pydantic models (``DeepSpeedZeroConfig``, the two offload configs,
``DeepSpeedFP16Config``/``DeepSpeedBF16Config``, which forbid other keys), the
activation-checkpointing and aio constants, and the keyword arguments its
Adam/AdamW construction accepts (``engine.get_optimizer_configuration``,
``FusedAdam``, ``DeepSpeedCPUAdam``, ``torch.optim.AdamW`` under
``torch_adam``). `zkernel.compat.deepspeed.config` rejects any other key as a
typo; a known key that zkernel does not map is reported, not rejected.

Sections without a table here (``tensorboard``, ``flops_profiler``, ...) are
checked by name only; what is inside them is reported as having no
equivalent. Update the tables, and the version above, from a new release.
"""

from __future__ import annotations

DEEPSPEED_VERSION = "0.19.8"

TOP_LEVEL = frozenset(
    {
        # batch and steps
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "managed_gradient_accumulation",
        "steps_per_print",
        "dataloader_drop_last",
        # optimizer and schedule
        "optimizer",
        "scheduler",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "gradient_clipping",
        # ZeRO and offload
        "zero_optimization",
        "aio",
        # precision
        "fp16",
        "bf16",
        "bfloat16",  # DeepSpeed's older spelling of bf16
        "torch_autocast",
        "data_types",
        # communication
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "disable_allgather",
        "comms_logger",
        # memory and activations
        "activation_checkpointing",
        "disable_python_gc",
        "vocabulary_size",
        # parallelism and engines
        "pipeline",
        "tensor_parallel",
        "expert_parallel",
        "use_data_before_expert_parallelism",
        "hybrid_engine",
        "compile",
        "weight_quantization",
        "data_efficiency",
        # checkpoints
        "checkpoint",
        "datastates_ckpt",
        # diagnostics and monitoring
        "dump_state",
        "wall_clock_breakdown",
        "memory_breakdown",
        "log_level",
        "timers",
        "flops_profiler",
        "autotuning",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
    }
)

# Keys DeepSpeed 0.19.8 itself rejects ("has been removed"): a config holding one does not run there either.
REMOVED = {
    "": frozenset(
        {
            "nebula",
            "compression_training",
            "amp",
            "quantize_training",
            "sparse_gradients",
            "eigenvalue",
            "sparse_attention",
            "elasticity",
            "graph_harvesting",
            "curriculum_learning",
            "progressive_layer_drop",
        }
    ),
    "zero_optimization": frozenset({"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"}),
}

# DeepSpeedZeroConfig: field names and their stage3_* aliases (DeepSpeed accepts both), and deprecated names.
ZERO_OPTIMIZATION = frozenset(
    {
        "stage",
        "contiguous_gradients",
        "reduce_scatter",
        "reduce_bucket_size",
        "use_multi_rank_bucket_allreduce",
        "allgather_partitions",
        "allgather_bucket_size",
        "overlap_comm",
        "compute_grad_norm",
        "load_from_fp32_weights",
        "elastic_checkpoint",
        "offload_param",
        "offload_optimizer",
        "zenflow",
        "sub_group_size",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
        "cpu_offload",
        "prefetch_bucket_size",
        "stage3_prefetch_bucket_size",
        "param_persistence_threshold",
        "stage3_param_persistence_threshold",
        "model_persistence_threshold",
        "stage3_model_persistence_threshold",
        "max_live_parameters",
        "stage3_max_live_parameters",
        "max_reuse_distance",
        "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold",
        "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential",
        "stage3_allgather_sequential",
        "stage3_gather_fp16_weights_on_model_save",
        "ignore_unused_parameters",
        "legacy_stage1",
        "round_robin_gradients",
        "parameter_alignment",
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        "memory_efficient_linear",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
        "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
        "leaf_module",
    }
)

OFFLOAD_PARAM = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
OFFLOAD_OPTIMIZER = frozenset(
    {
        "device",
        "nvme_path",
        "buffer_count",
        "pin_memory",
        "pipeline_read",
        "pipeline_write",
        "fast_init",
        "ratio",
        "super_offload",
        "cpuadam_cores_perc",
    }
)

FP16 = frozenset(
    {
        "enabled",
        "auto_cast",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
        "fp16_master_weights_and_grads",
    }
)
BF16 = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"})

ACTIVATION_CHECKPOINTING = frozenset(
    {
        "partition_activations",
        "number_checkpoints",
        "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary",
        "profile",
        "cpu_checkpointing",
    }
)
AIO = frozenset({"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds"})
TORCH_AUTOCAST = frozenset({"enabled", "dtype", "lower_precision_safe_modules"})

OPTIMIZER = frozenset({"type", "params", "legacy_fusion"})
# What DeepSpeed's Adam and AdamW take: FusedAdam/DeepSpeedCPUAdam's arguments, DeepSpeed's own
# switches, and torch.optim.AdamW's (with torch_adam). DeepSpeed rejects max_grad_norm itself.
ADAM_PARAMS = frozenset(
    {
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "bias_correction",
        "adam_w_mode",
        "set_grad_none",
        "torch_adam",
        "fp32_optimizer_states",
        "foreach",
        "fused",
        "maximize",
        "capturable",
        "differentiable",
    }
)
SCHEDULER = frozenset({"type", "params"})

# Keys earlier DeepSpeed releases documented that 0.19.8 no longer reads (it ignores them): accepted, so
# an older config still maps, and reported in the warning like any key without an equivalent.
LEGACY = {"aio": frozenset({"thread_count"})}  # renamed intra_op_parallelism

# Names other trainers (torch, the Hugging Face Trainer) use for a DeepSpeed key, which spelling alone
# would not suggest: section -> {name: the DeepSpeed key to suggest}.
SYNONYMS = {
    "": {"max_grad_norm": "gradient_clipping"},
    "optimizer.params": {
        "learning_rate": "lr",
        "epsilon": "eps",
        "beta1": "betas",
        "beta2": "betas",
        "max_grad_norm": "gradient_clipping (a top-level key)",
    },
}

# Dotted section -> the keys it may hold ("" is the top level). optimizer.params is checked only for
# the optimizer types zkernel maps (others are an error of their own); scheduler.params is checked per
# type by `zkernel.compat.deepspeed.scheduler`.
SECTIONS = {
    "": TOP_LEVEL,
    "zero_optimization": ZERO_OPTIMIZATION,
    "zero_optimization.offload_param": OFFLOAD_PARAM,
    "zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER,
    "fp16": FP16,
    "bf16": BF16,
    "bfloat16": BF16,
    "activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "aio": AIO,
    "torch_autocast": TORCH_AUTOCAST,
    "optimizer": OPTIMIZER,
    "scheduler": SCHEDULER,
}
ADAM_TYPES = ("adam", "adamw")
