"""Train a small GPT with zerokit. Run under torchrun (`zerokit demo` does that for you):

    torchrun --standalone --nproc_per_node 2 -m zerokit.demo.train --stage 2
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from tqdm import tqdm

import zerokit
from zerokit.demo.data import CharTokenizer, WindowSampler, load_corpus
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a small character-level GPT with zerokit.")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per micro-step")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build(args: argparse.Namespace, vocab_size: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)  # every rank builds the same model; zerokit also broadcasts rank 0's
    config = TinyGPTConfig(vocab_size=vocab_size, block_size=args.block_size, n_layer=args.layers,
                           n_head=4, n_embd=args.width, with_test_features=False)
    model = TinyGPT(config)
    return model, torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=args.lr, betas=(0.9, 0.95))


def stage0_equivalent(engine: zerokit.Engine, memory: dict[str, int]) -> dict[str, int]:
    """What plain data parallel would hold on each rank for the same model: everything unsharded."""
    shards = 1 if engine.config.stage == 0 else engine.world_size
    param_bytes = engine.stage.flat.buffer.element_size()
    every_parameter = sum(p.numel() for p in engine.module.parameters())  # true shapes, even when sharded
    return {"parameters": param_bytes * every_parameter, "gradients": param_bytes * engine.trainable_numel(),
            "optimizer_state": memory["optimizer_state"] * shards}


def report(engine: zerokit.Engine, losses: list[float], steps_taken: int) -> None:
    memory = engine.memory_stats()
    every_rank = [None] * engine.world_size
    dist.all_gather_object(every_rank, memory)
    if engine.rank != 0:
        return
    baseline = stage0_equivalent(engine, memory)
    print(f"\nstage {engine.config.stage} on {engine.world_size} ranks, {engine.trainable_numel():,} trainable "
          f"parameters; loss {losses[0]:.3f} -> {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    header = "".join(f"{'rank ' + str(r):>12}" for r in range(engine.world_size))
    print(f"{'MB held':<16}{header}{'stage 0':>12}{'saved':>9}")
    for category in ("parameters", "gradients", "optimizer_state"):
        row = "".join(f"{stats[category] / 1e6:>12.3f}" for stats in every_rank)
        saved = 1 - memory[category] / baseline[category]
        print(f"{category:<16}{row}{baseline[category] / 1e6:>12.3f}{saved:>9.0%}")
    total, total0 = sum(memory.values()), sum(baseline.values())
    print(f"{'model states':<16}{'':>{12 * engine.world_size}}{total0 / 1e6:>12.3f}{1 - total / total0:>9.0%}")
    comm = engine.comm_stats()
    moved = {kind: counts["elements"] / steps_taken for kind, counts in comm.items()
             if counts["calls"] and kind != "broadcast"}
    print("elements per step: " + ", ".join(f"{k} {v / engine.trainable_numel():.2f} psi" for k, v in moved.items()))


def sample(engine: zerokit.Engine, tokenizer: CharTokenizer, prompt: str, length: int = 200) -> str:
    model = engine.module.eval()
    ids = tokenizer.encode(prompt).unsqueeze(0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad(), engine.unsharded():  # stage 3: gather once, not once per token
        for _ in range(length):
            logits = model(ids[:, -model.config.block_size:])[:, -1].float()
            probabilities = torch.softmax(logits / 0.8, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
    return tokenizer.decode(ids[0].tolist())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)
    model, optimizer = build(args, tokenizer.vocab_size)
    engine = zerokit.initialize(model, optimizer, {
        "zero_optimization": {"stage": args.stage}, "bf16": {"enabled": args.dtype == "bf16"},
        "gradient_accumulation_steps": args.accumulation, "gradient_clipping": 1.0})
    sampler = WindowSampler(tokens, args.block_size, args.batch_size, seed=1000 + engine.rank)
    losses = []
    bar = tqdm(range(args.steps * args.accumulation), disable=engine.rank != 0, desc=f"stage {args.stage}",
               file=sys.stdout, mininterval=1.0)
    for _ in bar:
        batch = sampler.next()
        loss = lm_loss(engine(batch[:, :-1]), batch)
        engine.backward(loss)
        result = engine.step()
        if result.boundary:
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}", norm=f"{result.grad_norm:.2f}", skipped=result.total_skips)
    report(engine, losses, args.steps)
    if engine.rank == 0:
        print("\nsample: " + sample(engine, tokenizer, "The ").replace("\n", "\n        "))
    del engine, model, optimizer  # the engine goes while its process groups exist (See zerokit/testing/spawn.py)
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
