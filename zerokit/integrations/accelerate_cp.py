"""accelerate's context parallelism (`ParallelismConfig(cp_size=N)`) on a zerokit engine: Ulysses in place of torch's
ring attention.

[Note: accelerate's cp_size runs as Ulysses on zerokit]
accelerate's context parallelism is FSDP2's: prepare() hooks the model for torch's `context_parallel` (ring attention
over the mesh's "cp" dimension), and `accelerator.maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers)`
(which the HF Trainer enters around every step when cp_size > 1) cuts the given tensors (input ids, labels, shift
labels, position ids) along their sequence dimension, in place, for the duration. accelerate counts every rank as a
data rank in its batch sizes, its loader gives the ranks of one cp group the same rows, and the gradients are averaged
over all ranks, so each rank's loss is over its own tokens and the average over ranks is the mean over the replicas of
each replica's token-mean (exactly, where each rank's loss is its tokens' sum over the replica's count times the
number of processes, as the Trainer computes it; the mean of the shards' means in a loop that takes `outputs.loss`,
as under FSDP2).
Under zerokit.deepspeed.install() with a DeepSpeed plugin, prepare() builds a zerokit engine over every rank (a plain
data-parallel one: the gradients to average are the same), so the same ParallelismConfig trains on zerokit at any ZeRO
stage once two things change, both here: `_prepare_cp` attaches zerokit's Ulysses attention to the model over the cp
group (accelerate's mesh puts cp inside the data dimensions, so a group is consecutive ranks, as zerokit's sequence
ranks are), and `maybe_context_parallel` cuts the buffers into contiguous pieces, in place as torch's does, restoring
on exit those not in no_restore_buffers. Ulysses needs contiguous pieces (its all-to-all joins them in rank order);
torch's ring attention instead gives each rank two chunks to balance causal work. Which tokens a rank holds does not
change the loss. torch 2.13's ring attention does not run on a CPU at all (no sharding rule for the CPU's attention
kernel); Ulysses runs anywhere gloo or NCCL does. An FSDP plugin keeps accelerate's own path: only an accelerator whose
engine is DeepSpeed's, zerokit's once installed, changes.
[Note: a cp group reads one replica's rows]
Under a DeepSpeed plugin accelerate 1.15 shards a loader by the mesh's tensor dimension only (data_loader.py's
DeepSpeed branch), so the ranks of a cp group would each read different rows and join pieces of different sequences
in attention, training wrong without a word; under FSDP2 the same code divides by the cp size too. So `_prepare_cp`,
which sees every prepare()'s arguments before accelerate's own preparation, prepares each loader itself, as
accelerate's prepare_data_loader would with the replicas (processes / cp) as its processes and this rank's replica
(rank // cp) as its index, and marks it prepared; accelerate then keeps it.

[Note: the Trainer's sdpa check]
Before it cuts a batch, transformers 5's Trainer (_prepare_context_parallel_inputs) refuses a model whose
`config._attn_implementation` is not "sdpa", the only attention torch's ring attention shards; it reads the config of
the model it trains, which under DeepSpeed is the engine, whose `config` is DeepSpeed's (an AttributeError on zerokit's,
and on DeepSpeed's dict). Ulysses wraps sdpa or eager and checks the model itself when it attaches (attention.py), so
for a zerokit engine the Trainer's check is handed an object without a config, which it skips; everything else it
does (shifted labels, position ids, the buffers it hands maybe_context_parallel) is unchanged.

accelerate offers no place to plug another context-parallel backend in (cp_backend accepts "torch" only), so
install() replaces Accelerator._prepare_cp when accelerate.accelerator is imported (at once where it already is);
`accelerate_cp_hooked` says whether it has. Nothing here imports torch or accelerate before they are used.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    import torch

ACCELERATOR_MODULE = "accelerate.accelerator"


def hook_accelerate_cp() -> None:
    """Have accelerate's context parallelism run as zerokit's Ulysses under a DeepSpeed plugin (See [Note:
    accelerate's cp_size runs as Ulysses on zerokit]): now where accelerate.accelerator is loaded, else when it is."""
    loaded = sys.modules.get(ACCELERATOR_MODULE)
    if loaded is not None:
        _replace_prepare_cp(loaded)
    elif not any(isinstance(finder, _PatchWhenImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchWhenImported())


def accelerate_cp_hooked() -> bool:
    loaded = sys.modules.get(ACCELERATOR_MODULE)
    return loaded is not None and getattr(loaded.Accelerator._prepare_cp, "zerokit_ulysses", False)


class _PatchWhenImported(importlib.abc.MetaPathFinder):
    """Finds accelerate.accelerator where the path finder does, and patches it once its body has run."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ACCELERATOR_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenPatch(spec.loader)
        return spec


class _ThenPatch(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _replace_prepare_cp(module)


def _replace_prepare_cp(module: Any) -> None:
    original = module.Accelerator._prepare_cp
    if getattr(original, "zerokit_ulysses", False):
        return

    @functools.wraps(original)
    def _prepare_cp(self: Any, *args: Any) -> Any:
        from accelerate.utils import DistributedType
        if self.distributed_type != DistributedType.DEEPSPEED:  # FSDP2's context parallelism, as accelerate runs it
            return original(self, *args)
        return ulysses_for_accelerate(self, args)

    _prepare_cp.zerokit_ulysses = True
    module.Accelerator._prepare_cp = _prepare_cp


def ulysses_for_accelerate(accelerator: Any, args: tuple) -> tuple:
    """What _prepare_cp does on zerokit: every model among `args` attached to Ulysses over the cp group (once), every
    loader prepared for the cp group, and the accelerator's context cutting buffers into this rank's piece."""
    from torch import nn
    from torch.utils.data import DataLoader

    _refuse_tensor_parallel(accelerator.parallelism_config)
    mesh = accelerator.torch_device_mesh["cp"]
    for model in args:
        if isinstance(model, nn.Module):
            _attach_once(model, mesh, say=accelerator.process_index == 0)
    accelerator._cp_context = functools.partial(cut_in_place, rank=mesh.get_local_rank(), ranks=mesh.size())
    _trainer_checks_no_ring_attention()
    return tuple(_one_loader_per_group(accelerator, arg, mesh.size()) if isinstance(arg, DataLoader) else arg
                 for arg in args)


def _refuse_tensor_parallel(config: Any) -> None:
    if config.tp_size > 1:
        raise ValueError(f"ParallelismConfig(cp_size={config.cp_size}, tp_size={config.tp_size}) under zerokit's "
                         "DeepSpeed drop-in: context parallelism composes with data parallelism (dp_shard_size, "
                         "dp_replicate_size) here; for tensor parallelism use the DeepSpeed config's "
                         "tensor_parallel.autotp_size beside sequence_parallel_size")


def _attach_once(model: Any, mesh: Any, say: bool) -> None:
    from zerokit._support.log import configure_logging, logger
    from zerokit.parallel.sequence.attention import STATE, attach

    if any(hasattr(module, STATE) for module in model.modules()):
        return  # a later prepare() of the same model
    attach(model, mesh.get_group(), mesh.size())
    if say:
        configure_logging()
        logger.info(f"accelerate cp_size={mesh.size()}: {type(model).__name__}'s attention runs as Ulysses over "
                    f"{mesh.size()} consecutive ranks (torch's ring attention is FSDP2's), each group reading one "
                    "replica's rows; ZeRO over all ranks")


def _trainer_checks_no_ring_attention() -> None:
    """The HF Trainer, where it is loaded, stops asking the engine for an sdpa config before it cuts a batch (See
    [Note: the Trainer's sdpa check])."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None:
        return
    original = trainer_module.Trainer._prepare_context_parallel_inputs
    if getattr(original, "zerokit_ulysses", False):
        return

    @functools.wraps(original)
    def _prepare_context_parallel_inputs(self: Any, model: Any, inputs: dict) -> Any:
        from zerokit.deepspeed.engine import DeepSpeedEngine
        return original(self, _NO_CONFIG if isinstance(model, DeepSpeedEngine) else model, inputs)

    _prepare_context_parallel_inputs.zerokit_ulysses = True
    trainer_module.Trainer._prepare_context_parallel_inputs = _prepare_context_parallel_inputs


_NO_CONFIG = object()  # what the Trainer's check is handed for a zerokit engine: nothing with a `config`


def _one_loader_per_group(accelerator: Any, loader: Any, ranks: int) -> Any:
    """`loader` prepared so that the `ranks` consecutive ranks of each cp group read the same rows (See [Note: a cp
    group reads one replica's rows])."""
    from accelerate.data_loader import prepare_data_loader

    if getattr(loader, "_is_accelerate_prepared", False):
        return loader
    prepared = prepare_data_loader(
        loader, accelerator.device, num_processes=accelerator.num_processes // ranks,
        process_index=accelerator.process_index // ranks, split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement, rng_types=accelerator.rng_types.copy(),
        dispatch_batches=accelerator.dispatch_batches, even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
    prepared._is_accelerate_prepared = True  # accelerate's own preparation, which follows, keeps it as it is
    return prepared


@contextmanager
def cut_in_place(buffers: Sequence[torch.Tensor] | None = None, buffer_seq_dims: Sequence[int] | None = None,
                 no_restore_buffers: set[torch.Tensor] | None = None, *, rank: int, ranks: int) -> Iterator[None]:
    """Each of `buffers` replaced, in place, by this rank's contiguous piece of it along its sequence dimension, for the
    duration; those not in `no_restore_buffers` whole again after (torch's context_parallel's contract)."""
    buffers, dims = list(buffers or []), list(buffer_seq_dims or [])
    if len(buffers) != len(dims):
        raise ValueError(f"maybe_context_parallel got {len(buffers)} buffer(s) and {len(dims)} sequence dimension(s): "
                         "give one dimension per buffer")
    kept = {id(buffer) for buffer in no_restore_buffers or ()}
    originals = [(buffer, buffer.clone()) for buffer in buffers if id(buffer) not in kept]
    for buffer, dim in zip(buffers, dims):
        piece = _piece(buffer, dim, rank, ranks).clone()
        buffer.resize_(piece.shape)
        buffer.copy_(piece)
    try:
        yield
    finally:
        for buffer, original in originals:
            buffer.resize_(original.shape)
            buffer.copy_(original)


def _piece(buffer: torch.Tensor, dim: int, rank: int, ranks: int) -> torch.Tensor:
    length = buffer.shape[dim]
    if length % ranks:
        raise ValueError(f"a sequence of {length} tokens does not split over cp_size={ranks} ranks: pad the sequences "
                         f"to a multiple of {ranks} (labels -100 on the padding)")
    size = length // ranks
    return buffer.narrow(dim, rank * size, size)
