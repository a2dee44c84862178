"""A job that comes back at another world size (issue 33, item 6): its batch sizes come from DeepSpeed's `elasticity`
block, so the global batch (12 sequences) is the same at every world size the block allows and only the micro-batch
and accumulation change; each step's 12 sequences are the same whoever trains them (sequence i of step s, split over
ranks and micro-steps); it resumes from its checkpoint directory on start and saves every --save-every steps.
Launched by tests/test_restart_ranks.py:

    torchrun --standalone --nproc_per_node 3 resize_job.py --out DIR --kill-at 7     # rank 2 dies after step 7
    torchrun --standalone --nproc_per_node 2 resize_job.py --out DIR                 # the node lost for good

--kill-at K: in a 3-rank launch, rank 2 SIGKILLs itself right after step K (noting the time in DIR/killed_at).
Rank 0 writes DIR/result_<world size>.json: the step it resumed from, the batch sizes the block chose (global,
micro-batch, accumulation), the final weights (fp32, by name), and the seconds from its start (DIR/launched_at, set
by the test; else the process start) to the end of its first step."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

import zerokit
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups

ELASTICITY = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [1, 2], "min_gpus": 1, "max_gpus": 4,
              "version": 0.1}
STARTED = time.time()


def global_batch(step: int, size: int) -> torch.Tensor:
    """The step's sequences, the same at every world size: (size, 17) tokens."""
    return torch.randint(0, 67, (size, 17), generator=torch.Generator().manual_seed(1000 + step))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--stage", type=int, default=2)
    return parser.parse_args()


def build(stage: int) -> zerokit.Engine:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    config = {"zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "elasticity": ELASTICITY}
    optimizer = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))  # tests/test_parity.py's
    return zerokit.initialize(model, optimizer, config)


def train_step(engine: zerokit.Engine, step: int, rank: int, world_size: int) -> None:
    """One optimizer step over the global batch: micro-step m of rank r trains sequences (m x ranks + r) x micro on."""
    micro, windows = engine.config.train_micro_batch_size_per_gpu, engine.config.gradient_accumulation_steps
    tokens = global_batch(step, engine.config.train_batch_size)
    for micro_step in range(windows):
        first = (micro_step * world_size + rank) * micro
        mine = tokens[first:first + micro]
        engine.backward(lm_loss(engine(mine[:, :-1]), mine))
        engine.step()


def main(args: argparse.Namespace, rank: int, world_size: int) -> None:
    out, checkpoints = Path(args.out), Path(args.out) / "checkpoints"
    engine = build(args.stage)
    start = 0
    if (checkpoints / "latest").exists():
        engine.load_checkpoint(checkpoints)
        start = engine.progress.optimizer_step
    first_step_done = None
    for step in range(start, args.steps):
        train_step(engine, step, rank, world_size)
        first_step_done = first_step_done or time.time()
        if rank == 2 and step + 1 == args.kill_at:
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % args.save_every == 0:
            engine.save_checkpoint(checkpoints)
    weights = {name: value.tolist() for name, value in engine.full_state_dict().items()}
    if rank == 0:
        launched = out / "launched_at"
        began = float(launched.read_text()) if launched.exists() else STARTED
        config = engine.config
        (out / f"result_{world_size}.json").write_text(json.dumps(
            {"resumed_from": start, "weights": weights, "seconds_to_first_step": first_step_done - began,
             "batch": [config.train_batch_size, config.train_micro_batch_size_per_gpu,
                       config.gradient_accumulation_steps]}))


if __name__ == "__main__":
    main(arguments(), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
