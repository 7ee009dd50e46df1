"""The keys of Hugging Face Accelerate and DeepSpeed config files: what ``check-config`` knows and ``advise`` writes.

Read from the projects' sources and docs (Accelerate ``commands/config/config_args.py``,
``commands/launch.py`` and ``utils/constants.py``; DeepSpeed ``runtime/constants.py``,
``runtime/zero/config.py``, ``runtime/zero/offload_config.py`` and
``runtime/precision_config.py``), as plain data: no torch, accelerate or
deepspeed import. How each tool treats a key it does not know decides how
strict the checker is:

- Accelerate refuses a file with an unknown top-level key; inside its
  ``*_config`` blocks it copies keys onto its launch arguments and silently
  drops the ones it does not know (a typo loses the setting);
- DeepSpeed ignores unknown top-level keys, but its ``zero_optimization``,
  offload and precision sections are pydantic models with ``extra="forbid"``:
  an unknown key there is a start-up error.
"""
from __future__ import annotations

ACCELERATE_TOP_LEVEL = frozenset({
    # BaseConfig and ClusterConfig
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "parallelism_config", "megatron_lm_config", "ipex_config", "mpirun_config", "downcast_bf16",
    "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config",
    # converted on load by older and current versions
    "fp16", "dynamo_backend",
    # SageMakerConfig (compute_environment: AMAZON_SAGEMAKER)
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name", "pytorch_version",
    "transformers_version", "py_version", "sagemaker_inputs_file", "sagemaker_metrics_file", "additional_args",
})

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                     "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM")
COMPUTE_ENVIRONMENTS = ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
FSDP_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
HYBRID_STRATEGIES = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
FSDP_AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)

# Accelerate's per-engine blocks; a key without the block's prefix gets it on load (fsdp_, fp8_, dynamo_).
ACCELERATE_BLOCKS: dict[str, frozenset[str]] = {
    "fsdp_config": frozenset({
        "fsdp_version", "fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_backward_prefetch", "fsdp_backward_prefetch_policy", "fsdp_state_dict_type", "fsdp_forward_prefetch",
        "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
        "fsdp_activation_checkpointing"}),
    "deepspeed_config": frozenset({
        "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
        "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping",
        "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_hostfile", "deepspeed_exclusion_filter",
        "deepspeed_inclusion_filter", "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names"}),
    "megatron_lm_config": frozenset({
        "megatron_lm_tp_degree", "megatron_lm_pp_degree", "megatron_lm_num_micro_batches",
        "megatron_lm_sequence_parallelism", "megatron_lm_recompute_activations",
        "megatron_lm_use_distributed_optimizer", "megatron_lm_gradient_clipping", "megatron_lm_use_custom_fsdp",
        "megatron_lm_no_load_optim", "megatron_lm_no_save_optim", "megatron_lm_eod_mask_loss",
        "megatron_lm_overlap_cpu_optimizer_d2h_h2d", "megatron_lm_optimizer_cpu_offload",
        "megatron_lm_use_precision_aware_optimizer", "megatron_lm_decoder_last_pipeline_num_layers",
        "megatron_lm_recompute_granularity", "megatron_lm_recompute_method", "megatron_lm_recompute_num_layers",
        "megatron_lm_attention_backend", "megatron_lm_attention_dropout", "megatron_lm_attention_softmax_in_fp32",
        "megatron_lm_calculate_per_token_loss", "megatron_lm_context_parallel_size",
        "megatron_lm_expert_model_parallel_size", "megatron_lm_expert_tensor_parallel_size",
        "megatron_lm_hidden_dropout", "megatron_lm_use_rotary_position_embeddings"}),
    "parallelism_config": frozenset({
        "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size", "parallelism_config_tp_size",
        "parallelism_config_cp_size", "parallelism_config_cp_comm_strategy", "parallelism_config_cp_backend",
        "parallelism_config_sp_size", "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
        "parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_attn_implementation"}),
    "fp8_config": frozenset({
        "fp8_amax_compute_algo", "fp8_amax_history_len", "fp8_backend", "fp8_enable_fsdp_float8_all_gather",
        "fp8_format", "fp8_interval", "fp8_margin", "fp8_opt_level", "fp8_override_linear_precision",
        "fp8_pad_inner_dim", "fp8_use_autocast_during_eval"}),
    "dynamo_config": frozenset({
        "dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
        "dynamo_use_regional_compilation"}),
}
BLOCK_PREFIX = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}
FREE_FORM_BLOCKS = frozenset({"ipex_config", "mpirun_config", "additional_args"})  # passed through as given
FSDP1_ONLY = ("fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_backward_prefetch_policy",
              "fsdp_forward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states")
# deepspeed_config keys Accelerate refuses beside a deepspeed_config_file (DeepSpeedPlugin._deepspeed_config_checks)
DEEPSPEED_FILE_EXCLUSIVE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage",
                            "offload_optimizer_device", "offload_param_device", "offload_param_nvme_path",
                            "offload_optimizer_nvme_path", "zero3_save_16bit_model")

DEEPSPEED_TOP_LEVEL = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "gradient_clipping", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "communication_data_type",
    "seq_parallel_communication_data_type", "steps_per_print", "wall_clock_breakdown", "dump_state",
    "memory_breakdown", "flops_profiler", "activation_checkpointing", "sparse_attention", "tensorboard", "wandb",
    "csv_monitor", "comet", "comms_logger", "elasticity", "autotuning", "data_efficiency", "curriculum_learning",
    "checkpoint", "data_types", "aio", "pipeline", "tensor_parallel", "compile", "hybrid_engine",
    "compression_training", "quantize_training", "weight_quantization", "eigenvalue", "progressive_layer_drop",
    "disable_allgather", "dataloader_drop_last", "graph_harvesting", "log_level",
    "use_data_before_expert_parallelism", "managed_gradient_accumulation", "vocabulary_size", "nebula", "timers",
    "check_overflow", "expert_parallel",
})
ZERO_KEYS = frozenset({
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
    "max_reuse_distance", "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "module_granularity_threshold", "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
    "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory", "leaf_module",
})
# keys that only ZeRO stage 3 reads (the partitioned-parameter machinery)
ZERO3_ONLY = frozenset({k for k in ZERO_KEYS if k.startswith("stage3_")} | {
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "zero_hpz_partition_size", "mics_shard_size",
    "mics_hierarchical_params_gather"})
DEEPSPEED_SECTIONS: dict[str, frozenset[str]] = {  # pydantic models with extra="forbid"
    "zero_optimization": ZERO_KEYS,
    "zero_optimization.offload_param": frozenset({"device", "nvme_path", "buffer_count", "buffer_size",
                                                  "max_in_cpu", "pin_memory"}),
    "zero_optimization.offload_optimizer": frozenset({"device", "nvme_path", "buffer_count", "pin_memory",
                                                      "pipeline_read", "pipeline_write", "fast_init", "ratio",
                                                      "super_offload", "cpuadam_cores_perc"}),
    "fp16": frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                       "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}),
    "bf16": frozenset({"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                       "bf16_optimizer_states"}),
}

# what tells the two kinds apart
ACCELERATE_MARKERS = frozenset({"compute_environment", "distributed_type", "num_processes", "num_machines",
                                "deepspeed_config", "fsdp_config", "main_training_function"})
DEEPSPEED_MARKERS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization",
                               "gradient_accumulation_steps", "fp16", "bf16", "optimizer", "steps_per_print"})
