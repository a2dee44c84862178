"""A DeepSpeed MoE training script as DeepSpeed's MoE tutorial writes one: deepspeed.moe.layer.MoE layers (an MLP
expert, ep_size from the command line), the gate's auxiliary loss added to the task's, the optimizer's groups split
with split_params_into_different_moe_groups_for_optimizer, the engine's loop. Its import lines are the only ones
tests/test_deepspeed_moe.py changes to run it on zerokit.

    torchrun --nproc_per_node 4 ds_moe.py --stage 2 --k 2 --ep-size 2 --clip 0.05 --out results/
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import deepspeed
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups as ds_groups

HIDDEN, EXPERTS, VOCAB, TOKENS, STEPS, AUX = 16, 4, 23, 7, 4, 0.01
UNITS = {"stage3_unit_classes": ["MoE"], "stage3_param_persistence_threshold": 0}  # zerokit's keys (DeepSpeed: none)


class MoEModel(nn.Module):
    def __init__(self, k: int, ep_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe1 = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=k, drop_tokens=False)
        self.moe2 = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=1.0,
                        min_capacity=1)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed(tokens)
        out1, aux1, _ = self.moe1(hidden)
        out2, aux2, _ = self.moe2(hidden + out1)
        return self.head(hidden + out2), aux1 + aux2


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, TOKENS + 1), generator=torch.Generator().manual_seed(100 * step + rank))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--units", action="store_true", help="ZeRO-3 on zerokit: each MoE layer a unit of its own")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = MoEModel(args.k, args.ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                    "name": "parameters"})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.accumulation,
              "gradient_clipping": args.clip, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "zero_optimization": {"stage": args.stage, **UNITS} if args.units else {"stage": args.stage},
              "zero_allow_untested_optimizer": True}  # DeepSpeed asks it of SGD under ZeRO
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    rank = torch.distributed.get_rank()
    name = f"ep_size_{args.ep_size}"  # the expert groups deepspeed.initialize made, as a script asks for them
    expert_groups = [ds_groups._get_expert_parallel_world_size(name), ds_groups._get_expert_parallel_rank(name),
                     ds_groups._get_expert_data_parallel_world_size(name), ds_groups._get_expert_data_parallel_rank(name),
                     ds_groups._get_expert_parallel_src_rank(name)] if args.ep_size > 1 else []
    losses, norms = [], []
    for step in range(STEPS):
        tokens = batch(rank, step)
        logits, aux = engine(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)) + AUX * aux
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(loss.item())
        if boundary:
            norms.append(float(engine.get_global_grad_norm()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    memory = engine.memory_stats() if hasattr(engine, "memory_stats") else None  # zerokit's count of what it holds
    (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses, "norms": norms, "groups": len(groups),
                                                          "expert_groups": expert_groups, "memory": memory}))


if __name__ == "__main__":
    main()
