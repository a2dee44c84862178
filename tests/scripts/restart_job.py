"""A training job as a user writes one for `torchrun --max-restarts N` (issue 33): on start it resumes from its
checkpoint directory if there is one, it saves every --save-every steps, and its process group is started by
zerokit.initialize (--group-by zerokit), by the DeepSpeed drop-in's init_distributed (--group-by deepspeed), or by the
script itself (--group-by script). Launched by tests/test_restart.py:

    torchrun --nproc_per_node 2 --max-restarts 1 restart_job.py --out DIR --kill-at 7 --late 3

--kill-at K: in the first attempt, rank 1 kills itself with SIGKILL right after step K (a GPU falling off the bus);
the surviving rank fails in its next collective and torchrun restarts both. --late S: in a restarted attempt, rank 1
starts S seconds after rank 0 (a slower node). Rank 0 writes DIR/result.json: the losses of the steps each attempt
trained, the attempt and the step it resumed from, the final weights (fp32, by name), and the seconds from the kill
to the end of the restarted attempt's first step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch

import zerokit
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(1000 * step + rank))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--late", type=float, default=0.0)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--group-by", choices=("zerokit", "deepspeed", "script"), default="zerokit",
                        help="who starts the process group")
    args = parser.parse_args()
    attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ["RANK"])
    if attempt > 0 and rank == 1:
        time.sleep(args.late)
    if args.group_by == "script":  # bounded: after a restart it can wait on keys nobody will write again
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=20))
    elif args.group_by == "deepspeed":
        import zerokit.deepspeed as deepspeed

        deepspeed.init_distributed()
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2),
                                {"zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0,
                                 "comm_timeout_seconds": 30})
    checkpoints = Path(args.out) / "checkpoints"
    start = 0
    if (checkpoints / "latest").exists():
        engine.load_checkpoint(checkpoints)
        start = engine.progress.optimizer_step
    losses, first_step_done = [], None
    for step in range(start, args.steps):
        tokens = batch(step, rank)
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == start:
            first_step_done = time.time()
        if attempt == 0 and rank == 1 and step + 1 == args.kill_at:
            (Path(args.out) / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % args.save_every == 0:
            engine.save_checkpoint(checkpoints)
    weights = {name: value.tolist() for name, value in engine.full_state_dict().items()}
    if rank == 0:
        killed = Path(args.out) / "killed_at"
        recovery = first_step_done - float(killed.read_text()) if killed.exists() and first_step_done else None
        (Path(args.out) / "result.json").write_text(json.dumps(
            {"attempt": attempt, "resumed_from": start, "losses": losses, "weights": weights,
             "seconds_from_kill_to_first_resumed_step": recovery}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
