"""Process group and device: torchrun's environment, or one plain process."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def ensure_process_group() -> None:
    """Join the group torchrun describes (NCCL with CUDA, gloo on CPU), or make a 1-rank group of the
    same back-end so that a plain `python train.py` runs the same code path as a launched job."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one plain process on a GPU machine trains on its GPU too
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def default_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def log_rank0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)
