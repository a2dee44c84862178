"""The contenders: one function each, from a freshly built fp32 model to a `Trainer`.

To add one, write a function
`(model, settings) -> Trainer` and decorate it with `@contender(name, stage=..., family=...)`. The
harness does the rest for every contender alike: process group, seed, data, warm-up, timing, peak
RSS, the loss check, and the table's ratios against the other contenders of the same stage.

A builder receives the model on every rank with identical weights (same seed) and must build the
optimizer with `make_optimizer` (torch AdamW, the same hyperparameters for all) so that the
contenders differ only in how they distribute the work.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.accounting import optimizer_state_tensors, storage_bytes
from benchmarks.workload import (DTYPES, OPTIMIZERS, BenchSettings, adamw_hyperparameters, make_optimizer,
                                 muon_hyperparameters, optimizer_groups)
from zerokit.comm.process import default_device


class Trainer(NamedTuple):
    """What the harness drives. One training step is `step(backward(loss(forward(tokens))))`."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    """(B, T) tokens -> (B, T, vocab) logits, in the contender's compute precision."""
    backward: Callable[[torch.Tensor], object]
    """Backward of the loss, with the contender's gradient reduction."""
    step: Callable[[], object]
    """Optimizer step and whatever the contender does after it; gradients are ready for the next step."""
    state_bytes: Callable[[], dict[str, int]]
    """Model-state bytes this rank holds: parameters, gradients, optimizer_state."""


@dataclass(frozen=True)
class Contender:
    name: str
    stage: int  # the ZeRO stage it implements; 0 is plain data parallelism
    family: str  # "zerokit" for ours; a peer's family is shown next to its name
    build: Callable[[nn.Module, BenchSettings], Trainer]
    requires: str | None = None  # a module imported before the memory baseline; skipped if absent
    install: str = ""  # how to get `requires`
    dtypes: tuple[str, ...] = DTYPES
    note: str = ""  # how it was configured, shown under the table
    prepare: Callable[[], None] | None = None
    """Per-process set-up run before the memory baseline, like the harness's own process group:
    communication back-ends, not model state."""
    optimizers: tuple[str, ...] = ("adamw",)  # the --optimizer settings it can run
    single_process: bool = False
    """Runs in one process on every rank's batch stacked (union_batch): the reference a distributed step
    must equal, not a peer to race."""

    @property
    def is_zerokit(self) -> bool:
        return self.family == "zerokit"

    def why_skipped(self, dtype: str) -> str | None:
        if self.requires is not None and find_spec(self.requires) is None:
            return f"{self.requires} is not installed; `{self.install}` to include it"
        if dtype not in self.dtypes:
            return f"{self.name} does not support --dtype {dtype}"
        return None

    def why_not_optimizer(self, optimizer: str) -> str | None:
        return None if optimizer in self.optimizers else f"{self.name} does not run --optimizer {optimizer}"


CONTENDERS: list[Contender] = []


def contender(name: str, *, stage: int, family: str, requires: str | None = None, install: str = "",
              dtypes: tuple[str, ...] = DTYPES, note: str = "", prepare: Callable[[], None] | None = None,
              optimizers: tuple[str, ...] = ("adamw",), single_process: bool = False):
    """Register a builder; contenders run, and are listed, in registration order."""
    def register(build: Callable[[nn.Module, BenchSettings], Trainer]):
        CONTENDERS.append(Contender(name, stage, family, build, requires, install, dtypes, note, prepare, optimizers,
                                    single_process))
        return build
    return register


# --- zerokit ------------------------------------------------------------------------------------

def zerokit_trainer(model: nn.Module, settings: BenchSettings, stage: int, offload: str = "none") -> Trainer:
    """zerokit at `stage`; offload="cpu" puts the optimizer (and at stage 3 the parameters) in pinned host memory."""
    import zerokit

    zero = {"stage": stage, "reduce_bucket_bytes": settings.bucket_bytes}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": offload, "pin_memory": True}
    config = {"zero_optimization": zero, "bf16": {"enabled": settings.dtype == "bf16"}}
    engine = zerokit.initialize(model, make_optimizer(model, settings), config)
    return Trainer(engine, engine.backward, engine.step, engine.memory_stats)


for _stage in range(4):  # zerokit-0 .. zerokit-3 (a partial of a module-level function pickles to the ranks)
    contender(f"zerokit-{_stage}", stage=_stage, family="zerokit", optimizers=OPTIMIZERS)(
        functools.partial(zerokit_trainer, stage=_stage))


# --- torch --------------------------------------------------------------------------------------

TORCH_NOTE = ("gradient_as_bucket_view=True (gradients live in DDP's buckets, no second copy); "
              "--dtype bf16 runs torch.autocast (fp32 parameters), torch's own mixed precision")


def _ddp(model: nn.Module, settings: BenchSettings) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=settings.bucket_bytes / 2**20, gradient_as_bucket_view=True)


def _torch_trainer(ddp: nn.Module, optimizer: Any, local_optimizer: Any, settings: BenchSettings) -> Trainer:
    """`optimizer`: one or a list; `local_optimizer` is the one whose state this rank holds
    (ZeroRedundancyOptimizer's `.optim`)."""
    params = list(ddp.module.parameters() if hasattr(ddp, "module") else ddp.parameters())
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=settings.dtype == "bf16"):
            return ddp(tokens)

    def step() -> None:
        for each in optimizers:
            each.step()
            each.zero_grad(set_to_none=False)  # zero the bucket views in place, as DDP intends

    def state_bytes() -> dict[str, int]:
        locals_ = local_optimizer if isinstance(local_optimizer, list) else [local_optimizer]
        return storage_bytes(params, [p.grad for p in params], [optimizer_state_tensors(o) for o in locals_])

    return Trainer(forward, torch.Tensor.backward, step, state_bytes)


@contender("torch-ddp", stage=0, family="torch", note=TORCH_NOTE, optimizers=OPTIMIZERS)
def torch_ddp(model: nn.Module, settings: BenchSettings) -> Trainer:
    optimizer = make_optimizer(model, settings)
    return _torch_trainer(_ddp(model, settings), optimizer, optimizer, settings)


@contender("single-process", stage=0, family="reference", optimizers=OPTIMIZERS, single_process=True,
           note="one process on every rank's batch stacked, plain torch: the step a distributed one must equal")
def single_process(model: nn.Module, settings: BenchSettings) -> Trainer:
    optimizer = make_optimizer(model, settings)
    return _torch_trainer(model, optimizer, optimizer, settings)


@contender("torch-zero-opt", stage=1, family="torch",
           note="torch.distributed.optim.ZeroRedundancyOptimizer(AdamW) over DDP (which all-reduces the gradients)")
def torch_zero_redundancy_optimizer(model: nn.Module, settings: BenchSettings) -> Trainer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _ddp(model, settings)
    optimizer = ZeroRedundancyOptimizer(optimizer_groups(model), optimizer_class=torch.optim.AdamW,
                                        **adamw_hyperparameters(settings))
    return _torch_trainer(ddp, optimizer, optimizer.optim, settings)


FSDP2_NOTE = ("fully_shard on every transformer block, then the root (torchtitan's recipe); --dtype bf16: "
              "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), fp32 sharded parameters as masters")


@contender("fsdp2", stage=3, family="torch", note=FSDP2_NOTE)
def fsdp2(model: nn.Module, settings: BenchSettings) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(default_device().type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=settings.compute_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = make_optimizer(model, settings)
    params = list(model.parameters())

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()  # FSDP2's gradients are sharded DTensors, freed between steps

    def state_bytes() -> dict[str, int]:
        return storage_bytes([_local(p) for p in params], [_local(p.grad) for p in params],
                             [_local(t) for t in optimizer_state_tensors(optimizer)])

    return Trainer(model, torch.Tensor.backward, step, state_bytes)


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (what this rank holds); a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# --- DeepSpeed ----------------------------------------------------------------------------------

DEEPSPEED_NOTE = ("client optimizer torch AdamW (zero_allow_untested_optimizer), gloo, gradient_clipping=0, "
                  "reduce_bucket_size = allgather_bucket_size = bucket bytes / gradient element size")


def _deepspeed_comm() -> None:
    """DeepSpeed adopts the harness's gloo group. On CPU this also loads and initialises its
    shared-memory all-reduce op (about 5 MiB of RSS here), a cost of the back-end, not of ZeRO."""
    import deepspeed

    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))  # its engine still reads these
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    with contextlib.redirect_stdout(io.StringIO()):  # "DeepSpeed ... shm_comm_op built successfully"
        deepspeed.init_distributed(dist_backend=dist.get_backend() if dist.is_initialized() else "gloo")


def _deepspeed(model: nn.Module, settings: BenchSettings, stage: int) -> Trainer:
    import deepspeed

    bucket_numel = settings.bucket_bytes // (2 if settings.dtype == "bf16" else 4) // 2 * 2  # it wants an even count
    config = {
        "train_micro_batch_size_per_gpu": settings.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket_numel,
                              "allgather_bucket_size": bucket_numel, "overlap_comm": True,
                              "contiguous_gradients": True},
        "bf16": {"enabled": settings.dtype == "bf16"},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told; the other contenders do not clip
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**30,
    }
    if settings.optimizer == "muon":  # DeepSpeed's own Muon: its config block, parameters tagged by its rule
        muon = muon_hyperparameters(settings)
        config["zero_optimization"]["reduce_scatter"] = False  # its stage 3 refuses Muon with reduce-scatter
        config["optimizer"] = {"type": "Muon", "params": {
            "muon_lr": muon["lr"], "momentum": muon["momentum"], "adam_lr": settings.lr,
            "betas": list(adamw_hyperparameters(settings)["betas"]), "weight_decay": muon["weight_decay"]}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=optimizer_groups(model), config=config)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, settings), config=config)
    zero = engine.optimizer  # DeepSpeed's ZeRO optimizer: flat groups, fp32 partitions, the inner AdamW
    params = list(engine.module.parameters())
    ipg = [bucket.buffer for bucket in getattr(zero, "ipg_buckets", {}).values()]
    if stage == 3:  # DeepSpeedZeroOptimizer_Stage3: partitioned 16-bit flats, a flat gradient partition
        held_params = [zero.fp16_partitioned_groups_flat, params]
        masters = zero.fp32_partitioned_groups_flat
        grads = [zero.grad_partitions_flat_buffer, zero.averaged_gradients]
    else:  # DeepSpeedZeroOptimizer (stages 1-2)
        held_params = [zero.bit16_groups_flat, params]
        masters = zero.single_partition_of_fp32_groups  # this rank's fp32 partition (a copy, even in fp32)
        grads = [zero.averaged_gradients, getattr(zero, "grads_in_partition", None)]

    def state_bytes() -> dict[str, int]:
        return storage_bytes(
            parameters=held_params,
            gradients=[[p.grad for p in params], [m.grad for m in masters], *grads, ipg],
            optimizer_state=[masters, optimizer_state_tensors(zero.optimizer)])

    return Trainer(engine, engine.backward, engine.step, state_bytes)


@contender("deepspeed-1", stage=1, family="deepspeed", requires="deepspeed", install="pip install deepspeed",
           note=DEEPSPEED_NOTE, prepare=_deepspeed_comm, optimizers=OPTIMIZERS)
def deepspeed_stage1(model: nn.Module, settings: BenchSettings) -> Trainer:
    return _deepspeed(model, settings, stage=1)


@contender("deepspeed-2", stage=2, family="deepspeed", requires="deepspeed", install="pip install deepspeed",
           note=DEEPSPEED_NOTE, prepare=_deepspeed_comm, optimizers=OPTIMIZERS)
def deepspeed_stage2(model: nn.Module, settings: BenchSettings) -> Trainer:
    return _deepspeed(model, settings, stage=2)


@contender("deepspeed-3", stage=3, family="deepspeed", requires="deepspeed", install="pip install deepspeed",
           note=DEEPSPEED_NOTE, prepare=_deepspeed_comm, optimizers=OPTIMIZERS)
def deepspeed_stage3(model: nn.Module, settings: BenchSettings) -> Trainer:
    return _deepspeed(model, settings, stage=3)
