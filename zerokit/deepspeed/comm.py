"""`deepspeed.comm` for zerokit: `import zerokit.deepspeed.comm as dist` where a script has
`import deepspeed.comm as dist`.

The same functions and signatures, over torch.distributed: these are the script's own collectives (a metric
averaged over ranks, a barrier), not the engine's, so they are neither routed through zerokit's counted
Communicator nor shown in engine.comm_stats(). DeepSpeed's logging arguments (`prof`, `log_name`, `debug`)
are accepted and have no effect; comms_logger in the config reports the engine's own collectives.
`log_summary()` logs what every live engine's collectives moved so far.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from zerokit.deepspeed.distributed import init_distributed
from zerokit._support.log import logger

ReduceOp = torch_dist.ReduceOp


def is_initialized() -> bool:
    return torch_dist.is_initialized()


def is_available() -> bool:
    return torch_dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    torch_dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    return torch_dist.new_group(ranks)


def get_world_group() -> Any:
    return torch_dist.group.WORLD


def get_rank(group: Any = None) -> int:
    return torch_dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return torch_dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node: LOCAL_RANK, as torchrun (and DeepSpeed's launcher) set it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return torch_dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return torch_dist.get_process_group_ranks(group or torch_dist.group.WORLD)


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None,
            **prof_log_name_debug: Any) -> Any:
    return torch_dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False,
                      **prof_log_name_debug: Any) -> Any:
    return torch_dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               **prof_log_name_debug: Any) -> Any:
    return torch_dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           **prof_log_name_debug: Any) -> Any:
    return torch_dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              **prof_log_name_debug: Any) -> Any:
    return torch_dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               **prof_log_name_debug: Any) -> Any:
    return torch_dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, **prof_log_name_debug: Any) -> Any:
    return torch_dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, **prof_log_name_debug: Any) -> Any:
    return torch_dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, **prof_log_name_debug: Any) -> Any:
    return torch_dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False,
                      **prof_log_name_debug: Any) -> Any:
    return torch_dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                        async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, **prof_log_name_debug: Any) -> Any:
    return torch_dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, **prof_log_name_debug: Any) -> Any:
    return torch_dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **prof_log_name_debug: Any) -> None:
    torch_dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
         **prof_log_name_debug: Any) -> int:
    return torch_dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **prof_log_name_debug: Any) -> Any:
    return torch_dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
          **prof_log_name_debug: Any) -> Any:
    return torch_dist.irecv(tensor, src, group=group, tag=tag)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    torch_dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, **prof_log_name_debug: Any) -> None:
    torch_dist.all_gather_object(object_list, obj, group=group)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """What the collectives of every live zerokit engine moved since it started, logged on rank 0 (DeepSpeed
    logs its comms logger's records here); return_dict: returned instead, by engine."""
    from zerokit.deepspeed.engine import live_engines

    summary = {f"engine {index}": engine.comm_stats() for index, engine in enumerate(live_engines())}
    if return_dict:
        return summary
    if get_rank() == 0:
        for name, stats in summary.items():
            for kind, count in stats.items():
                if count["calls"]:
                    logger.info(f"{name} {kind}: {count['calls']} calls, {count['elements']:,} elements, "
                                f"{count['bytes']:,} bytes")
    return None


__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "destroy_process_group", "new_group",
           "get_world_group", "get_rank", "get_world_size", "get_local_rank", "get_global_rank",
           "get_all_ranks_from_group", "barrier", "monitored_barrier", "all_reduce", "reduce", "broadcast",
           "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single",
           "gather", "scatter", "send", "recv", "isend", "irecv", "broadcast_object_list", "all_gather_object",
           "log_summary"]
