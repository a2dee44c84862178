"""`deepspeed.init_distributed` for zerokit: join the process group torchrun describes, or make a one-rank one
for a plain `python train.py`.

DeepSpeed's own launcher and its MPI discovery are out of scope (launch with `torchrun --nproc_per_node N`);
where DeepSpeed would look for MPI (no RANK/WORLD_SIZE in the environment), zerokit runs one process, as
zerokit.initialize does, and sets LOCAL_RANK to 0 unless it is set, as DeepSpeed's discovery would: its engine
requires it and scripts read it. (RANK and WORLD_SIZE are left unset: zerokit would read them as a launch.)
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from zerokit.comm.rendezvous import init_job_group

DEFAULT_TIMEOUT = timedelta(minutes=30)  # DeepSpeed's default_pg_timeout
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def backend_name() -> str:
    """What DeepSpeed's accelerator names as its communication back-end: NCCL on GPUs, gloo on the CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta = DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: object = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise torch.distributed unless it is already (DeepSpeed's semantics for dist_init_required: None
    initialises when needed, False requires it done already)."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("Distributed backend is not initialized. Please set dist_init_required to True or "
                           "initialize before calling deepspeed.initialize()")
    backend = dist_backend or backend_name()
    launched = all(name in os.environ for name in TORCHRUN_ENV) or init_method is not None
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if launched:
        if init_method is None and rank == world_size == -1:  # torchrun's environment alone
            init_job_group(backend, timeout)  # See [Note: a key space per attempt] in zerokit/comm/rendezvous.py
        else:
            dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank,
                                    world_size=world_size)
        return
    os.environ.setdefault("LOCAL_RANK", "0")  # what DeepSpeed's engine and scripts read; See the module docstring
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


__all__ = ["init_distributed", "backend_name"]
