"""DeepSpeed `zero_optimization` <-> FSDP (FSDP2 `fully_shard`, FSDP1 names) <-> zerokit.

Every key becomes a `Mapping` that says what it turns into and why, with one of four kinds:
exact (same semantics), approximate (same intent, different mechanics: the `why` says how),
dropped (a tuning knob the target sets by construction) and none (a semantic feature the target
lacks). A translation with any `none` mapping raises ValueError naming each one, unless the caller
asks for the partial result (the CLI prints the table, then the error).

DeepSpeed configs are read by zerokit.config.dsconfig, as the engine reads them: the same keys, aliases, coercion
("false" is false) and refusals; what zerokit does with each key is the schema's class, so the zerokit
direction needs no table of its own. FSDP has one (FSDP_KNOBS), checked against the schema by the tests.

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
from typing import Any

from zerokit.config.defaults import DEFAULT_BUCKET_BYTES
from zerokit.config.dsconfig import SCHEMA, AUTO, DeepSpeedConfig, KeyClass, read
from zerokit.config.dsconfig.auto import resolve
from zerokit.config.dsconfig.precision import compute_dtype
from zerokit.config.dsconfig.schema_zero import UNPREFIXED
from zerokit.config.dsconfig.values import to_dtype, whole

EXACT, APPROXIMATE, DROPPED, NONE = "exact", "approximate", "dropped", "none"
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
STAGE_OF_STRATEGY = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
Z = "zero_optimization."
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# zero_optimization keys in FSDP terms: short name (stage-3 keys without their stage3_ prefix, as FSDP users
# know them) -> (kind, FSDP counterpart, why). Offload blocks and the stage are mapped on their own.
FSDP_KNOBS = {
    "reduce_bucket_size": (DROPPED, "-", "FSDP2 reduce-scatters one fully_shard unit at a time: choose units"),
    "reduce_bucket_bytes": (DROPPED, "-", "FSDP2 reduce-scatters one fully_shard unit at a time: choose units"),
    "allgather_bucket_size": (DROPPED, "-", "FSDP2 all-gathers one fully_shard unit at a time"),
    "contiguous_gradients": (DROPPED, "-", "FSDP2 reduce-scatters into preallocated per-unit buffers"),
    "reduce_scatter": (DROPPED, "-", "FSDP2 always reduce-scatters"),
    "allgather_partitions": (DROPPED, "-", "FSDP2 always all-gathers"),
    "use_multi_rank_bucket_allreduce": (DROPPED, "-", "no bucket merging in FSDP2"),
    "overlap_comm": (APPROXIMATE, "implicit", "FSDP2 always overlaps communication on separate streams"),
    "reduce_every_micro_step": (APPROXIMATE, "set_requires_gradient_sync(False) between boundaries",
                                "false accumulates unsharded gradients locally, as FSDP2 does without sync"),
    "prefetch_bucket_size": (APPROXIMATE, "set_modules_to_forward_prefetch",
                             "FSDP2 prefetches the next unit by itself; the setter prefetches more"),
    "max_live_parameters": (APPROXIMATE, "FSDP1 limit_all_gathers=True", "FSDP2 keeps at most two units gathered"),
    "max_reuse_distance": (DROPPED, "-", "FSDP2 reshards every unit after use"),
    "param_persistence_threshold": (APPROXIMATE, "module choice",
                                    "leave small modules out of units; the root unit keeps them gathered"),
    "model_persistence_threshold": (DROPPED, "-", "no global persistence budget in FSDP2"),
    "module_granularity_threshold": (APPROXIMATE, "module choice", "choose which modules get a fully_shard call"),
    "stage3_unit_classes": (APPROXIMATE, "fully_shard(module) per instance", "one unit per module of these classes"),
    "stage3_min_unit_params": (APPROXIMATE, "module choice", "choose which modules get a fully_shard call"),
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
    "mics_shard_size": (APPROXIMATE, "fully_shard(mesh=init_device_mesh(..., (N // s, s))) (HSDP)",
                        "shard over s ranks, replicate across N/s; FSDP2 all-reduces across replicas every "
                        "micro-step unless set_requires_all_reduce(False) until the boundary"),
    "mics_hierarchical_params_gather": (DROPPED, "-", "a speed choice of MiCS's all-gather"),
}
MAPPED_WITH_THE_STAGE = ("stage", "zero_hpz_partition_size")
"""Mapped by _stage_to_fsdp (and the offload blocks by _offload_to_fsdp), not by FSDP_KNOBS."""
FSDP_TOP_LEVEL = {
    "communication_data_type": "MixedPrecisionPolicy(reduce_dtype=...)",
    "gradient_clipping": "torch.nn.utils.clip_grad_norm_(max_norm)",
    "gradient_accumulation_steps": "set_requires_gradient_sync(False) between boundaries",
    "train_micro_batch_size_per_gpu": "your DataLoader batch size",
    "train_batch_size": "micro-batch x accumulation x world size",
}


def short_name(path: str) -> str:
    """A zero_optimization key as FSDP_KNOBS and the tables name it: DeepSpeed's stage3_ prefix dropped
    where DeepSpeed accepts the key without it."""
    name = path.removeprefix(Z)
    bare = name.removeprefix("stage3_")
    return bare if bare in UNPREFIXED else name


def _read(config: dict, *, resolved: bool) -> DeepSpeedConfig:
    """The config as the engine reads it, refusals collected. resolved: "auto" filled in where no context is
    needed (FSDP needs values); otherwise "auto" stays "auto", which zerokit reads and DeepSpeed users write."""
    if not isinstance(config, dict):
        raise ValueError("a DeepSpeed config must be a JSON object")
    read_config = read(config, refuse=False)
    if not resolved:
        return read_config
    values = resolve(read_config).config.values
    return DeepSpeedConfig(values, read_config.spelled, read_config.notes, read_config.refusals)


def _value(value: Any) -> Any:
    return "auto" if value is AUTO else whole(value)


def _text(value: Any) -> str:
    """A value in a mapping row: as Python prints it, 5e8 as the element count it is."""
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e4:
        value = int(value)
    value = "auto" if value is AUTO else value
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _leaves(config: DeepSpeedConfig) -> list[tuple[str, Any, str | None]]:
    """(path, value, refusal message or None) for every key given, in the order read."""
    out = [(path, value, None) for path, value in config.values.items()]
    return out + [(r.path, r.value, r.message) for r in config.refusals]


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
            raise ValueError(f"sharding {self.sharding!r} is not an FSDP strategy; "
                             f"use one of {', '.join(FSDP1_STRATEGIES)}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("bf16", "fp16", "fp32"):
                raise ValueError(f"{name}={value!r} is not accepted; use bf16, fp16 or fp32")

    def as_dict(self) -> dict:
        return asdict(self)


# --- DeepSpeed -> FSDP --------------------------------------------------------------------------

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


def _knob_mappings(config: DeepSpeedConfig) -> list[Mapping]:
    out = []
    for path, value, _ in _leaves(config):
        name = short_name(path)
        if not path.startswith(Z) or name in MAPPED_WITH_THE_STAGE or name.startswith("offload_"):
            continue
        kind, target, why = FSDP_KNOBS[name]
        if kind == NONE and value in (False, None, 0, {}):
            kind, why = DROPPED, "off, as in the target"
        out.append(Mapping(f"{name}={_text(value)}", target, kind, why))
    return out


def _top_level(config: DeepSpeedConfig, precision: str, target: str) -> list[Mapping]:
    """Precision, clipping, accumulation and batch sizes in FSDP's terms; the rest is not part of ZeRO."""
    out = []
    if precision != "fp32":
        fp16 = precision == "fp16"
        out.append(Mapping(f"{precision}.enabled=true",
                           f"MixedPrecisionPolicy(param_dtype=torch.{'float16' if fp16 else 'bfloat16'})",
                           APPROXIMATE if fp16 else EXACT,
                           "FSDP needs torch.amp.GradScaler for fp16 loss scaling" if fp16
                           else "same compute dtype, fp32 master weights"))
    for key, fsdp_name in FSDP_TOP_LEVEL.items():
        if config.given(key):
            out.append(Mapping(f"{key}={_text(config.get(key))}", fsdp_name, EXACT, "same meaning"))
    seen = {"zero_optimization", "bf16", "fp16", *FSDP_TOP_LEVEL}
    for path, _, _ in _leaves(config):
        top = path.partition(".")[0]
        if top not in seen:
            seen.add(top)
            out.append(Mapping(top, "-", DROPPED, f"not part of ZeRO: keep it in your training script ({target} "
                                                  "has no such setting)"))
    return out


def _hpz(config: DeepSpeedConfig) -> int:
    for path, value, _ in _leaves(config):
        if path == Z + "zero_hpz_partition_size":
            return max(1, int(value))
    return 1


def deepspeed_to_fsdp(config: dict, *, allow_partial: bool = False) -> Translation:
    read_config = _read(config, resolved=True)
    stage, precision = read_config.get(Z + "stage"), compute_dtype(read_config)
    stage_mapping, terms = _stage_to_fsdp(stage, _hpz(read_config))
    offload, cpu = _offload_to_fsdp(stage, read_config.get(Z + "offload_optimizer.device"),
                                    read_config.get(Z + "offload_param.device"))
    mappings = [stage_mapping, *offload, *_knob_mappings(read_config), *_top_level(read_config, precision, "fsdp")]
    accumulation = read_config.get("gradient_accumulation_steps", None)
    fsdp = FsdpTerms(**terms, cpu_offload=cpu, param_dtype=precision,
                     reduce_dtype=read_config.get("communication_data_type"),
                     clip_grad_norm=read_config.get("gradient_clipping", None),
                     gradient_accumulation_steps=None if accumulation is AUTO else accumulation)
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

def _to_zerokit_mapping(path: str, value: Any, refusal: str | None, spelled: str) -> tuple[Mapping, bool]:
    """How zerokit reads one key (the schema's class), and whether the zerokit config keeps it."""
    source = f"{short_name(spelled) if spelled.startswith(Z) else spelled}={_text(value)}"
    if spelled.rpartition(".")[2].startswith("cpu_offload"):  # a legacy switch, read as a block's key
        source = f"{spelled.removeprefix(Z)}=True"
    if refusal is not None:
        return Mapping(source, "-", NONE, refusal), False
    key = SCHEMA.get(path)
    klass = key.klass if key is not None else KeyClass.HONOURED  # optimizer/scheduler params: by type
    target = f"{path}={_text(value)}"
    if klass == KeyClass.HONOURED:
        return Mapping(source, target, EXACT, "same key, same meaning"), True
    if klass == KeyClass.ZEROKIT:
        return Mapping(source, target, EXACT, "zerokit's own key"), True
    if klass == KeyClass.ALWAYS and key.accepts:
        return Mapping(source, target, EXACT, "zerokit always does this"), True
    if klass == KeyClass.ALWAYS:
        return Mapping(source, "-", DROPPED, key.note), False
    return Mapping(source, "-", DROPPED, "off, as in zerokit"), False  # a refused key holding a value that asks nothing


def _nested(values: dict[str, Any]) -> dict:
    """Leaf paths back into JSON objects."""
    out: dict = {}
    for path, value in values.items():
        *blocks, name = path.split(".")
        node = out
        for block in blocks:
            node = node.setdefault(block, {})
        node[name] = list(value) if isinstance(value, tuple) else _value(value)
    return out


def deepspeed_to_zerokit(config: dict, *, allow_partial: bool = False) -> Translation:
    """zerokit reads DeepSpeed's keys: what it honours is kept as written (aliases under their key), what it
    always does is kept or dropped with the reason, and what it refuses has no equivalent."""
    read_config = _read(config, resolved=False)
    compute_dtype(read_config)  # both precisions on is an error here too
    mappings, kept = [], {Z + "stage": read_config.get(Z + "stage")}
    for path, value, refusal in _leaves(read_config):
        mapping, keep = _to_zerokit_mapping(path, value, refusal, read_config.spelling(path))
        mappings.append(mapping)
        if keep:
            kept[path] = value
    result = Translation("deepspeed", "zerokit", tuple(mappings), _nested(kept))
    return result if allow_partial else result.check()


ZEROKIT_ONLY = {
    "max_consecutive_skipped_steps": (DROPPED, "DeepSpeed has no such check"),
    "comm_timeout_seconds": (DROPPED, "pass timeout= to deepspeed.init_distributed instead"),
    "broadcast_buffers": (APPROXIMATE, "DeepSpeed broadcasts buffers once at initialize, not before every forward"),
    Z + "stage3_unit_classes": (DROPPED, "DeepSpeed gathers parameters module by module through its own hooks; "
                                         "zero_optimization.leaf_module.classes is the nearest control"),
    Z + "stage3_min_unit_params": (DROPPED, "DeepSpeed gathers parameters module by module through its own hooks"),
}


def _from_zerokit_mapping(path: str, value: Any, config: DeepSpeedConfig) -> tuple[Mapping, dict]:
    """A zerokit-only key in DeepSpeed's terms, and what it adds to the DeepSpeed config."""
    source = f"{path}={_text(value)}"
    if path == Z + "reduce_every_micro_step":
        if value is False:
            return Mapping(source, "-", NONE, "DeepSpeed ZeRO-2 reduces on every micro-step; "
                           "engine.coalesce_grad_reduction() is the nearest API"), {}
        return Mapping(source, "-", DROPPED, "DeepSpeed ZeRO-2 reduces on every micro-step"), {}
    if path == Z + "reduce_bucket_bytes":
        size = ELEMENT_BYTES[config.get("communication_data_type") or "fp32"]
        elements = max(1, value // size)
        return (Mapping(source, f"reduce_bucket_size={elements}", EXACT if value % size == 0 else APPROXIMATE,
                        f"{size}-byte elements of communication_data_type (zerokit's default bucket is "
                        f"{DEFAULT_BUCKET_BYTES} bytes)"), {Z + "reduce_bucket_size": elements})
    kind, why = ZEROKIT_ONLY[path]
    return Mapping(source, "-", kind, why), {}


def zerokit_to_deepspeed(config: dict, *, allow_partial: bool = False) -> Translation:
    """zerokit's keys are DeepSpeed's, except its own (KeyClass.ZEROKIT), which map here one by one."""
    read_config = _read(config, resolved=False)
    if read_config.given(Z + "reduce_bucket_size") and read_config.given(Z + "reduce_bucket_bytes"):
        raise ValueError("give reduce_bucket_size (elements, DeepSpeed) or reduce_bucket_bytes, not both")
    mappings, out = [], {}
    for path, value, refusal in _leaves(read_config):
        key = SCHEMA.get(path)
        if refusal is not None:
            mappings.append(Mapping(f"{path}={_text(value)}", "-", NONE, refusal))
        elif key is not None and key.klass == KeyClass.ZEROKIT:
            mapping, added = _from_zerokit_mapping(path, value, read_config)
            mappings.append(mapping)
            out.update(added)
        else:
            mappings.append(Mapping(f"{path}={_text(value)}", f"{path}={_text(value)}", EXACT,
                                    "same key, same meaning"))
            out[path] = value
    result = Translation("zerokit", "deepspeed", tuple(mappings), _nested({Z + "stage": read_config.get(Z + "stage"),
                                                                           **out}))
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
        try:
            fields[key] = to_dtype(value, key)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not accepted; use bf16, fp16 or fp32") from None
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

