"""torch's own composition for the pipeline benchmark (benchmarks/bench_pipeline.py): the model of
tests/scripts/ds_pipe.py cut as PipelineModule's 'parameters' method cuts it (embedding + 2 blocks | 2 blocks +
head), each stage under FSDP2 (fully_shard) over its 2 replicas, driven by torch's Schedule1F1B; torchrun, 4 CPU
ranks, gloo. Writes the same per-rank result file as ds_pipe.py (losses, step times, peak RSS).

    torchrun --nproc_per_node 4 benchmarks/torch_pipe_fsdp.py --steps 10 --out results/
"""

import argparse
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader, DistributedSampler

from common import VOCAB, WIDTH, MLPBlock, dataset, write_result


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage, replica = mesh.get_coordinate()
    torch.manual_seed(1234)
    layers = [Embedding(), *[MLPBlock() for _ in range(4)], Head()]
    module = nn.Sequential(*(layers[:3] if stage == 0 else layers[3:]))
    for block in module:
        if isinstance(block, MLPBlock):
            fully_shard(block, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.001)
    pipe_stage = PipelineStage(module, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe_stage, args.micro_batches, loss_fn=loss_fn)
    pairs = [(tokens[:-1], tokens[1:]) for (tokens,) in dataset()]
    loader = DataLoader(pairs, batch_size=args.micro * args.micro_batches,
                        sampler=DistributedSampler(pairs, num_replicas=world // 2, rank=replica, shuffle=False))
    batches = iter(loader)
    losses, seconds = [], []
    for _ in range(args.steps):
        try:
            inputs, labels = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, labels = next(batches)
        started = time.perf_counter()
        step_losses: list = []
        if stage == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=labels, losses=step_losses)
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)  # this stage's norm only: torch has no global one
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
        losses.append(float(torch.stack(step_losses).mean()) if step_losses else 0.0)
    write_result(args.out, rank, {"losses": losses, "step_seconds": seconds, "comm": None,
                                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
