"""The same Hugging Face Trainer job under every way a user can shard it (issue 23): plain DDP, the real DeepSpeed at
stages 2 and 3, accelerate's FSDP2 (TrainingArguments(fsdp=...), fsdp_version 2), and zerokit at stages 2 and 3
(through `python -m zerokit.deepspeed.install`, the script unchanged). The job: a small Llama-shaped causal LM
built from its config (8.3M parameters), fp32, AdamW, the Trainer's default clipping at 1.0, 2 ranks on CPU
(gloo), one micro-batch of 4 sequences of 128 tokens per step.

    python benchmarks/bench_frameworks.py                       # every contender, 20 steps each, 2 rounds
    python benchmarks/bench_frameworks.py --only ddp,zerokit-3 --steps 10 --rounds 4

FSDP2 on a CPU: accelerate 1.15 (state.py) makes a job FSDP only when its distributed type is a GPU-like one
(MULTI_GPU, MULTI_XPU, ...); on CPU ranks it is MULTI_CPU and the Trainer's fsdp= job trains with DDP, so the
`fsdp2` row is refused there (See EXPECTED_ENGINE). `fsdp2-torch`, shown as "fsdp2 (torch loop)", is FSDP2 on
CPU without the Trainer: the same model, data, micro-batch and steps, torch's fully_shard on each decoder layer
and the root, and the loop the Trainer runs (fused AdamW, lr 1e-4 decaying linearly to 0, clipping at 1.0, the
same sampler); the row checks that each rank holds half of every parameter as a DTensor shard.

Measured per contender, in a fresh torchrun launch each:
- **s/step**: each step's wall time (the Trainer's on_step_begin to on_step_end) on the slower rank, the median
  over the steps after the first `--warmup`.
- **VmHWM MiB**: the process's peak resident set (VmHWM in /proc/self/status) at the end, the larger rank's;
  it includes the interpreter and the imported libraries (DeepSpeed's and transformers' modules alike).
- **growth MiB**: VmHWM at the end less the resident size just before the model is built (the peak is reset
  there through /proc/self/clear_refs): what the model, its training states and the steps added.
Each contender runs once per round, the rounds in alternating orders (A B C, C B A, ...) as in
benchmarks/bench_stages.py, so that a drift in the machine's load weighs on all alike; a row shows the median of
its rounds and their range (min-max), and the 1-minute load average at each launch is printed and kept in --json.
Ratios are against DDP's medians. The first and last losses are shown so that a contender that did not train is
seen. A contender that fails prints its last error line under the table (beside its row, if an earlier round
finished).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONTENDERS = ("ddp", "deepspeed-2", "deepspeed-3", "fsdp2", "fsdp2-torch", "zerokit-2", "zerokit-3")
LABELS = {"fsdp2-torch": "fsdp2 (torch loop)"}  # rows whose job is not the Trainer's
VOCAB, SEQUENCE, MICRO_BATCH = 2048, 128, 4


# --- the job, run on each rank -----------------------------------------------------------------------------

def resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                       num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=SEQUENCE,
                       tie_word_embeddings=False)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, samples: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (samples, SEQUENCE), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def deepspeed_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "train_batch_size": "auto", "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}


def training_arguments(contender: str, steps: int, output_dir: str):
    from transformers import TrainingArguments

    sharding: dict = {}
    if contender.startswith(("deepspeed", "zerokit")):
        sharding["deepspeed"] = deepspeed_config(int(contender[-1]))
    elif contender == "fsdp2":
        sharding.update(fsdp="full_shard auto_wrap",
                        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    return TrainingArguments(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=MICRO_BATCH,
                             max_steps=steps, learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
                             seed=0, disable_tqdm=True, dataloader_num_workers=0, **sharding)


def run_job(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

    training = training_arguments(args.contender, args.steps, args.out)
    if args.contender.startswith(("deepspeed", "zerokit")):
        import deepspeed  # zerokit's under `-m zerokit.deepspeed.install`

        deepspeed.init_distributed()  # after TrainingArguments (See tests/scripts/hf_trainer.py)
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    before = resident_kib("VmRSS")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config())
    durations: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *_args, **_kwargs) -> None:
            durations.append(time.perf_counter() - self.started)

    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(args.steps * MICRO_BATCH * world),
                      callbacks=[Clock()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    result = {"durations": durations, "losses": losses, "vmhwm_kib": resident_kib("VmHWM"), "before_kib": before,
              "engine": f"{type(engine).__module__}.{type(engine).__qualname__}",
              "parameters": sum(p.numel() for p in model.parameters()) if args.contender == "ddp" else None}
    Path(args.out, f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(result))


def run_torch_fsdp2(args: argparse.Namespace) -> None:
    """The job of run_job under torch's FSDP2, in the loop the Trainer would run."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    before = resident_kib("VmRSS")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config())
    parameters = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    held = sum(p.to_local().numel() for p in model.parameters())  # DTensors: this rank's shard of each
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / args.steps))
    data = Tokens(args.steps * MICRO_BATCH * world)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler)
    durations, losses = [], []
    model.train()
    for batch in loader:
        started = time.perf_counter()
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        durations.append(time.perf_counter() - started)
        losses.append(loss.item())
    result = {"durations": durations, "losses": losses, "vmhwm_kib": resident_kib("VmHWM"), "before_kib": before,
              "engine": f"{type(model).__module__}.{type(model).__qualname__}", "parameters": None,
              "held_fraction": held / parameters}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    # FSDP's module and hooks hold the group in reference cycles: collected now, while it exists (collected at
    # exit instead, after the group was destroyed, a rank aborted in 1 of 2 runs)
    del model, optimizer, schedule
    gc.collect()
    dist.destroy_process_group()


# --- the driver --------------------------------------------------------------------------------------------

def launch(contender: str, steps: int, out: Path) -> str | None:
    """One torchrun launch of the job; its error's last line, or None."""
    install = ["-m", "zerokit.deepspeed.install"] if contender.startswith("zerokit") else []
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *install,
               __file__, "--worker", "--contender", contender, "--steps", str(steps), "--out", str(out)]
    # No ACCELERATE_USE_CPU: under it accelerate drops a DeepSpeed plugin and trains with DDP (TrainingArguments'
    # use_cpu=True alone keeps it; See tests/scripts/accelerate_loop.py).
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1800)
    if done.returncode == 0:
        return None
    print(done.stderr[-4000:], file=sys.stderr)
    raised = [line.strip() for line in done.stderr.splitlines()
              if re.match(r"\s*(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)\b.*:", line)]
    return (raised or [f"exit status {done.returncode}"])[-1][:300]


# What trained under each contender (trainer.model_wrapped's class): accelerate keeps FSDP for GPU-like
# distributed types only, and on CPU trains such a job with DDP without a word; that row must not pass as FSDP2's.
EXPECTED_ENGINE = {"ddp": "torch.nn.parallel.distributed.DistributedDataParallel",
                   "deepspeed": "deepspeed.runtime.engine.DeepSpeedEngine",
                   "zerokit": "zerokit.deepspeed.engine.DeepSpeedEngine", "fsdp2": "FSDP"}


class SilentFallback(RuntimeError):
    """A contender's job trained with another framework's engine than the one it asked for."""


def summarise(contender: str, out: Path, warmup: int) -> dict:
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    expected = EXPECTED_ENGINE[contender.split("-")[0]]
    if expected not in ranks[0]["engine"]:
        raise SilentFallback(f"asked for {contender}, trained with {ranks[0]['engine']}")
    unsharded = [rank["held_fraction"] for rank in ranks if rank.get("held_fraction", 0.0) > 0.51]
    if unsharded:  # each rank holds half of every parameter (and at most a row of padding)
        raise SilentFallback(f"asked for {contender}, a rank held {unsharded[0]:.0%} of the parameters")
    slowest = [max(steps) for steps in zip(*(rank["durations"] for rank in ranks))][warmup:]
    return {"seconds_per_step": statistics.median(slowest),
            "vmhwm_mib": max(rank["vmhwm_kib"] for rank in ranks) / 1024,
            "growth_mib": max(rank["vmhwm_kib"] - rank["before_kib"] for rank in ranks) / 1024,
            "first_loss": ranks[0]["losses"][0], "last_loss": ranks[0]["losses"][-1], "engine": ranks[0]["engine"],
            "parameters": ranks[0]["parameters"]}


MEASURES = ("seconds_per_step", "vmhwm_mib", "growth_mib")


def pooled(rounds: list[dict]) -> dict:
    """One contender's rounds: the median of each measure and its range; losses and engine from the first (every
    round trains the same job from the same seed)."""
    row = dict(rounds[0])
    for key in MEASURES:
        values = [summary[key] for summary in rounds]
        row[key], row[key + "_range"] = statistics.median(values), (min(values), max(values))
    row["load_averages"] = [summary["load_average"] for summary in rounds]
    return row


def table(rows: dict[str, dict], failed: dict[str, str]) -> str:
    base = rows.get("ddp")
    lines = ["| contender | s/step (range) | x DDP | VmHWM MiB (range) | x DDP | growth MiB | x DDP | loss first -> last "
             "| engine |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        def ratio(key: str) -> str:
            return f"{row[key] / base[key]:.2f}" if base else "-"
        (fast, slow), (low, high) = row["seconds_per_step_range"], row["vmhwm_mib_range"]
        lines.append(f"| {LABELS.get(name, name)} | {row['seconds_per_step']:.3f} ({fast:.3f}-{slow:.3f}) | "
                     f"{ratio('seconds_per_step')} | {row['vmhwm_mib']:.0f} ({low:.0f}-{high:.0f}) | "
                     f"{ratio('vmhwm_mib')} | {row['growth_mib']:.0f} | {ratio('growth_mib')} | "
                     f"{row['first_loss']:.3f} -> {row['last_loss']:.3f} | {row['engine'].rsplit('.', 1)[-1]} |")
    lines += [f"| {name} | {'a round failed' if name in rows else 'did not run'}: {error} ||||||||"
              for name, error in failed.items()]
    return "\n".join(lines)


def run_rounds(chosen: list[str], steps: int, warmup: int, rounds: int) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Every contender once per round, in a fresh launch, alternating the order; a contender that fails once is
    left out of the later rounds (its row keeps the rounds it finished, and says that one failed)."""
    summaries: dict[str, list[dict]] = {name: [] for name in chosen}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(rounds):
            order = chosen if round_index % 2 == 0 else chosen[::-1]
            for name in (name for name in order if name not in failed):
                out, load = Path(scratch, f"{name}-{round_index}"), os.getloadavg()[0]
                error = launch(name, steps, out)
                try:
                    if error is not None:
                        raise RuntimeError(error)
                    summaries[name].append({**summarise(name, out, warmup), "load_average": load})
                except RuntimeError as failure:
                    error = failed[name] = str(failure)
                print(f"round {round_index + 1}/{rounds}: {name}: {'done' if error is None else error} (1-minute "
                      f"load average {load:.1f} at launch)", file=sys.stderr, flush=True)
    return summaries, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CONTENDERS), help=f"comma-separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--rounds", type=int, default=2, help="launches per contender, in alternating orders")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        (run_torch_fsdp2 if args.contender == "fsdp2-torch" else run_job)(args)
        return 0
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be >= 1")
    rounds, failed = run_rounds(chosen, args.steps, args.warmup, args.rounds)
    rows = {name: pooled(summaries) for name, summaries in rounds.items() if summaries}
    print(table(rows, failed))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "rows": rows, "each_round": rounds,
                                               "failed": failed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
