"""Real DeepSpeed as the tests' peer, without the C++ op it compiles at every start on a CPU and training never calls.

    import zerokit.testing.deepspeed_peer                      # in a process, before deepspeed.init_distributed()
    Job(name, argv, preload=("zerokit.testing.deepspeed_peer",))  # a job of zerokit.testing.jobs
    python -m zerokit.testing.deepspeed_peer script.py args...   # an unchanged script, as `python script.py args...`
    torchrun --standalone --nproc_per_node 2 -m zerokit.testing.deepspeed_peer script.py args...

Importing this module imports deepspeed and replaces `deepspeed.comm.torch.build_shm_op` with a function that
returns None; run as a command, it then runs the script (`-m module args...`: the module) as `python` would.

[Note: DeepSpeed's shared-memory all-reduce, not built for a peer]
DeepSpeed 0.19.8's TorchBackend, made by every `deepspeed.init_distributed()` (and so by `deepspeed.initialize`,
accelerate's and the HF Trainer's DeepSpeed paths), calls `build_shm_op()` on a CPU: it JIT-compiles its
shared-memory all-reduce (deepspeed_shm_comm) into TORCH_EXTENSIONS_DIR, 30-90 s of both cores on a new
environment (the build depends on the environment's paths, so a fresh clone's first peer run pays it), then about
0.5 s to load in every process after. Training never calls that op: its one user is `inference_all_reduce`
(DeepSpeed's AutoTP layers, deepspeed/module_inject/layers.py), which, when the op is absent
(`shm_comm_op is None`, no `torch.ops.deepspeed.inference_all_reduce_`), falls back to
`torch.distributed.all_reduce` with the same op: the same sum. So a peer DeepSpeed run in the tests trains
exactly as it does without this module, and no test builds or loads the op.

[Note: a peer ends once its script has]
A DeepSpeed 0.19.8 run on a CPU sometimes aborts after its script has finished and written its results, in the
interpreter's teardown ("terminate called without an active exception": a native thread still joinable while its
owner is destroyed; seen in the AutoTP peer and in bench_integrations' ZeRO-2 round), which torchrun reports as the
job failing. What a test compares is the script's output, so a peer run as a command ends once the script returns:
its process group destroyed, its output flushed, then os._exit(0). A script that raised or exited with a status still
ends with it (nothing here runs then).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch.distributed as dist

from zerokit._support.extras import MissingExtra, installed, missing_message
from zerokit._support.run_script import run_as_python

if not installed("deepspeed"):  # the module IS the peer: refused in one line naming the extra
    raise MissingExtra(missing_message("deepspeed", "zerokit.testing.deepspeed_peer"))

# The module itself: the attribute `deepspeed.comm.torch` is the torch package (deepspeed/comm/__init__.py's
# `from .comm import *` rebinds the name after the submodule's import), so setting build_shm_op on it changes nothing
TORCH_BACKEND = importlib.import_module("deepspeed.comm.torch")

USAGE = "usage: python -m zerokit.testing.deepspeed_peer (script.py | -m module) [args...]"


def no_shm_op() -> None:
    """DeepSpeed's build_shm_op, without building: no op (See [Note: DeepSpeed's shared-memory all-reduce, not
    built for a peer])."""
    return None


TORCH_BACKEND.build_shm_op = no_shm_op


def end_without_teardown() -> None:
    """After the script ran to its end: its group destroyed, its output flushed, and the process gone without
    interpreter teardown (See [Note: a peer ends once its script has])."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_as_python(sys.argv[1:], USAGE)
    end_without_teardown()
