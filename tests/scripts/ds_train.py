"""A DeepSpeed training script as DeepSpeed's tutorials write one: argparse with add_config_arguments, the
optimizer and LR schedule from the JSON config, initialize() with model_parameters and training_data, the
engine's loop, deepspeed.comm for a logged average, a checkpoint at the end. Its import lines are the only
ones tests/test_deepspeed_scripts.py changes to run it on zerokit.

    torchrun --nproc_per_node 2 ds_train.py --deepspeed --deepspeed_config ds_train.json --out results/
"""

import argparse

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from common import build_model, dataset, local_rank, write_result


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="a DeepSpeed-style training script")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse()
    deepspeed.init_distributed()
    get_accelerator().manual_seed(0)
    model = build_model()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        training_data=dataset())
    device = get_accelerator().current_device_name()
    losses, lrs, boundaries, averaged = [], [], [], []
    for _ in range(args.epochs):
        for (tokens,) in loader:
            loss = engine(tokens.to(device))
            engine.backward(loss)
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.step()
            losses.append(loss.item())
            lrs.append(engine.get_lr()[0])
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            averaged.append(mean.item() / dist.get_world_size())
    if args.checkpoint:
        engine.save_checkpoint(args.checkpoint, client_state={"losses": len(losses)})
    write_result(args.out, dist.get_rank(), {
        "losses": losses, "lrs": lrs, "boundaries": boundaries, "averaged": averaged,
        "rank": dist.get_rank(), "local_rank": engine.local_rank, "args_local_rank": args.local_rank,
        "world_size": engine.world_size, "global_rank": engine.global_rank, "env_local_rank": local_rank(),
        "device": str(engine.device), "train_batch_size": engine.train_batch_size(),
        "micro_batch": engine.train_micro_batch_size_per_gpu(), "accumulation": engine.gradient_accumulation_steps(),
        "stage": engine.zero_optimization_stage(), "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
        "global_steps": engine.global_steps, "batches": len(loader),
        "optimizer": type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__,
        "scheduler": type(scheduler).__name__, "accelerator": get_accelerator().device_name(),
        "accelerator_available": get_accelerator().is_available(), "device_count": get_accelerator().device_count(),
    })


if __name__ == "__main__":
    main()
