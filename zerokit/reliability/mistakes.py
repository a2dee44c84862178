"""Mistakes a user makes that would otherwise train wrong without a word: each gets one line saying what is wrong
and what to do, at `initialize` or at the next `backward()`.

[Note: what is fixed at initialize]
`initialize` decides, once, which parameters train: they get fp32 masters, optimizer state, a place in the
gradient buckets and, at stage 3, a shard. A parameter frozen afterwards would keep moving (its optimizer
state and weight decay still step it); one unfrozen afterwards would never train (it has none of those) while
its `.grad` grows. So the set of requires_grad flags is recorded at start and compared at every backward
(one pass over the parameters' flags: a few microseconds for hundreds of tensors).
"""

from __future__ import annotations


from torch import nn

WRAPPED = "zerokit.initialize got a model wrapped in {kind}{where}: {why}; pass the plain module ({how})"


def refuse_wrapped(model: nn.Module) -> None:
    """A model (or a submodule) already wrapped for data parallelism: DDP's hooks would all-reduce the gradients
    zerokit reduces, FSDP and DeepSpeed shard what zerokit shards."""
    for name, module in model.named_modules():
        wrapper = _wrapper(module)
        if wrapper is not None:
            kind, why, how = wrapper
            raise ValueError(WRAPPED.format(kind=kind, where=f" (at {name!r})" if name else "", why=why, how=how))
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):
            raise ValueError(WRAPPED.format(kind="deepspeed.zero.Init", where=f" ({name!r} is partitioned by it)",
                                            why="DeepSpeed already partitions its parameters",
                                            how="build it without deepspeed.zero.Init; for sharded construction "
                                                "build it under torch.device('meta') with stage 3"))
        if type(param).__name__ == "DTensor" or type(param.data).__name__ == "DTensor":
            raise ValueError(WRAPPED.format(kind="DTensor parameters", where=f" ({name!r})",
                                            why="FSDP2 or tensor parallelism already shards them",
                                            how="build it without fully_shard / parallelize_module"))


def _wrapper(module: nn.Module) -> tuple[str, str, str] | None:
    """(what it is, why zerokit cannot train it, how to get the plain module), or None."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    again = "its hooks would synchronise the gradients zerokit already reduces, a second time"
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return "torch DistributedDataParallel", again, "ddp_model.module"
    if isinstance(module, nn.DataParallel):
        return "torch DataParallel", again, "dp_model.module"
    if isinstance(module, FullyShardedDataParallel):
        return "FSDP (FullyShardedDataParallel)", "it shards the parameters zerokit shards", "build it without FSDP"
    if isinstance(module, FSDPModule):
        return "FSDP2 (fully_shard)", "it shards the parameters zerokit shards", "build it without fully_shard"
    if any(cls.__name__ == "DeepSpeedEngine" and cls.__module__.startswith("deepspeed")
           for cls in type(module).__mro__):
        return "a DeepSpeed engine", "it reduces and shards what zerokit does", "deepspeed_engine.module"
    return None


def refuse_nothing_to_train(model: nn.Module) -> None:
    if not any(param.requires_grad for param in model.parameters()):
        count = sum(1 for _ in model.parameters())
        raise ValueError(f"the model has no parameter with requires_grad=True ({count} frozen): zerokit has nothing "
                         "to train; unfreeze the parameters to train before zerokit.initialize (for inference "
                         "alone, use the model without zerokit)")


class TrainableGuard:
    """requires_grad as it was at initialize, checked at every backward (See [Note: what is fixed at initialize])."""

    def __init__(self, model: nn.Module) -> None:
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.flags = [param.requires_grad for param in self.params]

    def check(self) -> None:
        now = [param.requires_grad for param in self.params]
        if now == self.flags:
            return
        name, trains = next((n, f) for n, f, was in zip(self.names, now, self.flags) if f != was)
        if trains:
            what = ("unfrozen (requires_grad set to True) after zerokit.initialize, which fixed what trains: it has "
                    "no master weight, optimizer state or gradient bucket, so it would never train")
        else:
            what = ("frozen (requires_grad set to False) after zerokit.initialize, which fixed what trains: its "
                    "optimizer state and weight decay would keep moving it")
        raise RuntimeError(f"parameter {name!r} was {what}; set requires_grad before zerokit.initialize, or "
                           "initialize a new engine after changing it")


def refuse_misnumbered_node(ranks_per_node: int, node: int | None, rank: int) -> None:
    """torchrun's GROUP_RANK (`node`, None where the nodes do not come from torchrun's LOCAL_WORLD_SIZE: See
    SafeguardSettings.node_rank) must be the node that consecutive numbering gives this rank (rank // ranks_per_node):
    otherwise the bytes counted as crossing nodes, and MiCS's shard groups, would not be the nodes the job runs on (See
    [Note: hybrid sharding])."""
    if node is None:
        return
    if node != rank // ranks_per_node:
        raise ValueError(f"rank {rank} runs on node {node} (torchrun's GROUP_RANK) but consecutive numbering "
                         f"puts it on node {rank // ranks_per_node} of {ranks_per_node} ranks; give each node's ranks "
                         "consecutive numbers (torchrun --node_rank), or set ranks_per_node in the config")


def check_backward_order(backward_since_step: bool, window_ended: bool, accumulation: int) -> None:
    """A backward after the one that ended an accumulation window, with no step() between them, would add a
    second micro-step's gradients into the step (its norm, its update) without a word."""
    if backward_since_step and window_ended:
        raise RuntimeError(f"engine.backward() was called again after the backward that ended an accumulation window "
                           f"(gradient_accumulation_steps={accumulation}) without engine.step() in between; call "
                           "engine.step() after every engine.backward() (it steps the optimizer only at accumulation "
                           "boundaries), or raise gradient_accumulation_steps to accumulate more micro-steps")
