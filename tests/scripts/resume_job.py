"""A DeepSpeed-style training job that keeps no books of its own (issue 33, item 3): its config says "resume from the
newest complete checkpoint in DIR" (`resume.load_dir`), deepspeed.initialize makes its loader (training_data=), and
the loop runs until the engine's step count reaches --steps, saving every --save-every steps. Nothing in it reads a
checkpoint, a step to start from or an epoch to start in. Launched by tests/test_resume.py:

    torchrun --nproc_per_node 2 --max-restarts 1 resume_job.py --out DIR --kill-at 7

24 samples, 2 ranks, micro-batches of 2, accumulation 2: an epoch is 6 micro-batches (3 steps) per rank; each epoch
is shuffled anew (the loop sets the sampler's next epoch after each full pass). --kill-at K: in the first attempt rank
1 kills itself with SIGKILL right after step K; torchrun restarts both ranks, which resume from the last save (step 4:
in the middle of the second epoch) and go on across two epoch boundaries.
Every rank appends each sample it takes, as `micro-step sample`, to DIR/samples_rank<r>_attempt<a>.txt; rank 0 writes
DIR/result.json: the attempt, the step it started from, the final weights, the seconds initialize took (the resume
included), and the seconds from the kill (DIR/killed_at) to the end of the restarted attempt's first step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

import zerokit.deepspeed as deepspeed
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss


class Numbered(torch.utils.data.Dataset):
    """Sample i: its number and 17 tokens drawn from a generator seeded with i."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.randint(0, 67, (17,), generator=torch.Generator().manual_seed(index))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=0)
    return parser.parse_args()


def build(checkpoints: Path) -> tuple[deepspeed.DeepSpeedEngine, torch.utils.data.DataLoader]:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "comm_timeout_seconds": 30, "resume": {"load_dir": str(checkpoints)}}
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=Numbered(), config=config)
    return engine, loader


def train(engine: deepspeed.DeepSpeedEngine, loader: torch.utils.data.DataLoader, args: argparse.Namespace,
          checkpoints: Path, log: Path, attempt: int, rank: int) -> float | None:
    out, start, first_step_done = Path(args.out), engine.global_steps, None
    while engine.global_steps < args.steps:
        for numbers, tokens in loader:
            with open(log, "a") as samples:
                samples.writelines(f"{engine.progress.micro_step} {number}\n" for number in numbers.tolist())
            engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
            engine.step()
            if engine.progress.micro_step % engine.gradient_accumulation_steps():
                continue
            if first_step_done is None and engine.global_steps == start + 1:
                first_step_done = time.time()
            if attempt == 0 and rank == 1 and engine.global_steps == args.kill_at:
                (out / "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(checkpoints)
            if engine.global_steps == args.steps:
                break
        else:  # a full pass: the next one in a new order
            loader.data_sampler.set_epoch(loader.data_sampler.epoch + 1)
    return first_step_done


def main(args: argparse.Namespace, attempt: int, rank: int) -> None:
    out = Path(args.out)
    checkpoints = out / "checkpoints"
    began = time.monotonic()
    engine, loader = build(checkpoints)
    initialize_seconds, start = time.monotonic() - began, engine.global_steps
    first_step_done = train(engine, loader, args, checkpoints, out / f"samples_rank{rank}_attempt{attempt}.txt",
                            attempt, rank)
    weights = {name: value.tolist() for name, value in engine.full_state_dict().items()}
    if rank == 0:
        killed = out / "killed_at"
        recovery = first_step_done - float(killed.read_text()) if killed.exists() and first_step_done else None
        (out / "result.json").write_text(json.dumps(
            {"attempt": attempt, "resumed_from": start, "weights": weights, "initialize_seconds": initialize_seconds,
             "seconds_from_kill_to_first_resumed_step": recovery}))
    engine.destroy()


if __name__ == "__main__":
    main(arguments(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ["RANK"]))
