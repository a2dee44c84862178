"""`deepspeed.pipe` on zerokit: PipelineModule, LayerSpec, TiedLayerSpec and the topologies, as DeepSpeed 0.19.8
defines them; deepspeed.initialize(model=PipelineModule(...)) returns a PipelineEngine (zerokit/deepspeed/
pipe_engine.py) that trains it with torch's 1F1B schedule and a zerokit engine per stage, at ZeRO 0-3.

[Note: a PipelineModule builds what DeepSpeed's builds]
A script's weights must be the ones DeepSpeed would train, so the module consumes the random stream as DeepSpeed's
does: partition_method="parameters" builds every LayerSpec once to count its parameters, then each rank builds
only its own stage's layers, in order (with seed_layers, each after seeding base_seed + its index); tied modules
are built where first met on the stage. The partition is DeepSpeed's own arithmetic (partition_uniform, and
partition_balanced's dynamic programme), so the same layers land on the same stage. Ranks are numbered as
PipeDataParallelTopology numbers them, which is zerokit.Layout's order: the module resolves the job's Layout once
and its grid (and the engine) ask that Layout for every group.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from zerokit.parallel.mesh import Layout
from zerokit.comm.process import ensure_process_group


class LayerSpec:
    """A layer built only on the stage that owns it: typename(*module_args, **module_kwargs)."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` weights are one tensor on every stage that holds a spec of `key`."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class ProcessTopology:
    """DeepSpeed's topology of named axes, the last innermost (a rank's coordinates and back)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        self.axes, self.dims = list(axes), list(dims)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 1

    def world_size(self) -> int:
        size = 1
        for dim in self.dims:
            size *= dim
        return size


class PipeDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data", "model"], [num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """DeepSpeed's grid (engine.grid, engine.mpu) answered from the job's zerokit Layout: this rank's stage and
    replica, and the process groups of its pipeline and its data replicas (made here, every group on every rank)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.global_rank = dist.get_rank()
        self.stage_id, self.data_parallel_id, _ = layout.coordinates(self.global_rank)
        self.pipe_parallel_size, self.data_parallel_size, self.model_parallel_size = (layout.pipeline, layout.data, 1)
        self.world_size = layout.world_size
        self.dp_group = layout.group_of(layout.data_groups(), self.global_rank)
        self.pp_group = layout.group_of(layout.pipeline_groups(), self.global_rank)
        self.dp_proc_group = _own_group(layout.data_groups(), self.global_rank)
        self.pp_proc_group = _own_group(layout.pipeline_groups(), self.global_rank)

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp_proc_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_slice_parallel_rank(self) -> int:
        return 0

    def get_slice_parallel_world_size(self) -> int:
        return 1

    def get_global_rank(self) -> int:
        return self.global_rank

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1


def _own_group(groups: list[list[int]], rank: int) -> dist.ProcessGroup:
    """This rank's group of `groups`; every group is made on every rank, in order (torch's new_group is a
    collective over the job)."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


class PipelineModule(nn.Module):
    """DeepSpeed's PipelineModule: `layers` (modules, LayerSpecs, TiedLayerSpecs, callables) cut into `num_stages`
    stages; this rank holds and runs its stage's. See [Note: a PipelineModule builds what DeepSpeed's builds]."""

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: list[str] | None = None,
                 dynamic_shape: bool = False) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")
        ensure_process_group()
        self.loss_fn, self.seed_layers, self.seed_fn, self.base_seed = loss_fn, seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or _checkpoint
        self.checkpointable_layers = checkpointable_layers
        self.num_stages = topology.get_dim("pipe") if topology is not None else num_stages
        self.layout = _layout_of(self.num_stages, topology)
        self._grid = PipelineParallelGrid(self.layout)
        self.stage_id = self._grid.stage_id
        self._layer_specs = list(layers)
        self.parts = partition(self._layer_specs, self.num_stages, partition_method)
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self.micro_offset = 0
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Callable] = []
        self._build()
        self.tied_weights = self._index_tied_modules()  # See [Note: a tied weight's gradient across stages]

    def _index_tied_modules(self) -> list["TiedWeight"]:
        """Each tied key held by more than one stage: a group per replica over those stages (made on every rank, in
        DeepSpeed's order: keys sorted, then replicas), and this rank's copies of its weights."""
        from zerokit.pipeline.tied import TiedWeight
        mine = []
        for key, stages in sorted(self.tied_keys_by_stage().items()):
            if len(stages) < 2:
                continue
            for replica in range(self.layout.data):
                ranks = [self.layout.rank_of(stage, replica) for stage in stages]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    module = self.tied_modules[key]
                    mine += [TiedWeight(key, _recursive_getattr(module, attr), group, ranks)
                             for attr in self.tied_weight_attrs[key]]
        return mine

    def _build(self) -> None:
        for layer_idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[layer_idx]
            if self.seed_layers:
                (self.seed_fn or _set_random_seed)(self.base_seed + layer_idx)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                tied = self.tied_modules[layer.key]
                self.forward_funcs.append(tied if layer.forward_fn is None else partial(layer.forward_fn, tied))
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.forward_funcs.append(module)
                self.add_module(str(layer_idx), module)
            else:
                self.forward_funcs.append(layer)  # a plain callable (a lambda): no parameters

    def forward(self, *inputs: Any) -> Any:
        """This stage's layers in order, from `forward_input` (one tensor, or a tuple that torch's schedule passes as
        several arguments); with activation_checkpoint_interval, every run of that many layers (with parameters, or
        of the checkpointable_layers classes) is recomputed in backward."""
        forward_input = inputs[0] if len(inputs) == 1 else inputs
        self.micro_offset += 1
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run_layers(0, len(self.forward_funcs), forward_input)
        x = forward_input
        for start in range(0, len(self.forward_funcs), interval):
            end = min(start + interval, len(self.forward_funcs))
            inputs = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(self.forward_funcs[start:end]):
                x = self.activation_checkpoint_func(partial(self._run_layers_unpacked, start, end), *inputs)
            else:
                x = self._run_layers_unpacked(start, end, *inputs)
        return x

    def _run_layers_unpacked(self, start: int, end: int, *inputs: Any) -> Any:
        return self._run_layers(start, end, inputs[0] if len(inputs) == 1 else inputs)

    def _run_layers(self, start: int, end: int, x: Any) -> Any:
        offset = self.micro_offset + 1
        for index, layer in enumerate(self.forward_funcs[start:end]):
            if self.seed_layers:  # DeepSpeed's per-micro-batch seed (dropout masks)
                (self.seed_fn or _set_random_seed)(self.base_seed * offset + start + index + self._local_start)
            x = layer(x)
        return x

    def _is_checkpointable(self, funcs: list[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and next(f.parameters(), None) is not None for f in funcs)

    def topology(self) -> ProcessTopology:
        return PipeDataParallelTopology(self.layout.pipeline, self.layout.data)

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, layer_idx: int) -> int:
        return next(stage for stage in range(self.num_stages) if self.parts[stage] <= layer_idx < self.parts[stage + 1])

    def tied_keys_by_stage(self) -> dict[str, list[int]]:
        """Each tied key, and the stages that hold a layer of it, in order."""
        stages: dict[str, list[int]] = {}
        for index, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                owner = self.stage_owner(index)
                if owner not in stages.setdefault(layer.key, []):
                    stages[layer.key].append(owner)
        return stages


def _recursive_getattr(module: nn.Module, name: str) -> Any:
    for part in name.split("."):
        module = getattr(module, part)
    return module


def _checkpoint(function: Callable, *args: Any) -> Any:
    from zerokit.deepspeed.checkpointing import checkpoint
    return checkpoint(function, *args)


def _set_random_seed(seed: int) -> None:
    """DeepSpeed's ds_utils.set_random_seed: python's, numpy's and torch's generators."""
    import random

    import numpy
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def _layout_of(num_stages: int, topology: ProcessTopology | None) -> Layout:
    if topology is not None and topology.get_dim("model") != 1:
        raise ValueError(f"a pipeline topology with a model (tensor) axis of {topology.get_dim('model')} is not "
                         "supported by zerokit; accepted: PipeDataParallelTopology(num_pp, num_dp)")
    world = dist.get_world_size()
    if not isinstance(num_stages, int) or num_stages < 1 or world % num_stages:
        raise ValueError(f"num_stages ({num_stages}) must divide the world size ({world}): accepted: a divisor of "
                         f"{world}")
    if topology is not None and topology.world_size() != world:
        raise ValueError(f"the topology has {topology.world_size()} ranks but the job has {world}")
    return Layout.resolve(world, pipeline=num_stages)


# --- DeepSpeed's partition arithmetic (runtime/utils.py and PipelineModule._partition_layers) -------------------
def partition(specs: list[Any], num_stages: int, method: str) -> list[int]:
    """The first layer of every stage, and the end: DeepSpeed's `parts`."""
    if len(specs) < num_stages:
        raise ValueError(f"{num_stages} pipeline stages for {len(specs)} layers: every stage needs a layer; accepted: "
                         f"at most {len(specs)} stages")
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(specs), num_stages)
    if method == "parameters":
        return partition_balanced([_trainable_count(spec) for spec in specs], num_stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if (name := _layer_name(spec)) is not None and pattern.search(name) else 0 for spec in specs]
        if not any(weights):
            raise ValueError(f"partition_method {method!r} matches no layer's class name; the layers are "
                             f"{sorted({n for n in map(_layer_name, specs) if n})}")
        return partition_balanced(weights, num_stages)
    raise ValueError(f"partition_method {method!r} is not supported; accepted: 'parameters', 'uniform', "
                     "'type:<regex>'")


def _trainable_count(spec: Any) -> int:
    module = spec.build() if isinstance(spec, LayerSpec) else spec  # built once to count, as DeepSpeed does
    if not isinstance(module, nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _layer_name(spec: Any) -> str | None:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", None)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """DeepSpeed's linear partition: the split whose heaviest and lightest parts differ least (its dynamic
    programme, ties broken as it breaks them)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                high, low = max(dp_max[k][j - 1], part), min(dp_min[k][j - 1], part)
                if cost[i][j] >= high - low:
                    cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = high - low, high, low, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineParallelGrid", "partition_balanced", "partition_uniform"]
