"""Top-level DeepSpeed keys: batch sizes, precision, communication, and the features zerokit does not offer."""

from __future__ import annotations

from zerokit.config.dsconfig.keys import (Key, KeyClass, Kind, alias, always, block, honoured, refused,
                                   refused_block, removed, zerokit_key)

PARALLELISM = "zerokit is data parallel only: combine it with torch's own tensor/pipeline parallelism in model code"

BATCH = (
    honoured("train_batch_size", Kind.INT, None, "samples per optimizer step over all ranks; checked against "
             "micro-batch x accumulation x world size, or derived from them as DeepSpeed does"),
    honoured("train_micro_batch_size_per_gpu", Kind.INT, None, "samples per rank per micro-step"),
    honoured("gradient_accumulation_steps", Kind.INT, None, "micro-steps per optimizer step; the loss is divided "
             "by it"),
    always("managed_gradient_accumulation", "zerokit's engine.step() steps the optimizer at its accumulation "
           "boundary and only there", Kind.BOOL, True, (True,),
           "false hands the boundary to your code, which zerokit does not offer: call engine.step() every micro-step"),
)

TRAINING = (
    block("optimizer", "builds the optimizer when initialize() is given none "
          "(zerokit.engine.schedules.build_optimizer)"),
    honoured("optimizer.type", Kind.STR, None, "Adam, AdamW, SGD, Adagrad or Muon", auto=False),
    block("optimizer.params", "the optimizer's hyperparameters; DeepSpeed's defaults for those not given"),
    always("optimizer.legacy_fusion", "DeepSpeed's legacy fused-LAMB code path; zerokit builds torch optimizers",
           Kind.BOOL, False),
    block("scheduler", "builds the LR schedule, stepped at each optimizer step "
          "(zerokit.engine.schedules.build_scheduler)"),
    honoured("scheduler.type", Kind.STR, None, "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest",
             auto=False),
    block("scheduler.params", "the schedule's parameters, with DeepSpeed's formulas and defaults"),
    honoured("zero_allow_untested_optimizer", Kind.BOOL, False, "allow a passed optimizer other than the ones "
             "zerokit tests (ZeroConfig.allow_untested_optimizer)"),
    always("zero_force_ds_cpu_optimizer", "zerokit steps your torch optimizer on the offloaded fp32 masters; there "
           "is no DeepSpeed CPU Adam to force", Kind.BOOL, True),
    honoured("gradient_clipping", Kind.FLOAT, 0.0, "clip the global gradient norm over all shards (0: off; "
             "absent: zerokit.initialize does not clip; DeepSpeed 0.19.8 and zerokit.deepspeed clip at 1.0)"),
    honoured("communication_data_type", Kind.DTYPE, None, "dtype gradients are reduced in (zerokit: fp32 when "
             "absent; DeepSpeed reduces in the compute dtype); \"bfp16\" is refused, as DeepSpeed refuses it"),
    honoured("prescale_gradients", Kind.BOOL, False, "divide gradients by the world size before the reduction, "
             "not after"),
    honoured("gradient_predivide_factor", Kind.FLOAT, 1.0, "divide gradients by this before the reduction and by "
             "world size / factor after"),
    always("gradient_allreduce_op", "zerokit averages gradients over ranks", Kind.CHOICE, "mean", ("mean",),
           "\"sum\" keeps the unscaled sum, which zerokit does not offer", choices=("mean", "sum")),
    always("disable_allgather", "zerokit picks the parameter gather per back-end (one all-gather on NCCL, "
           "per-owner broadcasts on gloo); broadcasts instead gather the same values", Kind.BOOL, False),
    honoured("dataloader_drop_last", Kind.BOOL, False, "drop the last incomplete batch of the loader built from "
             "training_data"),
)

PRECISION = (
    block("fp16", "fp16 compute with fp32 master weights and dynamic loss scaling"),
    honoured("fp16.enabled", Kind.BOOL, False, "train in fp16 (\"auto\": off)"),
    honoured("fp16.loss_scale", Kind.FLOAT, 0.0, "0: dynamic loss scaling; >0: this static scale"),
    honoured("fp16.initial_scale_power", Kind.INT, 16, "dynamic scaling starts at 2**power"),
    honoured("fp16.loss_scale_window", Kind.INT, 1000, "steps without overflow before the scale doubles"),
    honoured("fp16.hysteresis", Kind.INT, 2, "overflows tolerated before the scale is halved"),
    honoured("fp16.min_loss_scale", Kind.FLOAT, 1.0, "the scale never goes below this"),
    refused("fp16.auto_cast", "casting the model's inputs to fp16", "zerokit passes inputs as you give them"),
    refused("fp16.consecutive_hysteresis", "refilling the hysteresis after each good step",
            "zerokit's loss scaler (precision/scaler.py) does not"),
    refused("fp16.fp16_master_weights_and_grads", "fp16 master weights", "zerokit keeps fp32 masters"),
    block("bf16", "bf16 compute with fp32 master weights"),
    honoured("bf16.enabled", Kind.BOOL, False, "train in bf16 (\"auto\": off)"),
    always("bf16.immediate_grad_update", "zerokit moves each gradient into its bucket as soon as it is ready",
           Kind.BOOL, False),
    always("bf16.check_grad_overflow", "zerokit checks every step for inf/nan gradients under every precision, "
           "in the all-reduce of the gradient norm (false only saves DeepSpeed that check's cost)", Kind.BOOL, True),
    refused("bf16.bf16_master_weights_and_grads", "bf16 master weights", "zerokit keeps fp32 masters"),
    refused("bf16.bf16_optimizer_states", "bf16 optimizer states", "zerokit keeps fp32 optimizer states"),
    alias("bfloat16", "bf16", Kind.BLOCK, "the old name of the bf16 block"),
    alias("bfloat16.enabled", "bf16.enabled", Kind.BOOL),
    refused_block("torch_autocast", "running forward under torch.autocast", "zerokit casts parameters to the "
                  "compute dtype instead (bf16.enabled / fp16.enabled)"),
    block("data_types", "dtypes of gradient accumulation, parameters and buffers"),
    honoured("data_types.grad_accum_dtype", Kind.DTYPE, None, "dtype gradients accumulate in across micro-steps"),
    refused("data_types.param_dtype", "casting parameters to another dtype than the compute dtype",
            "zerokit's parameters take the compute dtype of bf16/fp16.enabled", Kind.DTYPE, None),
    refused("data_types.buffer_dtype", "casting buffers to a dtype of their own",
            "zerokit casts floating buffers with the parameters", Kind.DTYPE, None),
    refused("data_types.keep_in_fp32_modules", "keeping some modules' buffers in fp32 under bf16/fp16",
            "zerokit casts every floating buffer to the compute dtype (\"auto\" and [] are accepted)", Kind.ANY,
            None, (None, ())),
)

TP = "tensor_parallel."
SPLITS_BY_PLAN = "zerokit splits the linears the model's Hugging Face tp_plan names, as DeepSpeed does by default"
TENSOR_PARALLEL = (
    block("tensor_parallel", "DeepSpeed's AutoTP training: the model's linears split over a tensor group of "
          "consecutive ranks inside a node, ZeRO over the replicas (zerokit/parallel/tensor, docs/tensor_parallel.md)"),
    honoured(TP + "autotp_size", Kind.INT, 0, "the tensor degree (0 and 1: none): the linears of the model's Hugging "
             "Face tp_plan are split over it; batch sizes count the tensor ranks as data ranks, as DeepSpeed does",
             auto=False),
    always(TP + "tp_overlap_comm", "zerokit all-reduces a column split's input gradient before its weight gradient "
           "(overlapping the two changes speed, not what is computed)", Kind.BOOL, False),
    always(TP + "dtype", "the compute dtype is bf16/fp16.enabled's (DeepSpeed reads this one only from "
           "tp_model_init)", Kind.ANY, None),
    refused(TP + "vocab_parallel_lm_head", "a vocabulary-parallel LM head with a distributed loss",
            "zerokit gathers the LM head's logits, as DeepSpeed does for an untied head by default", Kind.ANY, None,
            (None, False)),
    refused(TP + "vocab_parallel_ce_backend", "Liger's vocabulary-parallel cross-entropy", "zerokit has no "
            "vocabulary-parallel head", Kind.STR, "torch"),
    block(TP + "tp", "the tensor group: tp_size 1 or autotp_size"),
    honoured(TP + "tp.tp_size", Kind.INT, 1, "checked against autotp_size (1 or the same), as DeepSpeed does",
             auto=False),
    always(TP + "tp.tp_grain_size", "DeepSpeed's note: not active in training yet", Kind.INT, 1),
    refused(TP + "tp.mpu", "a model-parallel unit of your own", "zerokit's layout makes the tensor group "
            "(zerokit/parallel/mesh.py)", Kind.ANY, None),
    refused(TP + "tp.tp_group", "a tensor group of your own", "zerokit's layout makes the tensor group "
            "(zerokit/parallel/mesh.py)", Kind.ANY, None),
    alias(TP + "tensor_parallel", TP + "tp", Kind.BLOCK, "the field name of tensor_parallel.tp"),
    refused(TP + "injection_policy_tuple", "an injection policy of DeepSpeed's inference kernels", SPLITS_BY_PLAN,
            Kind.ANY, None),
    refused(TP + "partition_config", "partition rules of your own", SPLITS_BY_PLAN, Kind.ANY, None),
    refused(TP + "preset_model", "a preset of DeepSpeed's partition rules", SPLITS_BY_PLAN, Kind.ANY, None),
    always(TP + "keep_module_on_host", "where AutoTP's parser keeps loaded checkpoints; zerokit splits the model it "
           "is given", Kind.BOOL, False),
    refused(TP + "replace_with_kernel_inject", "DeepSpeed's inference kernels", "zerokit trains with your model's "
            "own layers"),
    alias(TP + "kernel_inject", TP + "replace_with_kernel_inject", Kind.BOOL),
)

EP = "expert_parallel."
OWN_ROUTER = ("zerokit splits the model's own experts module and keeps its own router, which already says this "
              "(zerokit/parallel/experts/hf.py)")
EXPERT_PARALLEL = (
    block("expert_parallel", "DeepSpeed's AutoEP: a Hugging Face MoE model's experts split over consecutive data "
          "ranks, ZeRO over their expert-data groups (zerokit/parallel/experts/hf.py, docs/moe.md)"),
    honoured(EP + "enabled", Kind.BOOL, False, "splits the experts (with autoep_size > 1)", auto=False),
    honoured(EP + "autoep_size", Kind.INT, 1, "the expert degree: the data ranks each layer's experts split over",
             auto=False),
    always(EP + "preset_model", "zerokit finds transformers' experts modules by their layout (Mixtral, Qwen2-MoE, "
           "Qwen3-MoE, OLMoE, DeepSeek-V3) and keeps each block's router", Kind.ANY, None),
    refused(EP + "expert_tensor_parallel_size", "experts split by tensor parallelism", "zerokit splits whole experts "
            "over ranks", Kind.INT, 1),
    *(always(EP + name, "zerokit's dispatch is its own (torch's all_to_all_single, each expert its own linears)",
             Kind.ANY, None)
      for name in ("use_grouped_mm", "disable_triton_grouped_mm", "async_split_plan", "validate_folding_routing",
                   "comm_backend", "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank", "gate_up_impl",
                   "combine_impl", "row_weighting_impl", "score_apply")),
    *(refused(EP + name, f"a {name} of your own", OWN_ROUTER, Kind.ANY, None, accepts=(None,))
      for name in ("moe_layer_pattern", "expert_pattern", "router_pattern", "route_norm", "score_func", "top_k",
                   "routed_scaling_factor", "num_expert_groups", "num_limited_groups", "load_balance_coeff",
                   "expert_w1", "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts",
                   "shared_experts_pattern", "shared_experts_gate_pattern", "expert_activation")),
    refused(EP + "route_scale", "a route scale of your own", OWN_ROUTER, Kind.FLOAT, 1.0),
)

PARALLEL = (
    refused_block("pipeline", "pipeline parallelism", PARALLELISM, switch=""),
    *TENSOR_PARALLEL,
    *EXPERT_PARALLEL,
    honoured("sequence_parallel_size", Kind.INT, 1, "Ulysses sequence parallelism: each replica's sequences split "
             "over this many consecutive ranks, ZeRO over all (zerokit/parallel/sequence, docs/sequence_parallel.md)"),
    always("seq_parallel_communication_data_type", "zerokit's all-to-alls move the activations in their own dtype",
           Kind.DTYPE, "fp32"),
    always("use_data_before_expert_parallelism", "zerokit's expert groups are consecutive replicas, DeepSpeed's "
           "default order (zerokit/parallel/mesh.py); which ranks share experts changes no number trained", Kind.BOOL,
           False),
    refused_block("hybrid_engine", "DeepSpeed's RLHF hybrid training/inference engine", "zerokit trains; generate "
                  "inside engine.unsharded()"),
    Key("compile", KeyClass.ALWAYS, Kind.BLOCK, None, "zerokit runs your module as you give it: compile it with "
        "torch.compile (DeepCompile's passes change speed and memory, not what is computed)"),
    refused_block("weight_quantization", "quantized weights for inference", "zerokit trains in bf16/fp16/fp32",
                  switch=""),
    refused_block("autotuning", "DeepSpeed's autotuner", "zerokit plan predicts memory and time per stage "
                  "before you run instead"),
    refused_block("data_efficiency", "data sampling (curriculum learning) and data routing (random-LTD)",
                  "zerokit leaves data loading to your loader"),
    Key("datastates_ckpt", KeyClass.ALWAYS, Kind.BLOCK, None, "DataStates writes checkpoints asynchronously; "
        "zerokit saves asynchronously itself with save_checkpoint(async_save=True)"),
    always("memory_breakdown", "zerokit reports exact bytes by category in engine.memory_stats() instead of "
           "printing memory use every step", Kind.BOOL, False),
    always("dump_state", "zerokit logs its start-up choices (logger 'zerokit') instead of DeepSpeed's engine "
           "state", Kind.BOOL, False),
    always("disable_python_gc", "zerokit leaves Python's garbage collector as your process sets it (a speed "
           "knob)", Kind.BOOL, False),
    always("vocabulary_size", "DeepSpeed only warns when it is not a multiple of 8; zerokit has nothing to check",
           Kind.INT),
    always("log_level", "zerokit logs through the standard logging module: set the level of logger 'zerokit'",
           Kind.ANY),
)

REMOVED = tuple(removed(path, asks) for path, asks in (
    ("amp", "NVIDIA Apex AMP"), ("compression_training", "DeepSpeed's compression library (quantization, "
                                                         "pruning, layer reduction)"),
    ("quantize_training", "Mixture-of-Quantization (MoQ)"), ("eigenvalue", "eigenvalue-based MoQ"),
    ("sparse_attention", "DeepSpeed sparse attention"), ("sparse_gradients", "sparse embedding gradients"),
    ("curriculum_learning", "legacy curriculum learning"), ("progressive_layer_drop", "progressive layer dropping"),
    ("nebula", "Nebula checkpointing"), ("graph_harvesting", "graph harvesting"),
))

ELASTIC = "zerokit/config/dsconfig/elastic.py"
ELASTICITY = (
    block("elasticity", "elastic training: the global batch, micro-batch and accumulation chosen for the world size "
          "as DeepSpeed 0.18's compute_elastic_config chose them (DeepSpeed 0.19.8 removed the block), so that a "
          f"restart on more or fewer ranks keeps the global batch ({ELASTIC})"),
    honoured("elasticity.enabled", Kind.BOOL, False, "choose the batch sizes from this block", auto=False),
    honoured("elasticity.max_train_batch_size", Kind.INT, 2000, "the largest global batch acceptable", auto=False),
    honoured("elasticity.micro_batch_sizes", Kind.ANY, (2, 4, 6), "the micro-batches a rank may run", auto=False),
    honoured("elasticity.min_gpus", Kind.INT, 1, "the fewest ranks the global batch must split over", auto=False),
    honoured("elasticity.max_gpus", Kind.INT, 10000, "the most ranks the global batch must split over", auto=False),
    honoured("elasticity.min_time", Kind.INT, 0, "minutes a scheduler should run a size before scaling; checked "
             "(>= 0), for the scheduler", auto=False),
    honoured("elasticity.version", Kind.FLOAT, 0.2, "0.1: the batch from the bounds alone; 0.2: a world size "
             "outside the valid ones gets a batch of its own", auto=False),
    honoured("elasticity.prefer_larger_batch", Kind.BOOL, True, "ties go to the larger global batch (else the "
             "smaller)", auto=False),
    honoured("elasticity.ignore_non_elastic_batch_info", Kind.BOOL, False, "batch keys beside the block are "
             "overridden (else refused, as DeepSpeed refuses them)", auto=False),
    honoured("elasticity.num_gpus_per_node", Kind.INT, 1, "version 0.2 counts ranks by node", auto=False),
    refused("elasticity.model_parallel_size", "elastic batch sizes for model-parallel groups", PARALLELISM, Kind.INT,
            1),
)

ZEROKIT_TOP = (
    zerokit_key("max_consecutive_skipped_steps", Kind.INT, 20, "raise after this many optimizer steps in a row "
                "were skipped for inf/nan gradients"),
    zerokit_key("comm_timeout_seconds", Kind.FLOAT, 300.0, "every collective's deadline"),
    zerokit_key("broadcast_buffers", Kind.BOOL, True, "broadcast rank 0's buffers to every rank, as torch DDP does"),
    zerokit_key("ranks_per_node", Kind.INT, None, "ranks on each node, consecutive (default: torchrun's "
                "LOCAL_WORLD_SIZE; without it, one node): which bytes comm_stats() counts as crossing nodes"),
)

KEYS: tuple[Key, ...] = (block("zero_optimization", "ZeRO stage and its tuning"), *BATCH, *TRAINING, *PRECISION,
                         *PARALLEL, *ELASTICITY, *REMOVED, *ZEROKIT_TOP)
