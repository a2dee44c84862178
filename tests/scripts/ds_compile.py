"""A DeepSpeed script that builds its own optimizer and schedule and compiles the model: args.deepspeed_config set
in code on a plain Namespace, model_parameters as a generator, a client optimizer and a callable lr_scheduler,
dist_init_required=True, engine.compile(), the precision queries, destroy().

    torchrun --nproc_per_node 2 ds_compile.py configs/ds_compile.json results/
"""

import argparse
import os
import sys

import torch

import deepspeed
from deepspeed import comm
from deepspeed.accelerator import get_accelerator

from common import build_model, dataset, write_result


def main() -> None:
    config_path, out = sys.argv[1], sys.argv[2]
    args = argparse.Namespace(deepspeed_config=config_path, local_rank=int(os.environ["LOCAL_RANK"]))
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model.parameters(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
        training_data=dataset(), dist_init_required=True)
    engine.compile()
    losses, lrs = [], []
    for step, (tokens,) in enumerate(loader):
        loss = engine(tokens.to(get_accelerator().current_device_name()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    comm.barrier()
    result = {"losses": losses, "lrs": lrs, "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
              "stage": engine.zero_optimization_stage(), "train_batch_size": engine.train_batch_size(),
              "micro_batch": engine.train_micro_batch_size_per_gpu(), "accumulation": engine.gradient_accumulation_steps(),
              "world_size": comm.get_world_size(), "local_rank": comm.get_local_rank(), "compiled": engine.is_compiled}
    engine.destroy()
    write_result(out, comm.get_rank(), result)


if __name__ == "__main__":
    main()
