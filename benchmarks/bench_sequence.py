"""The longest sequence that trains in a fixed memory budget, and the step time at a fixed length (issue 47, item 8):
a small Llama at ZeRO-3 on 2 gloo ranks, zerokit with and without sequence parallelism (Ulysses) and tiling, beside
real DeepSpeed's ALST and DeepSpeed's ZeRO-3 on the same ranks.

    python benchmarks/bench_sequence.py                                   # every contender, 1 GiB a rank
    python benchmarks/bench_sequence.py --budget-mib 1536 --length 4096 --only zerokit-sp,deepspeed-alst
    python benchmarks/bench_sequence.py --quick                           # a tiny smoke run (tests/test_benchmarks.py)

The model: transformers' LlamaForCausalLM built from its config (hidden 256, 4 layers, 8 query and 4 key/value heads,
MLP 704, a 32,000-token vocabulary and an untied head, so that the logits weigh; sdpa; 19.3M parameters), fp32, torch
AdamW, ZeRO-3, one sequence of random tokens per replica per step (micro-batch 1), every token a target.

Contenders, each run in fresh processes (a rank of each length is a new interpreter, started as torchrun starts one;
zerokit and DeepSpeed are never imported in the same process):
- zerokit: no sequence parallelism; each rank is a replica with its own whole sequence.
- zerokit-sp: sequence_parallel_size=2; the replica's sequence split over both ranks by engine.sequence.shard,
  the loss combined by engine.sequence.loss (docs/sequence_parallel.md).
- zerokit-sp-tiled: zerokit-sp with the tiled MLP and loss of zerokit.parallel.sequence.tiling (tile_mlp on the model
  before initialize; engine.sequence.hidden_states, the model run with no logits, then engine.sequence.tiled_loss
  on them and the head, the logits never made whole), one tile per
  `hidden` tokens of the rank's shard (DeepSpeed's TiledMLP rule, ceil(tokens / hidden)); skipped with a note where
  that module does not import.
- deepspeed-alst: real DeepSpeed's ALST as tests/scripts/ds_alst.py runs it: UlyssesSPAttentionHF
  .register_with_transformers, initialize(mpu=), UlyssesSPDataLoaderAdapter, the shards' losses combined by
  torch.distributed.nn.functional.all_reduce; the optimizer from its config (AdamW, torch_adam). Untiled, as that
  script is: DeepSpeed's TiledMLP and TiledFusedLogitsLoss are not run here (the fused loss runs the head's backward
  inside its forward with a fixed incoming gradient, which the shards' combination by token counts would rescale).
- deepspeed: DeepSpeed's ZeRO-3 without sequence parallelism, as zerokit's first row.
DeepSpeed's rows are skipped with a note where it is not installed.

Measured on each rank (its resident memory from /proc/self/status; the ranks run with MALLOC_MMAP_THRESHOLD_=131072,
so that glibc hands a freed large block back at once and the resident size is what the process holds: See
tests/test_forward_only.py):
- a step's **peak RSS growth**: VmHWM after the step (forward, loss, backward, optimizer step) less VmRSS before it,
  the high-water mark reset to the resident size just before (writing 5 to /proc/self/clear_refs);
- **peak RSS**: the process's whole VmHWM over its steps (interpreter, libraries, model states, activations), the
  mark reset before each step and the largest read after one kept: the figure the budget caps.
"Trains within the budget" means every rank's peak RSS over 2 steps (the second runs with the optimizer's state)
stays under --budget-mib. The search: the fixed length is measured first (below); from it, lengths double (or halve,
where it does not fit) in powers of two times --base until the first miss (or fit), capped at --max-length, then one
bisection between the last fit and the first miss. Memory grows with the length, so the lengths between are not run.
A rank whose peak crosses the budget during the search stops there (a miss; the run is not finished).
The run at the fixed length (4 steps) stands for that length in the search.
- **step s** at --length: each step started after a barrier, the slowest rank's time, the median of 3 steps after 1
  warm-up, in the least disturbed (the lowest median) of --rounds runs, every contender's runs in alternating orders
  (A B C, C B A), since others may share this machine's 2 cores now and then;
  **CPU s** the same steps' process time (the larger rank's; steadier where others share the machine);
  **tokens/s** every replica's tokens over step s (2 sequences a step without sequence parallelism, 1 with it);
  **peak RSS** at that length over its 4 steps and a step's **growth** (the largest of the 3), the larger rank's.
The first step's loss is compared between contenders that train the same sequences from the same weights
(zerokit-sp and zerokit-sp-tiled beside deepspeed-alst, zerokit beside deepspeed).
Raw numbers per run go to --out (default bench_results/bench_sequence.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
MIB = 2 ** 20
CONTENDERS = ("zerokit", "zerokit-sp", "zerokit-sp-tiled", "deepspeed-alst", "deepspeed")
REFERENCE = "deepspeed-alst"  # the ratios' denominator
SEQUENCE_SPLIT = ("zerokit-sp", "zerokit-sp-tiled", "deepspeed-alst")  # both ranks train one sequence a step
SAME_STEPS = (("zerokit-sp", "deepspeed-alst"), ("zerokit-sp-tiled", "deepspeed-alst"), ("zerokit", "deepspeed"))
WORLD_SIZE, SEQUENCE_PARALLEL = 2, 2
IGNORE_INDEX = -100
OVER_BUDGET = 3  # a rank's exit status when its peak crossed the budget during the search
SKIPPED = 4  # a rank's exit status when its contender cannot run here (a module that does not import)
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# What goes between `python` and this file in a DeepSpeed contender's rank command: nothing here. The smoke test
# (tests/test_benchmarks.py) sets ["-m", "zerokit.testing.deepspeed_peer"], which runs this file unchanged without the
# C++ all-reduce DeepSpeed would compile first (See [Note: DeepSpeed's shared-memory all-reduce, not built for a
# peer] in zerokit/testing/deepspeed_peer.py); zerokit's ranks never import DeepSpeed.
DEEPSPEED_RANK_PREFIX: list[str] = []


@dataclass(frozen=True)
class Shape:
    """The Llama every contender trains."""

    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    mlp: int = 704
    vocab: int = 32_000


QUICK_SHAPE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, vocab=1024)


# --- one rank of one contender, in a process of its own ----------------------------------------------------------

def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Reset this process's VmHWM to its resident size now, which is returned."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def watch_budget(limit: int, out: Path) -> None:
    """From now on, a VmHWM above `limit` bytes ends this rank at once (a miss: the search needs no more of it)."""
    def watch() -> None:
        while True:
            peak = status_bytes("VmHWM")
            if peak > limit:
                out.write_text(json.dumps({"over_budget": True, "peak_rss": peak}))
                os._exit(OVER_BUDGET)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def build_model(shape: Shape, length: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.mlp,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=max(length, 2048),
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)  # the same weights in every rank of every contender
    return LlamaForCausalLM(config)


def sequence(shape: Shape, length: int, index: int) -> dict[str, torch.Tensor]:
    """The `index`-th sequence of the run: (1, length) random tokens, each its own label."""
    tokens = torch.randint(0, shape.vocab, (1, length), generator=torch.Generator().manual_seed(index))
    return {"input_ids": tokens, "labels": tokens.clone()}


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each token's target: the next token's label (none for the last), as engine.sequence.shard shifts them."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def next_token_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                             ignore_index=IGNORE_INDEX)


def tiles_for(shape: Shape, length: int) -> int:
    """Tiles of the rank's shard: one per `hidden` tokens, DeepSpeed's TiledMLP rule."""
    return max(1, math.ceil(length // SEQUENCE_PARALLEL / shape.hidden))


Step = Callable[[int], float]  # the step-th training step (forward, loss, backward, optimizer step); its loss


def zerokit_step(contender: str, shape: Shape, length: int, rank: int) -> Step:
    import zerokit

    model = build_model(shape, length)
    tiles = tiles_for(shape, length)
    if contender == "zerokit-sp-tiled":
        from zerokit.parallel.sequence.tiling import tile_mlp  # an ImportError: the contender is skipped
        tile_mlp(model, tiles)
    config: dict[str, Any] = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
                              "steps_per_print": 2 ** 30}
    if contender != "zerokit":
        config["sequence_parallel_size"] = SEQUENCE_PARALLEL
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), **ADAMW), config)

    def step(index: int) -> float:
        if contender == "zerokit":  # each rank a replica with its own whole sequence
            batch = sequence(shape, length, index * WORLD_SIZE + rank)
            logits = engine(input_ids=batch["input_ids"]).logits
            loss = next_token_loss(logits, shifted(batch["labels"]))
        else:  # both ranks one replica: the same sequence, each its shard
            shard = engine.sequence.shard(sequence(shape, length, index))
            if contender == "zerokit-sp-tiled":  # the last hidden states, no logits; the logits made tile by tile
                hidden = engine.sequence.hidden_states(engine, input_ids=shard["input_ids"],
                                                       position_ids=shard["position_ids"])
                loss = engine.sequence.tiled_loss(hidden, engine.module.lm_head, shard["shift_labels"], tiles)
                hidden = None
            else:
                logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
                loss = engine.sequence.loss(logits, shard["shift_labels"])
        logits = None  # only autograd holds what backward needs
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


def deepspeed_step(contender: str, shape: Shape, length: int, rank: int) -> Step:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(shape, length)
    adamw = {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True}  # torch's AdamW: no FusedAdam to compile
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                              "optimizer": {"type": "AdamW", "params": adamw}, "gradient_clipping": 0.0,
                              "steps_per_print": 2 ** 30}
    if contender == "deepspeed":
        engine, *_ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())

        def step(index: int) -> float:
            batch = sequence(shape, length, index * WORLD_SIZE + rank)
            logits = engine(input_ids=batch["input_ids"]).logits
            loss = next_token_loss(logits, shifted(batch["labels"]))
            logits = None
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step
    return alst_step(model, config, shape, length, rank)


def alst_step(model: torch.nn.Module, config: dict[str, Any], shape: Shape, length: int, rank: int) -> Step:
    """DeepSpeed's ALST as tests/scripts/ds_alst.py writes it (the tutorial's, the losses combined by all_reduce)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=SEQUENCE_PARALLEL,
        micro_batch_size=1, seq_length=length, seq_length_is_variable=True)
    config = {**config, "sequence_parallel_size": SEQUENCE_PARALLEL}
    engine, *_ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters(), mpu=mpu)
    sp_group = groups._get_sequence_parallel_group()
    loader = torch.utils.data.DataLoader(RankSequences(shape, length, rank), batch_size=None)
    batches = iter(UlyssesSPDataLoaderAdapter(loader, sp_rank=groups._get_sequence_parallel_rank(), sp_group=sp_group,
                                              sp_world_size=groups._get_sequence_parallel_world_size(),
                                              device=engine.device))

    def step(index: int) -> float:
        batch = next(batches)
        outputs = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        shift_labels = batch["shift_labels"]
        loss = engine.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                           vocab_size=engine.module.config.vocab_size)
        outputs = None
        good_tokens = (shift_labels != IGNORE_INDEX).view(-1).sum()
        total_loss = torch.distributed.nn.functional.all_reduce(loss * good_tokens, group=sp_group)
        total_good_tokens = torch.distributed.nn.functional.all_reduce(good_tokens.float(), group=sp_group)
        loss = total_loss / total_good_tokens.clamp(min=1)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


class RankSequences(torch.utils.data.Dataset):
    """Rank r's rows for DeepSpeed's loader adapter, which deals the sequence ranks' rows in turn (rank 0's, then rank
    1's): sequences r, r + 2, ..., so that step i trains on sequence i, as zerokit-sp's does; each made when read."""

    def __init__(self, shape: Shape, length: int, rank: int) -> None:
        self.shape, self.length, self.rank = shape, length, rank

    def __len__(self) -> int:
        return 32

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        tokens = sequence(self.shape, self.length, self.rank + row * SEQUENCE_PARALLEL)
        return {**tokens, "position_ids": torch.arange(self.length)[None]}


def run_rank(args: argparse.Namespace) -> int:
    """One rank of one run: args.warmup + args.steps training steps at args.length, each measured."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    rank, out = int(os.environ["RANK"]), Path(args.rank_out) / f"rank{os.environ['RANK']}.json"
    shape = QUICK_SHAPE if args.quick else Shape()
    family = deepspeed_step if args.contender.startswith("deepspeed") else zerokit_step
    if family is zerokit_step:
        dist.init_process_group("gloo")
    try:
        step = family(args.contender, shape, args.length, rank)
    except ImportError as error:
        out.write_text(json.dumps({"skipped": f"{type(error).__name__}: {error}"}))
        return SKIPPED
    if args.abort_mib:
        watch_budget(args.abort_mib * MIB, out)
    rows = [measured_step(step, index) for index in range(args.warmup + args.steps)]
    seconds = torch.tensor([row["seconds"] for row in rows], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # each step's slowest rank
    for row, slowest in zip(rows, seconds.tolist()):
        row["slowest_s"] = slowest
    out.write_text(json.dumps({"steps": rows, "parameters": sum(p.numel() for p in step_parameters(shape))}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def measured_step(step: Step, index: int) -> dict[str, float]:
    import torch.distributed as dist

    before = reset_peak()
    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    loss = step(index)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    peak = status_bytes("VmHWM")
    return {"seconds": seconds, "cpu_s": cpu, "loss": loss, "rss_before": before, "peak_rss": peak,
            "growth": peak - before}


def step_parameters(shape: Shape) -> list[torch.nn.Parameter]:
    with torch.device("meta"):
        return list(build_model(shape, 1).parameters())


# --- the runs, from the parent (which imports neither zerokit nor DeepSpeed) -------------------------------------

@dataclass(frozen=True)
class Plan:
    budget_mib: int
    length: int
    base: int
    max_length: int
    warmup: int
    steps: int
    rounds: int
    timeout: float
    quick: bool


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(contender: str, length: int, warmup: int, steps: int, abort_mib: int, plan: Plan) -> dict[str, Any]:
    """Both ranks of one run, each a fresh interpreter (as torchrun starts them); what they measured, joined."""
    with tempfile.TemporaryDirectory(prefix="zerokit-bench-seq-") as directory:
        port = free_port()
        prefix = DEEPSPEED_RANK_PREFIX if contender.startswith("deepspeed") else []
        command = [sys.executable, *prefix, __file__, "--rank-out", directory, "--contender", contender, "--length",
                   str(length), "--warmup", str(warmup), "--steps", str(steps), "--abort-mib", str(abort_mib),
                   *(["--quick"] if plan.quick else [])]
        logs = [Path(directory) / f"log{rank}.txt" for rank in range(WORLD_SIZE)]
        ranks = [subprocess.Popen(command, env=rank_environment(rank, port), cwd=ROOT, stdout=log.open("w"),
                                  stderr=subprocess.STDOUT) for rank, log in zip(range(WORLD_SIZE), logs)]
        codes = wait_for(ranks, plan.timeout)
        results = [json.loads(path.read_text()) if path.exists() else {}
                   for path in (Path(directory) / f"rank{rank}.json" for rank in range(WORLD_SIZE))]
        return joined(contender, length, codes, results, logs)


def rank_environment(rank: int, port: int) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**environment, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))}


def wait_for(ranks: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Each rank's exit status; once one has failed (or the time is up), the others are killed (None: killed)."""
    give_up = time.monotonic() + timeout
    while any(rank.poll() is None for rank in ranks):
        failed = any(rank.returncode not in (None, 0) for rank in ranks)
        if failed or time.monotonic() > give_up:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
            break
        time.sleep(0.05)
    return [None if rank.wait() < 0 else rank.returncode for rank in ranks]


def joined(contender: str, length: int, codes: list[int | None], results: list[dict], logs: list[Path]) -> dict:
    """One run's row: over budget, skipped, failed, or both ranks' steps joined (the larger rank's memory)."""
    row: dict[str, Any] = {"length": length}
    if OVER_BUDGET in codes:
        peak = max(result.get("peak_rss", 0) for result in results)
        return {**row, "fits": False, "over_budget": True, "peak_rss_mib": peak / MIB}
    if SKIPPED in codes:
        return {**row, "skipped": next(result["skipped"] for result in results if "skipped" in result)}
    if any(code != 0 for code in codes) or not all("steps" in result for result in results):
        tail = [line for log in logs for line in log.read_text().splitlines() if line.strip()]
        error = next((line for line in reversed(tail) if "Error" in line), tail[-1] if tail else "no output")
        return {**row, "error": f"exit {codes}: {error[:400]}"}
    steps = [result["steps"] for result in results]
    per_step = list(zip(*steps))  # per step: each rank's row
    return {**row, "parameters": results[0]["parameters"],
            "peak_rss_mib": max(r["peak_rss"] for ranks in per_step for r in ranks) / MIB,
            "rss_before_mib": [max(r["rss_before"] for r in ranks) / MIB for ranks in per_step],
            "growth_mib": [max(r["growth"] for r in ranks) / MIB for ranks in per_step],
            "step_s": [ranks[0]["slowest_s"] for ranks in per_step],
            "cpu_s": [max(r["cpu_s"] for r in ranks) for ranks in per_step],
            "losses": [[r["loss"] for r in ranks] for ranks in per_step]}


def fixed_length(contender: str, plan: Plan) -> dict[str, Any]:
    """The step time at plan.length: 1 warm-up and 3 timed steps (slowest rank, median), and the memory of all."""
    load = os.getloadavg()[0]  # the machine's 1-minute load as the run starts: step times on a shared machine
    row = {**launch(contender, plan.length, plan.warmup, plan.steps, 0, plan), "load_average": load}
    if "step_s" in row:
        median = statistics.median(row["step_s"][plan.warmup:])
        replicas = 1 if contender in SEQUENCE_SPLIT else WORLD_SIZE  # sequences trained per step
        row.update(median_step_s=median, tokens_per_s=replicas * plan.length / median,
                   median_cpu_s=statistics.median(row["cpu_s"][plan.warmup:]),
                   fits=row["peak_rss_mib"] < plan.budget_mib, step_growth_mib=max(row["growth_mib"][plan.warmup:]))
    return row


def fits(contender: str, length: int, plan: Plan, known: dict[int, dict]) -> bool:
    """Whether 2 steps at `length` keep every rank's peak RSS under the budget (a run of its own, once)."""
    if length not in known:
        known[length] = launch(contender, length, 0, 2, plan.budget_mib, plan)
        row = known[length]
        if "peak_rss_mib" in row and "over_budget" not in row:
            row["fits"] = row["peak_rss_mib"] < plan.budget_mib
        print(f"    {contender:<17} {length:>6} tokens: {describe(row, plan)}", flush=True)
    return bool(known[length].get("fits"))


def describe(row: dict[str, Any], plan: Plan) -> str:
    if "error" in row or "skipped" in row:
        return row.get("error") or f"skipped ({row['skipped']})"
    if row.get("over_budget"):
        return f"over {plan.budget_mib} MiB (stopped)"
    return f"peak RSS {row['peak_rss_mib']:.0f} MiB, {'fits' if row['fits'] else 'over'}"


def longest(contender: str, plan: Plan, known: dict[int, dict]) -> int | None:
    """The longest of the lengths tried that fits (See the module's docstring); 0: not even --base fits."""
    length = plan.length
    if fits(contender, length, plan, known):
        while length * 2 <= plan.max_length and fits(contender, length * 2, plan, known):
            length *= 2
        last_fit, first_miss = length, (length * 2 if length * 2 <= plan.max_length else None)
    else:
        while length // 2 >= plan.base and not fits(contender, length // 2, plan, known):
            length //= 2
        last_fit, first_miss = (length // 2 if length // 2 >= plan.base else 0), length
    if any("error" in row for row in known.values()):
        return None
    if first_miss is None or last_fit == 0:
        return last_fit
    step = plan.base // 2  # the bisection's grain: a multiple of the sequence degree and of a tile
    middle = (last_fit + first_miss) // 2 // step * step
    return middle if middle > last_fit and fits(contender, middle, plan, known) else last_fit


def timed_rounds(names: list[str], plan: Plan) -> dict[str, list[dict]]:
    """Each contender's runs at plan.length, one a round, the rounds in alternating orders (A B C, C B A), so that
    a machine that others load now and then weighs on every contender alike."""
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(plan.rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            if rounds[name] and "median_step_s" not in rounds[name][-1]:
                continue  # skipped or failed: once is enough
            print(f"  {name}: {plan.length} tokens, {plan.warmup} + {plan.steps} steps (round {index + 1})", flush=True)
            rounds[name].append(fixed_length(name, plan))
            row = rounds[name][-1]
            shown = f"step {row['median_step_s']:.2f} s, " if "median_step_s" in row else ""
            print(f"    {shown}{describe(row, plan)}", flush=True)
    return rounds


def searched(contender: str, rounds: list[dict], plan: Plan) -> dict[str, Any]:
    """The contender's row: its least disturbed round at plan.length (the lowest median step), and the search."""
    done = [row for row in rounds if "median_step_s" in row]
    if not done:
        return {"fixed": rounds[-1], "rounds": rounds}
    at_length = min(done, key=lambda row: row["median_step_s"])
    known = {plan.length: {key: at_length[key] for key in ("length", "peak_rss_mib", "fits")}}
    print(f"  {contender}: the search", flush=True)
    best = longest(contender, plan, known)
    search = [known[length] for length in sorted(known)]
    return {"fixed": at_length, "rounds": rounds, "longest": best, "search": search}


# --- the table -------------------------------------------------------------------------------------------------

def table(rows: dict[str, dict], plan: Plan) -> list[str]:
    reference = rows.get(REFERENCE, {})
    lines = [f"{'contender':<17} {'longest in budget':>17} {'peak RSS MiB':>12} {'growth MiB':>10} {'step s':>7} "
             f"{'CPU s':>6} {'tokens/s':>8}   vs {REFERENCE}: longest / peak RSS / step s"]
    for name, row in rows.items():
        fixed = row["fixed"]
        if "median_step_s" not in fixed:
            lines.append(f"{name:<17} {fixed.get('error') or 'skipped: ' + fixed.get('skipped', '')}"[:200])
            continue
        best = row["longest"]
        shown = "failed" if best is None else ("< " if best == 0 else ">= " if best >= plan.max_length else "") + \
            f"{best or plan.base:,}"
        lines.append(f"{name:<17} {shown:>17} {fixed['peak_rss_mib']:>12.0f} {fixed['step_growth_mib']:>10.0f} "
                     f"{fixed['median_step_s']:>7.2f} {fixed['median_cpu_s']:>6.2f} {fixed['tokens_per_s']:>8.0f}   "
                     f"{ratios(row, reference)}")
    return lines


def ratios(row: dict[str, Any], reference: dict[str, Any]) -> str:
    if "median_step_s" not in reference.get("fixed", {}):
        return "-"
    mine, theirs = row["fixed"], reference["fixed"]
    lengths = f"{row['longest'] / reference['longest']:.2f}x" if row.get("longest") and reference.get("longest") \
        else "-"
    return (f"{lengths} / {mine['peak_rss_mib'] / theirs['peak_rss_mib']:.2f}x / "
            f"{mine['median_step_s'] / theirs['median_step_s']:.2f}x")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CONTENDERS), help="contenders, comma-separated")
    parser.add_argument("--budget-mib", type=int, default=1024, help="each rank's process RSS cap")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence of the timed steps")
    parser.add_argument("--base", type=int, default=512, help="the search's lengths: powers of two times this")
    parser.add_argument("--max-length", type=int, default=32_768, help="the search's cap")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps at --length")
    parser.add_argument("--rounds", type=int, default=2, help="runs at --length, in alternating orders")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one run's ranks")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a tiny Llama at 256 tokens (1 warm-up + 1 step), the search capped there")
    parser.add_argument("--out", default="bench_results/bench_sequence.json")
    parser.add_argument("--contender", help=argparse.SUPPRESS)  # a rank: which contender
    parser.add_argument("--abort-mib", type=int, default=0, help=argparse.SUPPRESS)  # a rank: stop above this peak
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)  # a rank: where it writes what it measured
    return parser.parse_args(argv)


def plan_of(args: argparse.Namespace) -> Plan:
    if args.quick:
        return Plan(budget_mib=args.budget_mib, length=256, base=64, max_length=256, warmup=1, steps=1, rounds=1,
                    timeout=min(args.timeout, 120.0), quick=True)
    times = args.length // args.base
    if args.length % args.base or times & (times - 1):
        raise ValueError(f"--length {args.length} must be --base {args.base} times a power of two")
    return Plan(budget_mib=args.budget_mib, length=args.length, base=args.base, max_length=args.max_length,
                warmup=args.warmup, steps=args.steps, rounds=args.rounds, timeout=args.timeout, quick=False)


def why_skipped(contender: str) -> str | None:
    if contender.startswith("deepspeed") and find_spec("deepspeed") is None:
        return "deepspeed is not installed (`pip install deepspeed`)"
    return None


def run_all(names: list[str], plan: Plan) -> tuple[dict[str, dict], dict[str, str]]:
    """Each contender's row, and why each skipped one was: the timed rounds of all, then each one's search."""
    skipped = {name: reason for name, reason in ((name, why_skipped(name)) for name in names) if reason}
    rounds = timed_rounds([name for name in names if name not in skipped], plan)
    skipped.update({name: runs[-1]["skipped"] for name, runs in rounds.items() if "skipped" in runs[-1]})
    rows = {name: searched(name, runs, plan) for name, runs in rounds.items() if name not in skipped}
    return rows, skipped


def agreement(rows: dict[str, dict]) -> dict[str, float]:
    """The relative difference of the first step's loss between contenders that train the same sequences from the
    same weights (a contender that trains wrong shows here)."""
    first = {name: row["fixed"]["losses"][0][0] for name, row in rows.items() if "losses" in row["fixed"]}
    return {f"{mine} vs {theirs}": abs(first[mine] - first[theirs]) / abs(first[theirs])
            for mine, theirs in SAME_STEPS if mine in first and theirs in first}


def summary(rows: dict[str, dict], skipped: dict[str, str], plan: Plan) -> list[str]:
    lines = [f"at {plan.length} tokens: peak RSS and a step's growth (the larger rank), step s (the slowest rank, "
             f"median of {plan.steps}) and its CPU s (the larger rank's process time), tokens/s (every replica's); "
             f"longest: the longest length tried whose 2 steps stayed under {plan.budget_mib} MiB a rank",
             *table(rows, plan), *(f"{name}: skipped, {reason}" for name, reason in skipped.items())]
    loads = ", ".join(f"{name} {row['fixed']['load_average']:.1f}" for name, row in rows.items())
    return lines + [f"first step's loss, relative difference: {pair} {difference:.1e}"
                    for pair, difference in agreement(rows).items()] + [
        f"1-minute load average as each timed run started (its own 2 ranks keep it near 2): {loads}"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_out:
        return run_rank(args)
    plan, names = plan_of(args), [name for name in args.only.split(",") if name]
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contender(s) {', '.join(sorted(unknown))}; accepted: {', '.join(CONTENDERS)}")
    shape = QUICK_SHAPE if plan.quick else Shape()
    print(f"Llama {shape} fp32, AdamW, ZeRO-3, {WORLD_SIZE} gloo ranks, budget {plan.budget_mib} MiB a rank",
          flush=True)
    started = time.perf_counter()
    rows, skipped = run_all(names, plan)
    lines = summary(rows, skipped, plan)
    print("\n".join(lines))
    command = ["python", "benchmarks/bench_sequence.py", *(sys.argv[1:] if argv is None else argv)]
    report = {"command": " ".join(command), "torch": torch.__version__, "versions": versions(),
              "shape": asdict(shape), "plan": asdict(plan), "world_size": WORLD_SIZE,
              "sequence_parallel_size": SEQUENCE_PARALLEL, "contenders": rows, "skipped": skipped,
              "first_loss_difference": agreement(rows), "table": lines,
              "seconds": round(time.perf_counter() - started, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def versions(packages: tuple[str, ...] = ("transformers", "deepspeed")) -> dict[str, str | None]:
    """Each package's installed version, None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


if __name__ == "__main__":
    sys.exit(main())
