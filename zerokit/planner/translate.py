"""DeepSpeed `zero_optimization` <-> FSDP (FSDP2 `fully_shard`, FSDP1 names) <-> zerokit.

Every key becomes a `Mapping` that says what it turns into and why, with one of four kinds:
exact (same semantics), approximate (same intent, different mechanics: the `why` says how),
dropped (a tuning knob the target sets by construction) and none (a semantic feature the target
lacks). A translation with any `none` mapping raises ValueError naming each one, unless the caller
asks for the partial result (the CLI prints the table, then the error).

    DeepSpeed stage        FSDP2 fully_shard                  FSDP1 ShardingStrategy
    0                      (DDP; FSDP2 has no NO_SHARD)       NO_SHARD
    1                      DDP + ZeroRedundancyOptimizer      (none)
    2                      reshard_after_forward=False        SHARD_GRAD_OP
    3                      reshard_after_forward=True         FULL_SHARD
    3 + hpZ partition G    reshard_after_forward=G (approx.)  (none)
    (none)                 2-D mesh (replicate, shard)        HYBRID_SHARD, _HYBRID_SHARD_ZERO2
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EXACT, APPROXIMATE, DROPPED, NONE = "exact", "approximate", "dropped", "none"
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
STAGE_OF_STRATEGY = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
          "torch.float16": "fp16", "fp32": "fp32", "float32": "fp32", "torch.float32": "fp32"}
REMOVED = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")
DEPRECATED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
              "cpu_offload_use_pin_memory": "offload_*.pin_memory",
              "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save"}

# DeepSpeed knobs that FSDP2 sets by construction: key -> (kind, FSDP counterpart, why).
FSDP_KNOBS = {
    "reduce_bucket_size": (DROPPED, "-", "FSDP2 reduce-scatters one fully_shard unit at a time: choose units"),
    "allgather_bucket_size": (DROPPED, "-", "FSDP2 all-gathers one fully_shard unit at a time"),
    "contiguous_gradients": (DROPPED, "-", "FSDP2 reduce-scatters into preallocated per-unit buffers"),
    "reduce_scatter": (DROPPED, "-", "FSDP2 always reduce-scatters"),
    "allgather_partitions": (DROPPED, "-", "FSDP2 always all-gathers"),
    "use_multi_rank_bucket_allreduce": (DROPPED, "-", "no bucket merging in FSDP2"),
    "overlap_comm": (APPROXIMATE, "implicit", "FSDP2 always overlaps communication on separate streams"),
    "prefetch_bucket_size": (APPROXIMATE, "set_modules_to_forward_prefetch",
                             "FSDP2 prefetches the next unit by itself; the setter prefetches more"),
    "max_live_parameters": (APPROXIMATE, "FSDP1 limit_all_gathers=True", "FSDP2 keeps at most two units gathered"),
    "max_reuse_distance": (DROPPED, "-", "FSDP2 reshards every unit after use"),
    "param_persistence_threshold": (APPROXIMATE, "module choice",
                                    "leave small modules out of units; the root unit keeps them gathered"),
    "model_persistence_threshold": (DROPPED, "-", "no global persistence budget in FSDP2"),
    "module_granularity_threshold": (APPROXIMATE, "module choice", "choose which modules get a fully_shard call"),
    "use_all_reduce_for_fetch_params": (DROPPED, "-", "FSDP2 gathers with all-gather"),
    "allgather_sequential": (DROPPED, "-", "FSDP2 gathers each unit in one call"),
    "sub_group_size": (DROPPED, "-", "offload tiling; FSDP2's CPU optimizer steps whole tensors"),
    "round_robin_gradients": (DROPPED, "-", "offload copy scheduling"),
    "elastic_checkpoint": (DROPPED, "-", "use torch.distributed.checkpoint, which reshards at load"),
    "load_from_fp32_weights": (DROPPED, "-", "checkpoint detail; DCP stores what the optimizer holds"),
    "ignore_unused_parameters": (APPROXIMATE, "set_reduce_scatter_unused_params",
                                 "FSDP2 reduce-scatters zeros for parameters without gradients"),
    "leaf_module": (APPROXIMATE, "fully_shard([a, b])", "one unit for the whole module"),
    "gather_16bit_weights_on_model_save": (APPROXIMATE, "get_model_state_dict(full_state_dict=True)",
                                           "gather a full state dict when saving"),
    "memory_efficient_linear": (DROPPED, "-", "a DeepSpeed ZeRO-3 kernel detail"),
    "override_module_apply": (DROPPED, "-", "a DeepSpeed ZeRO-3 patch"),
    "pipeline_loading_checkpoint": (DROPPED, "-", "a DeepSpeed pipeline-mode detail"),
    "log_trace_cache_warnings": (DROPPED, "-", "logging only"),
    "enable_sanity_checks": (DROPPED, "-", "debugging only"),
    "parameter_alignment": (DROPPED, "-", "flat-buffer padding; FSDP2 has no flat buffers"),
    "legacy_stage1": (DROPPED, "-", "implementation switch"),
    "compute_grad_norm": (DROPPED, "-", "call clip_grad_norm_ yourself"),
    "save_muon_momentum_buffer_in_memory": (DROPPED, "-", "Muon with NVMe only"),
    "zero_quantized_weights": (NONE, "-", "no quantized all-gather built into FSDP2 (set_custom_all_gather is a hook)"),
    "zero_quantized_nontrainable_weights": (NONE, "-", "FSDP2 does not store frozen weights quantized"),
    "zero_quantized_gradients": (NONE, "-", "no quantized reduce-scatter built into FSDP2"),
    "zenflow": (NONE, "-", "ZenFlow's selective, asynchronous CPU update has no FSDP counterpart"),
}
SEMANTIC = ("stage", "offload_optimizer", "offload_param", "zero_hpz_partition_size")
ZERO_KEYS = SEMANTIC + tuple(FSDP_KNOBS) + tuple(DEPRECATED)
ZEROKIT_SAME = ("stage", "reduce_bucket_size", "overlap_comm", "prefetch_bucket_size", "max_live_parameters",
                "param_persistence_threshold", "reduce_scatter", "sub_group_size")
"""Keys zerokit reads with DeepSpeed's meaning (stage-3 ones with or without the stage3_ prefix)."""
ZEROKIT_KEYS = ZEROKIT_SAME + ("contiguous_gradients", "reduce_every_micro_step")
TOP_LEVEL = ("zero_optimization", "bf16", "fp16", "gradient_clipping", "gradient_accumulation_steps",
             "communication_data_type", "train_batch_size", "train_micro_batch_size_per_gpu")


@dataclass(frozen=True)
class Mapping:
    source: str
    target: str
    kind: str
    why: str


@dataclass(frozen=True)
class Translation:
    source: str
    target: str
    mappings: tuple[Mapping, ...]
    config: dict

    @property
    def unmapped(self) -> tuple[Mapping, ...]:
        return tuple(m for m in self.mappings if m.kind == NONE)

    def check(self) -> Translation:
        if self.unmapped:
            items = "; ".join(f"{m.source} ({m.why})" for m in self.unmapped)
            raise ValueError(f"no {self.target} equivalent for {items}")
        return self


@dataclass(frozen=True, kw_only=True)
class FsdpTerms:
    """A data-parallel setup in PyTorch's words (FSDP2 first, FSDP1 names accepted)."""

    sharding: str = "FULL_SHARD"
    """FSDP1 ShardingStrategy name; FSDP2's reshard_after_forward True/False is FULL_SHARD/SHARD_GRAD_OP."""
    reshard_after_forward: int | None = None
    """FSDP2 int form: reshard to groups of this size after forward (hpZ-like)."""
    replicate: int = 1
    """HSDP: replicas of the shard group (a 2-D mesh), 1 = none."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy / FSDP1 CPUOffload(offload_params=True): params, grads and optimizer on CPU."""
    zero_redundancy_optimizer: bool = False
    """torch.distributed.optim.ZeroRedundancyOptimizer over DDP (ZeRO-1)."""
    param_dtype: str = "fp32"
    reduce_dtype: str | None = None
    clip_grad_norm: float | None = None
    gradient_accumulation_steps: int | None = None

    def __post_init__(self) -> None:
        if self.sharding not in FSDP1_STRATEGIES:
            raise ValueError(f"sharding {self.sharding!r} is not an FSDP strategy; use one of {', '.join(FSDP1_STRATEGIES)}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("bf16", "fp16", "fp32"):
                raise ValueError(f"{name}={value!r} is not accepted; use bf16, fp16 or fp32")

    def as_dict(self) -> dict:
        return asdict(self)


# --- DeepSpeed -> FSDP --------------------------------------------------------------------------

def _zero_section(config: dict) -> dict:
    if not isinstance(config, dict):
        raise ValueError("a DeepSpeed config must be a JSON object")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError("zero_optimization must be a JSON object")
    for key in zero:
        if key in REMOVED:
            raise ValueError(f"zero_optimization.{key} was removed in DeepSpeed 0.19.8 (deepspeedai/DeepSpeed#8489)")
        bare = key.removeprefix("stage3_")
        if key not in ZERO_KEYS and bare not in ZERO_KEYS:
            raise ValueError(f"unknown zero_optimization key {key!r}; accepted: {', '.join(sorted(ZERO_KEYS))}")
    return {key.removeprefix("stage3_") if key.removeprefix("stage3_") in FSDP_KNOBS else key: value
            for key, value in zero.items()}


def _stage(zero: dict) -> int:
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    return stage


def _device(zero: dict, key: str) -> str:
    block = zero.get(key) or {}
    if key == "offload_optimizer" and zero.get("cpu_offload"):
        return "cpu"
    if key == "offload_param" and zero.get("cpu_offload_param"):
        return "cpu"
    if not isinstance(block, dict):
        raise ValueError(f"zero_optimization.{key} must be a JSON object like {{\"device\": \"cpu\"}}")
    device = block.get("device", "none") or "none"
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"zero_optimization.{key}.device={device!r} is not accepted; use none, cpu or nvme")
    return device


def _precision(config: dict) -> str:
    bf16 = bool((config.get("bf16") or {}).get("enabled", False))
    fp16 = bool((config.get("fp16") or {}).get("enabled", False))
    if bf16 and fp16:
        raise ValueError("bf16.enabled and fp16.enabled are both true; enable at most one")
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def _stage_to_fsdp(stage: int, hpz: int) -> tuple[Mapping, dict]:
    if stage == 3 and hpz > 1:
        return (Mapping("stage=3, zero_hpz_partition_size=" + str(hpz), f"fully_shard(reshard_after_forward={hpz})",
                        APPROXIMATE, "hpZ keeps a secondary parameter shard per group after forward, like FSDP2 "
                        "resharding to a smaller world; hpZ also sends gradients over all ranks"),
                {"sharding": "FULL_SHARD", "reshard_after_forward": hpz})
    table = {
        0: (Mapping("stage=0", "DDP (FSDP1 NO_SHARD)", EXACT, "replicated parameters, all-reduced gradients"),
            {"sharding": "NO_SHARD"}),
        1: (Mapping("stage=1", "DDP + torch ZeroRedundancyOptimizer", APPROXIMATE, "shards optimizer state like "
                    "ZeRO-1 but all-reduces gradients and broadcasts parameters (~3 Psi per step, not 2 Psi); FSDP "
                    "has no ZeRO-1"), {"sharding": "NO_SHARD", "zero_redundancy_optimizer": True}),
        2: (Mapping("stage=2", "fully_shard(reshard_after_forward=False) (FSDP1 SHARD_GRAD_OP)", EXACT,
                    "gradients and optimizer state sharded, parameters gathered from forward to backward"),
            {"sharding": "SHARD_GRAD_OP"}),
        3: (Mapping("stage=3", "fully_shard(reshard_after_forward=True) (FSDP1 FULL_SHARD)", EXACT,
                    "parameters, gradients and optimizer state sharded; parameters gathered per unit"),
            {"sharding": "FULL_SHARD"}),
    }
    return table[stage]


def _offload_to_fsdp(stage: int, optimizer: str, params: str) -> tuple[list[Mapping], bool]:
    source = f"offload_optimizer.device={optimizer}, offload_param.device={params}"
    if optimizer == "none" and params == "none":
        return [], False
    if "nvme" in (optimizer, params):
        return [Mapping(source, "-", NONE, "FSDP has no NVMe offload")], False
    if params == "cpu" and optimizer == "cpu" and stage == 3:
        return [Mapping(source, "CPUOffloadPolicy(pin_memory=True) (FSDP1 CPUOffload(offload_params=True))",
                        APPROXIMATE, "same placement; FSDP2 steps with torch's CPU optimizer, 3-10x slower than "
                        "DeepSpeedCPUAdam (pytorch#74588)")], True
    return [Mapping(source, "-", NONE, "FSDP2 CPUOffloadPolicy moves parameters, gradients and optimizer state "
                    "together; there is no optimizer-only offload (pytorch PR #120256)")], False


def _knob_mappings(zero: dict, table: dict) -> list[Mapping]:
    out = []
    for key, value in zero.items():
        if key in table:
            kind, target, why = table[key]
            if kind == NONE and value in (False, None, 0, {}):
                kind, why = DROPPED, "off, as in the target"
            out.append(Mapping(f"{key}={value}", target, kind, why))
    return out


def _top_level(config: dict, precision: str, target: str) -> list[Mapping]:
    out = []
    if precision != "fp32":
        fp16 = precision == "fp16"
        out.append(Mapping(f"{precision}.enabled=true",
                           f"MixedPrecisionPolicy(param_dtype=torch.{'float16' if fp16 else 'bfloat16'})"
                           if target == "fsdp" else f"{precision}.enabled=true",
                           APPROXIMATE if fp16 and target == "fsdp" else EXACT,
                           "FSDP needs torch.amp.GradScaler for fp16 loss scaling" if fp16 and target == "fsdp"
                           else "same compute dtype, fp32 master weights"))
    for key, fsdp_name in (("communication_data_type", "MixedPrecisionPolicy(reduce_dtype=...)"),
                           ("gradient_clipping", "torch.nn.utils.clip_grad_norm_(max_norm)"),
                           ("gradient_accumulation_steps", "set_requires_gradient_sync(False) between boundaries"),
                           ("train_micro_batch_size_per_gpu", "your DataLoader batch size"),
                           ("train_batch_size", "micro-batch x accumulation x world size")):
        if key in config:
            out.append(Mapping(f"{key}={config[key]}", fsdp_name if target == "fsdp" else key, EXACT,
                               "same meaning"))
    for key in config:
        if key not in TOP_LEVEL:
            out.append(Mapping(key, "-", DROPPED, "not part of ZeRO: keep it in your training script"))
    return out


def deepspeed_to_fsdp(config: dict, *, allow_partial: bool = False) -> Translation:
    zero = _zero_section(config)
    stage, precision = _stage(zero), _precision(config)
    hpz = int(zero.get("zero_hpz_partition_size", 1) or 1)
    stage_mapping, terms = _stage_to_fsdp(stage, hpz)
    offload, cpu = _offload_to_fsdp(stage, _device(zero, "offload_optimizer"), _device(zero, "offload_param"))
    mappings = [stage_mapping, *offload, *_knob_mappings(zero, FSDP_KNOBS), *_top_level(config, precision, "fsdp")]
    reduce = config.get("communication_data_type")
    fsdp = FsdpTerms(**terms, cpu_offload=cpu, param_dtype=precision,
                     reduce_dtype=DTYPES.get(str(reduce)) if reduce else None,
                     clip_grad_norm=config.get("gradient_clipping"),
                     gradient_accumulation_steps=config.get("gradient_accumulation_steps"))
    result = Translation("deepspeed", "fsdp", tuple(mappings), fsdp.as_dict())
    return result if allow_partial else result.check()


# --- FSDP -> DeepSpeed --------------------------------------------------------------------------

def fsdp_to_deepspeed(terms: FsdpTerms, *, allow_partial: bool = False) -> Translation:
    mappings: list[Mapping] = []
    zero: dict = {}
    if terms.sharding in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") or terms.replicate > 1:
        mappings.append(Mapping(f"{terms.sharding}, replicate={terms.replicate}", "-", NONE,
                                "DeepSpeed has no HSDP: hpZ still shards optimizer state and gradients over all "
                                "ranks, and MiCS was removed in 0.19.8"))
        zero["stage"] = 3 if terms.sharding == "HYBRID_SHARD" else 2
    elif terms.zero_redundancy_optimizer:
        mappings.append(Mapping("DDP + ZeroRedundancyOptimizer", "stage=1", APPROXIMATE,
                                "ZeRO-1 reduce-scatters gradients and all-gathers parameters (2 Psi per step)"))
        zero["stage"] = 1
    elif terms.reshard_after_forward not in (None, 1) and terms.sharding == "FULL_SHARD":
        zero.update(stage=3, zero_hpz_partition_size=terms.reshard_after_forward)
        mappings.append(Mapping(f"reshard_after_forward={terms.reshard_after_forward}",
                                f"stage=3, zero_hpz_partition_size={terms.reshard_after_forward}", APPROXIMATE,
                                "hpZ keeps a secondary parameter shard of that size after forward"))
    else:
        zero["stage"] = STAGE_OF_STRATEGY[terms.sharding]
        mappings.append(Mapping(terms.sharding, f"stage={zero['stage']}", EXACT, "same sharded state"))
    if terms.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        mappings.append(Mapping("cpu_offload=True", "offload_optimizer (+ offload_param at stage 3) device=cpu",
                                APPROXIMATE if zero["stage"] != 3 else EXACT,
                                "DeepSpeed offloads parameters only at stage 3" if zero["stage"] != 3
                                else "same placement; DeepSpeedCPUAdam steps on the CPU"))
    config: dict = {"zero_optimization": zero}
    if terms.param_dtype != "fp32":
        config[terms.param_dtype] = {"enabled": True}
        mappings.append(Mapping(f"param_dtype={terms.param_dtype}", f"{terms.param_dtype}.enabled=true", EXACT,
                                "same compute dtype; DeepSpeed keeps fp32 masters as FSDP keeps fp32 sharded params"))
    for name, key in (("reduce_dtype", "communication_data_type"), ("clip_grad_norm", "gradient_clipping"),
                      ("gradient_accumulation_steps", "gradient_accumulation_steps")):
        value = getattr(terms, name)
        if value is not None:
            config[key] = value
            mappings.append(Mapping(f"{name}={value}", f"{key}={value}", EXACT, "same meaning"))
    result = Translation("fsdp", "deepspeed", tuple(mappings), config)
    return result if allow_partial else result.check()


# --- DeepSpeed <-> zerokit ---------------------------------------------------------------------

ZEROKIT_DROPS = {
    "allgather_bucket_size": "zerokit all-gathers parameters in its reduce buckets; set reduce_bucket_size",
    "round_robin_gradients": "copy scheduling",
    "elastic_checkpoint": "checkpoint detail", "load_from_fp32_weights": "checkpoint detail",
    "use_multi_rank_bucket_allreduce": "bucket merging", "allgather_partitions": "zerokit always all-gathers",
    "compute_grad_norm": "zerokit computes the global norm when clipping",
}


def _to_zerokit_mapping(key: str, value) -> Mapping:
    if key in ZEROKIT_SAME:
        return Mapping(f"{key}={value}", f"zero_optimization.{key}={value}", EXACT, "same key, same meaning")
    if key == "contiguous_gradients":
        ok = value is not False
        return Mapping(f"{key}={value}", f"zero_optimization.{key}={value}" if ok else "-", EXACT if ok else NONE,
                       "zerokit always does this" if ok else "zerokit cannot turn it off")
    if key in ("offload_optimizer", "offload_param"):
        device = (value or {}).get("device", "none") if isinstance(value, dict) else "none"
        if device in (None, "none"):
            return Mapping(f"{key}.device=none", "-", DROPPED, "no offload is zerokit's default")
        return Mapping(f"{key}.device={device}", "-", NONE,
                       "zerokit's engine does not offload yet (CPU/NVMe tiers are planned); use DeepSpeed for offload")
    if key in ZEROKIT_DROPS:
        return Mapping(f"{key}={value}", "-", DROPPED, ZEROKIT_DROPS[key])
    if key in FSDP_KNOBS and FSDP_KNOBS[key][0] == NONE and value not in (False, None, 0, {}):
        return Mapping(f"{key}={value}", "-", NONE, "zerokit has no " + key)
    if key == "zero_hpz_partition_size" and value not in (None, 1):
        return Mapping(f"{key}={value}", "-", NONE, "zerokit shards over one flat group (no hpZ)")
    return Mapping(f"{key}={value}", "-", DROPPED, "a DeepSpeed tuning knob zerokit sets itself")


def _whole(value):
    """5e8 read from JSON is a float; write it back as the element count it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def deepspeed_to_zerokit(config: dict, *, allow_partial: bool = False) -> Translation:
    zero = _zero_section(config)
    _stage(zero)
    precision = _precision(config)
    mappings = [_to_zerokit_mapping(key, value) for key, value in zero.items()]
    kept = {m.target.split(".")[1].split("=")[0] for m in mappings if m.kind == EXACT}
    out_zero = {key: _whole(value) for key, value in zero.items() if key in kept}
    out: dict = {"zero_optimization": out_zero}
    for key in TOP_LEVEL[1:]:
        if key in config:
            out[key] = config[key]
    mappings += _top_level(config, precision, "zerokit")
    result = Translation("deepspeed", "zerokit", tuple(mappings), out)
    return result if allow_partial else result.check()


def zerokit_to_deepspeed(config: dict, *, allow_partial: bool = False) -> Translation:
    """zerokit's keys are DeepSpeed's, except two of its own."""
    zero = dict(config.get("zero_optimization") or {})
    mappings = []
    if "reduce_bucket_bytes" in zero:
        raise ValueError("give reduce_bucket_size (elements) rather than reduce_bucket_bytes to translate; "
                         "the element size depends on communication_data_type")
    if zero.get("reduce_every_micro_step") is False:
        mappings.append(Mapping("reduce_every_micro_step=false", "-", NONE, "DeepSpeed ZeRO-2 reduces on every "
                                "micro-step; engine.coalesce_grad_reduction() is the nearest API"))
    zero.pop("reduce_every_micro_step", None)
    rest = {k: v for k, v in config.items() if k not in ("zero_optimization", "max_consecutive_skipped_steps")}
    if "max_consecutive_skipped_steps" in config:
        mappings.append(Mapping("max_consecutive_skipped_steps", "-", DROPPED, "DeepSpeed has no such check"))
    back = deepspeed_to_zerokit({**rest, "zero_optimization": zero}, allow_partial=True)
    mapped = [Mapping(m.target if m.kind == EXACT else m.source, m.source, m.kind, m.why) for m in back.mappings]
    result = Translation("zerokit", "deepspeed", tuple(mappings + mapped), back.config)
    return result if allow_partial else result.check()


# --- FSDP terms from the command line -----------------------------------------------------------

def _bool(text: str, key: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{key}={text!r} must be true or false")


def parse_fsdp_terms(terms: list[str]) -> FsdpTerms:
    """Words like FULL_SHARD, CPUOffload, ZeroRedundancyOptimizer, and key=value pairs:
    sharding_strategy, reshard_after_forward (true|false|int), cpu_offload, param_dtype,
    reduce_dtype, replicate, clip_grad_norm, gradient_accumulation_steps."""
    fields: dict = {}
    for term in terms:
        key, _, value = term.partition("=")
        word = key.strip()
        if not value:
            if word.upper() in FSDP1_STRATEGIES:
                fields["sharding"] = word.upper()
            elif word in ("CPUOffload", "CPUOffloadPolicy", "cpu_offload", "offload_params"):
                fields["cpu_offload"] = True
            elif word == "ZeroRedundancyOptimizer":
                fields.update(sharding="NO_SHARD", zero_redundancy_optimizer=True)
            else:
                raise ValueError(f"FSDP term {term!r} is not understood; accepted: {', '.join(FSDP1_STRATEGIES)}, "
                                 "CPUOffload, ZeroRedundancyOptimizer, or key=value")
            continue
        _parse_pair(word, value.strip(), fields)
    return FsdpTerms(**fields)


def _parse_pair(key: str, value: str, fields: dict) -> None:
    if key == "sharding_strategy":
        fields["sharding"] = value.upper().removeprefix("SHARDINGSTRATEGY.")
    elif key == "reshard_after_forward":
        if value.lower() in ("true", "false"):
            fields["sharding"] = "FULL_SHARD" if _bool(value, key) else "SHARD_GRAD_OP"
        elif value.isdigit() and int(value) > 0:
            fields.update(sharding="FULL_SHARD", reshard_after_forward=int(value))
        else:
            raise ValueError(f"reshard_after_forward={value!r} must be true, false or a positive integer")
    elif key in ("cpu_offload", "offload_params"):
        fields["cpu_offload"] = _bool(value, key)
    elif key in ("param_dtype", "reduce_dtype"):
        if value not in DTYPES:
            raise ValueError(f"{key}={value!r} is not accepted; use bf16, fp16 or fp32")
        fields[key] = DTYPES[value]
    elif key in ("replicate", "gradient_accumulation_steps"):
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{key}={value!r} must be a positive integer")
        fields[key] = int(value)
    elif key == "clip_grad_norm":
        fields[key] = float(value)
    else:
        raise ValueError(f"FSDP key {key!r} is not understood; accepted: sharding_strategy, reshard_after_forward, "
                         "cpu_offload, param_dtype, reduce_dtype, replicate, clip_grad_norm, "
                         "gradient_accumulation_steps")

