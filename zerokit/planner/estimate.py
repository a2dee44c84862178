"""One configuration, estimated: memory per GPU and per node, communication, compute, step time.

`estimate()` is the pure function every other part of the planner calls; `plan()` (advice.py)
only chooses which configurations to estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zerokit.planner.calibration import Calibration
from zerokit.planner.catalogue import Cluster, make_cluster
from zerokit.planner.comms import CommEstimate, communication, exposed_seconds
from zerokit.planner.compute import ComputeEstimate, OffloadEstimate, compute_estimate, offload_estimate
from zerokit.planner.memory import HostUsage, MemoryBreakdown, RankParams, host_usage, memory_breakdown, rank_params
from zerokit.planner.models import ModelSpec, ParamCounts, param_counts, resolve_model
from zerokit.planner.spec import Assumptions, Layout, Offload, Policy, Trainable, Training, splits_heads

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Scenario:
    """Everything fixed by the question: the model, the machines, how training runs."""

    model: ModelSpec
    cluster: Cluster
    training: Training = field(default_factory=Training)
    layout: Layout = field(default_factory=Layout)
    assumptions: Assumptions = field(default_factory=Assumptions)
    calibration: Calibration | None = None
    """Measured activations and transients of this model (zerokit plan --calibrate); None: the formulas."""

    def __post_init__(self) -> None:
        self.layout.dp_shard(self.cluster.world)  # raises if the world does not fit the layout
        self.cluster.peak_flops(self.training.precision)  # raises if the GPU lacks the dtype
        arch = self.model.architecture
        if arch is not None and arch.max_positions and self.training.seq_len > arch.max_positions:
            raise ValueError(f"seq len {self.training.seq_len} exceeds {self.model.name}'s "
                             f"{arch.max_positions} learned positions; use at most {arch.max_positions}")
        if self.layout.tp > 1 and arch is not None and arch.n_heads % self.layout.tp:
            raise ValueError(f"tp={self.layout.tp} does not divide {arch.n_heads} attention heads")
        if self.layout.sp > 1 and arch is not None and not splits_heads(arch, self.layout.sp):
            raise ValueError(f"sp={self.layout.sp} does not split {arch.n_heads} attention heads and "
                             f"{arch.n_kv_heads} key/value heads (it must divide the first, and divide or be a "
                             "multiple of the second)")
        if self.training.seq_len % self.layout.sp:
            raise ValueError(f"sp={self.layout.sp} does not divide the sequence length {self.training.seq_len}")
        self._check_experts()
        if self.layout.pp > 1 and arch is not None and self.layout.pp > arch.n_layers:
            raise ValueError(f"pp={self.layout.pp} exceeds the model's {arch.n_layers} layers")
        param_counts(self.model, self.training.trainable)  # raises for LoRA without shapes

    def _check_experts(self) -> None:
        """An expert degree needs a mixture of experts it divides (See [Note: the expert degree] in memory.py)."""
        ep, arch = self.layout.ep, self.model.architecture
        if ep == 1:
            return
        if arch is None or arch.experts is None:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model (a preset such as mixtral-8x7b, or a "
                             "Mixtral/Qwen-MoE/DeepSeekMoE config.json); this one has no experts")
        if arch.experts.count % ep:
            raise ValueError(f"ep={ep} does not divide the {arch.experts.count} experts; use a divisor of them")

    @property
    def shard(self) -> int:
        return self.layout.dp_shard(self.cluster.world)

    @property
    def counts(self) -> ParamCounts:
        return param_counts(self.model, self.training.trainable)

    @property
    def rank(self) -> RankParams:
        return rank_params(self.counts, self.model, self.layout, self.shard, self.training.persistence_threshold)

    def with_training(self, **changes) -> Scenario:
        return replace(self, training=replace(self.training, **changes))


@dataclass(frozen=True)
class Estimate:
    scenario: Scenario
    stage: int
    offload: Offload
    memory: MemoryBreakdown
    capacity: int
    """GPU memory, bytes."""
    usable: int
    """capacity x (1 - headroom)."""
    host: HostUsage
    comm: CommEstimate
    compute: ComputeEstimate
    offload_time: OffloadEstimate
    exposed_comm_seconds: float

    @property
    def training(self) -> Training:
        return self.scenario.training

    @property
    def fits_gpu(self) -> bool:
        return self.memory.total <= self.usable

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.host.fits

    @property
    def step_seconds(self) -> float:
        """Compute, the GPU optimizer step, plus whatever communication and offload cannot hide."""
        return (self.compute.seconds + self.compute.optimizer_seconds + self.exposed_comm_seconds
                + self.offload_time.exposed_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Whole job: every data-parallel replica's tokens per step / step time."""
        layout, world = self.scenario.layout, self.scenario.cluster.world
        replicas = world // (layout.tp * layout.pp * layout.sp)  # the sequences read per micro-step
        return self.training.tokens_per_micro_batch * self.training.grad_accum * replicas / self.step_seconds

    @property
    def hybrid(self) -> str:
        """The hybrid sharding this stage runs with ("mics", "hpz" or ""): MiCS at stage 0 shards nothing, so it is
        plain data parallel over every rank there."""
        hybrid = self.scenario.layout.hybrid
        return "" if hybrid == "mics" and self.stage == 0 else hybrid

    @property
    def mode(self) -> str:
        """ZeRO-s, and the hybrid sharding it runs with: MiCS over s ranks, or hpZ's k; and its tensor degree."""
        layout, shard = self.scenario.layout, self.scenario.shard
        hybrid = {"mics": f" + MiCS s={shard}", "hpz": f" + hpZ k={layout.secondary}", "": ""}[self.hybrid]
        tensor = f" + tp={layout.tp}" if layout.tp > 1 else ""
        sequence = f" + sp={layout.sp}" if layout.sp > 1 else ""
        experts = f" + ep={layout.ep}" if layout.ep > 1 else ""
        held = " (gathered once per step)" if self.training.gathers_once_per_step(self.stage, layout) else ""
        return f"ZeRO-{self.stage}{hybrid}{tensor}{sequence}{experts}{held}"

    @property
    def label(self) -> str:
        parts = [self.mode, self.offload.name]
        parts.append("full checkpointing" if self.training.checkpointing == "full" else "no checkpointing")
        return ", ".join(parts)


def _validate(scenario: Scenario, stage: int, offload: Offload) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    if offload.optimizer != "none" and stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 keeps a full optimizer per rank)")
    if offload.params != "none" and stage != 3:
        raise ValueError(f"parameter offload needs stage 3 (parameters are only sharded there); got stage {stage}")
    if scenario.layout.secondary > 1 and stage != 3:
        raise ValueError(f"hpZ (a secondary copy of the parameters over {scenario.layout.secondary} ranks) needs "
                         f"stage 3, where parameters are sharded; got stage {stage}")


def estimate(scenario: Scenario | None = None, stage: int = 3, offload: Offload | None = None, *,
             headroom: float | None = None, **scenario_kwargs) -> Estimate:
    """Estimate one configuration. Give a Scenario, or make_scenario()'s keyword arguments."""
    scenario = scenario or make_scenario(**scenario_kwargs)
    offload = offload or Offload()
    headroom = Policy().headroom if headroom is None else Policy(headroom=headroom).headroom
    _validate(scenario, stage, offload)
    cluster, training, layout, assume = scenario.cluster, scenario.training, scenario.layout, scenario.assumptions
    rank = scenario.rank
    memory = memory_breakdown(scenario.model, rank, training, layout, stage, offload, assume, scenario.calibration)
    host = host_usage(rank, training, offload, cluster.gpus_per_node, cluster.host.ram, cluster.host.nvme_capacity,
                      headroom, assume)
    comm = communication(scenario.model, rank, training, layout, stage, cluster, assume.bandwidth_efficiency)
    compute = compute_estimate(scenario.model, scenario.counts, rank, training, layout, stage, offload, cluster,
                               assume.mfu, assume.bandwidth_efficiency, assume.optimizer_seconds_per_element)
    offload_time = offload_estimate(rank, training, stage, offload, cluster, assume.bandwidth_efficiency, compute)
    exposed = exposed_seconds(comm, compute.forward_seconds, compute.backward_seconds, training.grad_accum)
    capacity = cluster.gpu.memory
    return Estimate(scenario=scenario, stage=stage, offload=offload, memory=memory, capacity=capacity,
                    usable=int(capacity * (1 - headroom)), host=host, comm=comm, compute=compute,
                    offload_time=offload_time, exposed_comm_seconds=exposed)


def make_scenario(model: ModelSpec | str | int | float = "llama2-13b", *, gpu: str = "a100-80gb",
                  gpus_per_node: int = 8, nodes: int = 1, precision: str = "bf16", optimizer: str = "adamw",
                  seq_len: int | None = None, micro_batch: int = 1, grad_accum: int = 1,
                  checkpointing: str = "none", attention: str = "flash", reduce_dtype: str = "fp32",
                  bucket_bytes: int | None = None, overlap_comm: bool = True, reduce_every_micro_step: bool = True,
                  trainable_fraction: float = 1.0, lora_rank: int | None = None,
                  lora_targets: tuple[str, ...] | None = None, tp: int = 1, pp: int = 1, replicas: int = 1,
                  secondary: int = 1, sp: int = 1, ep: int = 1, tiles: int = 1,
                  mfu: float | None = None, bandwidth_efficiency: float | None = None,
                  overhead_bytes: int | None = None, backend: str = "nccl", reduce_scatter: bool | None = None,
                  calibration: Calibration | None = None, optimizer_seconds_per_element: float | None = None,
                  **cluster_overrides) -> Scenario:
    """A Scenario from plain values: catalogue keys, preset names, numbers (bytes, bytes/s, seconds).
    `seq_len` defaults to the model's context, capped at 2048. `cluster_overrides` go to make_cluster."""
    spec = resolve_model(model)
    if lora_targets and lora_rank is None:
        raise ValueError("lora targets need a lora rank (--lora-rank)")
    trainable = Trainable(fraction=trainable_fraction, lora_rank=lora_rank,
                          **({"lora_targets": tuple(lora_targets)} if lora_targets else {}))
    seq_len = seq_len if seq_len is not None else min(spec.context or 2048, 2048)
    training = Training(precision=precision, optimizer=optimizer, seq_len=seq_len,
                        micro_batch=micro_batch, grad_accum=grad_accum, checkpointing=checkpointing,
                        attention=attention, reduce_dtype=reduce_dtype,
                        **({"bucket_bytes": bucket_bytes} if bucket_bytes is not None else {}),
                        overlap_comm=overlap_comm, reduce_every_micro_step=reduce_every_micro_step,
                        backend=backend, reduce_scatter=reduce_scatter, trainable=trainable, tiles=tiles)
    defaults = Assumptions()
    assumptions = Assumptions(mfu=defaults.mfu if mfu is None else mfu,
                              bandwidth_efficiency=(defaults.bandwidth_efficiency if bandwidth_efficiency is None
                                                    else bandwidth_efficiency),
                              overhead_bytes=defaults.overhead_bytes if overhead_bytes is None else overhead_bytes,
                              optimizer_seconds_per_element=optimizer_seconds_per_element)
    cluster = make_cluster(gpu, gpus_per_node=gpus_per_node, nodes=nodes, **cluster_overrides)
    layout = Layout(tp=tp, pp=pp, replicas=replicas, secondary=secondary, sp=sp, ep=ep)
    return Scenario(model=spec, cluster=cluster, training=training, layout=layout,
                    assumptions=assumptions, calibration=calibration)
