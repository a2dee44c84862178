"""A DeepSpeed AutoTP training script as the Hugging Face Trainer drives one (transformers' deepspeed_init):
deepspeed.tp_model_init, an optimizer over the whole model, then initialize with a ZeRO config whose
tensor_parallel.autotp_size splits the model; the two ranks of a tensor group read their replica's batch. Its
import lines are the only ones tests/test_tensor_parallel.py changes to run it on zerokit.

    torchrun --nproc_per_node 4 ds_autotp.py CONFIG.json OUT_DIR
"""

import json
import sys

import torch

import deepspeed
import deepspeed.comm as dist

from common import write_result
from zerokit.testing.parity import forward_loss, make_batch, make_model, make_optimizer
from zerokit.testing.tensor_parity import AUTOTP_CASE as CASE


def main() -> None:
    config_path, out = sys.argv[1], sys.argv[2]
    config = json.loads(open(config_path).read())
    deepspeed.init_distributed()
    tensor = config["tensor_parallel"]["autotp_size"]
    replica = dist.get_rank() // tensor  # tensor groups are consecutive ranks
    model = make_model(CASE)
    model = deepspeed.tp_model_init(model, tp_size=tensor, dtype=torch.float32, config=config)
    optimizer = make_optimizer(CASE, model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses, norms = [], []
    for step in range(CASE.steps):
        for micro in range(CASE.accumulation):
            loss = forward_loss(engine, make_batch(CASE, step, micro, replica))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    write_result(out, dist.get_rank(), {
        "losses": losses, "norms": norms, "replica": replica, "accumulation": engine.gradient_accumulation_steps(),
        "train_batch_size": engine.train_batch_size(), "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "stage": engine.zero_optimization_stage(), "global_steps": engine.global_steps})


if __name__ == "__main__":
    main()
