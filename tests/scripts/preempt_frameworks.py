"""Preemption through the frameworks (issue 44): the config's `preemption` block under Lightning's ZerokitStrategy
(--via lightning) and under the DeepSpeed drop-in (--via deepspeed: `deepspeed.initialize`, engine.backward,
engine.step), as users write them. Launched by tests/test_restart.py under torchrun on 2 gloo ranks:

    torchrun --nproc_per_node 2 --max-restarts 0 preempt_frameworks.py --out DIR --via lightning

The token model of common.py trains 8 optimizer steps of one micro-batch of 2 per rank (stage 2), the block on
(save_dir DIR/checkpoints). During step 3 rank 1 writes its pid in DIR/in_step and waits for the test's signal, before
its backward. Every rank that exits writes its code in DIR/exit_rank<r>.json; a rank that finishes writes
DIR/finished_rank<r>.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from common import build_model, dataset

STEPS, SIGNALLED_AT = 8, 3


def config(out: Path) -> dict:
    return {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "preemption": {"enabled": True, "save_dir": str(out / "checkpoints")}}


def wait_for_the_signal(engine, out: Path) -> None:
    (out / "in_step").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not engine.preemption.requested and time.monotonic() < deadline:
        time.sleep(0.01)


def batches(rank: int) -> list[torch.Tensor]:
    tokens = dataset().tensors[0]
    return [tokens[2 * (2 * step + rank):2 * (2 * step + rank) + 2] for step in range(STEPS)]


def through_deepspeed(out: Path, rank: int) -> None:
    import zerokit.deepspeed as deepspeed

    model = build_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**config(out), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    for step, tokens in enumerate(batches(rank)):
        loss = engine(tokens)
        if rank == 1 and step == SIGNALLED_AT:
            wait_for_the_signal(engine, out)
        engine.backward(loss)
        engine.step()


def through_lightning(out: Path, rank: int) -> None:
    from lightning.pytorch import LightningModule, Trainer

    from zerokit.integrations.lightning import ZerokitStrategy, engine_of

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model()

        def training_step(self, batch, index):
            if rank == 1 and index == SIGNALLED_AT:
                wait_for_the_signal(engine_of(self), out)
            return self.model(batch[0])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = Trainer(strategy=ZerokitStrategy(config=config(out)), accelerator="cpu", devices=2, max_steps=STEPS,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # Lightning shards the loader over the ranks itself (its DistributedSampler)
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader(dataset(), batch_size=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--via", choices=("lightning", "deepspeed"), required=True)
    args = parser.parse_args()
    rank, out = int(os.environ["RANK"]), Path(args.out)
    try:
        (through_lightning if args.via == "lightning" else through_deepspeed)(out, rank)
        (out / f"finished_rank{rank}").write_text("")
    except SystemExit as leaving:  # a preempted engine's exit code
        (out / f"exit_rank{rank}.json").write_text(json.dumps({"code": leaving.code, "time": time.time()}))
        sys.exit(leaving.code)
