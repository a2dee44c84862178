"""A DeepSpeed pipeline-parallel script as DeepSpeed's pipeline tutorial writes one: the model as a list of
LayerSpecs (a tied embedding/head pair with --tied) cut by PipelineModule, the optimizer from the JSON config,
data read through the grid's data-parallel id, engine.train_batch(data_iter). Its import lines are the only ones
tests/test_deepspeed_pipe.py changes to run it on zerokit.

    torchrun --nproc_per_node 4 ds_pipe.py --deepspeed_config ds_pipe.json --stages 2 --out results/
"""

import argparse
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from common import SEQUENCE, VOCAB, MLPBlock, WIDTH, dataset, write_result


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


def head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output projection through the embedding's weight (a tied weight's second use)."""
    return x @ embedding.weight.t()


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def layers(tied: bool) -> list:
    if tied:
        return [TiedLayerSpec("embed", Embedding), *[LayerSpec(MLPBlock) for _ in range(4)], nn.LayerNorm(WIDTH),
                TiedLayerSpec("embed", Embedding, forward_fn=head)]
    return [LayerSpec(Embedding), *[LayerSpec(MLPBlock) for _ in range(4)], LayerSpec(Head)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--partition", default="parameters")
    parser.add_argument("--checkpoint_interval", type=int, default=0)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--seed_layers", action="store_true")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = PipelineModule(layers=layers(args.tied), num_stages=args.stages, loss_fn=loss_fn,
                           partition_method=args.partition, activation_checkpoint_interval=args.checkpoint_interval,
                           seed_layers=args.seed_layers)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    grid = engine.grid
    data = dataset()
    pairs = [(tokens[:-1], tokens[1:]) for (tokens,) in data]
    sampler = DistributedSampler(pairs, num_replicas=grid.get_data_parallel_world_size(),
                                 rank=grid.get_data_parallel_id(), shuffle=False)
    loader = DataLoader(pairs, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    data_iter = iter(deepspeed.utils.RepeatingLoader(loader))
    losses, seconds = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        losses.append(engine.train_batch(data_iter).item())
        seconds.append(time.perf_counter() - started)
    evaluated = engine.eval_batch(iter(loader)).item()
    write_result(args.out, torch.distributed.get_rank(), {
        "losses": losses, "eval": evaluated, "stage": engine.stage_id, "parts": [int(p) for p in model.parts],
        "first": engine.is_first_stage(), "last": engine.is_last_stage(), "step_seconds": seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "comm": engine.comm_stats() if hasattr(engine, "comm_stats") else None})


if __name__ == "__main__":
    main()
