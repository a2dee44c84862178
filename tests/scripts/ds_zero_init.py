"""A DeepSpeed ZeRO-3 script: the model built under zero.Init(config_dict_or_path=...), the config as a dict,
a client optimizer with a torch scheduler built before initialize(), GatheredParameters to read and to edit
(on one rank) a sharded weight, get_accelerator() queries, deepspeed.comm for ranks.

    torchrun --nproc_per_node 2 ds_zero_init.py results/
"""

import sys

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from common import build_model, dataset, write_result

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, "overlap_comm": True},
    "steps_per_print": 100,
    "zero_allow_untested_optimizer": True,
}


def main() -> None:
    out = sys.argv[1]
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                                lr_scheduler=scheduler, training_data=dataset(),
                                                                config=CONFIG)
    losses, lrs = [], []
    memory = get_accelerator().memory_allocated()
    for (tokens,) in loader:
        loss = engine(tokens.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
    with deepspeed.zero.GatheredParameters(engine.module.head.bias, modifier_rank=0):
        head_bias_sum = engine.module.head.bias.sum().item()
        if dist.get_rank() == 0:
            with torch.no_grad():
                engine.module.head.bias.zero_()
    with deepspeed.zero.GatheredParameters([engine.module.head.bias]):
        zeroed = engine.module.head.bias.abs().sum().item()
    write_result(out, dist.get_rank(), {
        "losses": losses, "lrs": lrs, "head_bias_sum": head_bias_sum, "zeroed": zeroed,
        "stage": engine.zero_optimization_stage(), "train_batch_size": engine.train_batch_size(),
        "micro_batch": engine.train_micro_batch_size_per_gpu(), "accumulation": engine.gradient_accumulation_steps(),
        "global_steps": engine.global_steps, "memory_reported": memory > 0, "world_size": dist.get_world_size(),
        "current_device": get_accelerator().current_device()})


if __name__ == "__main__":
    main()
