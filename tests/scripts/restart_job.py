"""A training job as a user writes one for `torchrun --max-restarts N` (issue 33): on start it resumes from its
checkpoint directory if there is one, it saves every --save-every steps, and its process group is started by
zerokit.initialize (--group-by zerokit), by the DeepSpeed drop-in's init_distributed (--group-by deepspeed), or by the
script itself (--group-by script). Launched by tests/test_restart.py:

    torchrun --nproc_per_node 2 --max-restarts 1 restart_job.py --out DIR --kill-at 7 --late 3

--kill-at K: in the first attempt, rank 1 kills itself with SIGKILL right after step K (a GPU falling off the bus);
the surviving rank fails in its next collective and torchrun restarts both. --late S: in a restarted attempt, rank 1
starts S seconds after rank 0 (a slower node). Rank 0 writes DIR/result.json: the losses of the steps each attempt
trained, the attempt and the step it resumed from, and the final weights (fp32, by name).
"""

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
    if args.group_by == "script":
        torch.distributed.init_process_group("gloo")
    elif args.group_by == "deepspeed":
        import zerokit.deepspeed as deepspeed

        deepspeed.init_distributed()
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2),
                                {"zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0})
    checkpoints = Path(args.out) / "checkpoints"
    start = 0
    if (checkpoints / "latest").exists():
        engine.load_checkpoint(checkpoints)
        start = engine.progress.optimizer_step
    losses = []
    for step in range(start, args.steps):
        tokens = batch(step, rank)
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if attempt == 0 and rank == 1 and step + 1 == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % args.save_every == 0:
            engine.save_checkpoint(checkpoints)
    weights = {name: value.tolist() for name, value in engine.full_state_dict().items()}
    if rank == 0:
        (Path(args.out) / "result.json").write_text(json.dumps(
            {"attempt": attempt, "resumed_from": start, "losses": losses, "weights": weights}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
