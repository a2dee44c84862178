"""DeepSpeed's MoE layer on zerokit beside DeepSpeed's own, at ZeRO 1-3 with and without expert parallelism (issue 45,
item 8): a small MoE GPT on 4 gloo ranks, step time, per-rank peak RSS and the bytes each rank's all-to-alls carry.

    python benchmarks/bench_moe.py                                        # every row, 2 rounds
    python benchmarks/bench_moe.py --only zerokit-z2-ep4,deepspeed-z2-ep4 --rounds 3
    python benchmarks/bench_moe.py --quick                                # a tiny smoke run (2 rows, 1 round)

The model: one training script (`train_step`) run by every rank, importing `deepspeed` or `zerokit.deepspeed as
deepspeed` according to the contender and nothing else different, as tests/scripts/ds_moe.py runs on both. A GPT
(hidden 256, 4 layers of 4 heads, learned positions, a vocabulary of 8,192 and an untied head, 256 tokens) whose MLP
in each block is a `deepspeed.moe.layer.MoE` of 8 MLP experts (256 -> 1024 -> 256, GELU), top-2, dropless
(drop_tokens=False): no token is lost to a capacity, so the loss does not hang on one, and the all-to-all carries
what each engine's dropless dispatch sends (zerokit: each expert's rows, after a count exchange; DeepSpeed: every
expert padded to the largest count in the expert group). 22.1M parameters, 16.8M of them experts'. The loss: next
token cross entropy plus 0.01 times the layers' summed gate aux loss. fp32; torch's AdamW from the config's optimizer
block with "torch_adam": true (DeepSpeed builds no C++ FusedAdam), its groups split by
split_params_into_different_moe_groups_for_optimizer; gradient_clipping 1.0; micro-batch 2 sequences a rank;
`deepspeed.init_distributed(dist_backend="gloo")`. The weights are seeded alike on every rank of every contender (an
expert is a copy of one module, as DeepSpeed makes them, so a rank that holds 2 of the 8 holds the same weights as
one that holds all 8); each rank's data and the gate's random draws (top-2's second-expert sampling) are seeded by
the rank after initialize, so both engines route the same tokens the same way.

In DeepSpeed's rank processes, deepspeed.comm.torch.build_shm_op is replaced by `lambda: None` before
init_distributed: DeepSpeed would otherwise compile its shared-memory op at start (30-90 s here), which only its
inference_all_reduce uses; training never calls it.

Rows (`--only`, comma-separated): zerokit-z{0,1,2,3}-ep{1,2,4} and deepspeed-z{1,2}-ep{1,2,4} (ZeRO stage, ep_size).
ep1: every rank holds every expert; ep2: 2 expert groups of 2 ranks, each expert's states sharded over its
expert-data group of 2; ep4: one group of 4, each rank 2 experts per layer, held by no other rank. The full run:
zerokit at ZeRO 1-3 and every ep_size, DeepSpeed at ZeRO 1-2 and every ep_size (zerokit's ZeRO 0 rows only with
--only). DeepSpeed refuses its native MoE at ZeRO 3 at any ep_size, so zerokit's ZeRO 3 rows have no peer; zerokit
splits experts at ZeRO 3 (See [Note: split experts in a ZeRO-3 job] in zerokit/parallel/experts/share.py), each MoE
layer a unit of its own there (stage3_unit_classes, a zerokit key).

Each contender's 4 ranks are fresh interpreters, started as torchrun starts them (zerokit and DeepSpeed are never
imported in the same process), with OMP_NUM_THREADS=1 and MALLOC_MMAP_THRESHOLD_=131072 (glibc hands a freed large
block back at once, so the resident size is what the process holds). Measured on each rank (its /proc/self/status):
- **step s**: each step started after a barrier, the slowest rank's wall time; the median of --steps after --warmup;
  **CPU s** the same steps' process time, the largest rank's (steadier where others share the machine: 4 ranks
  on this machine's 2 cores wait for a core in wall time, not in CPU time), and in the JSON by phase (forward and
  loss, backward, optimizer step);
- **peak RSS**: the largest VmHWM after a step (the mark reset to the resident size before each step, writing 5 to
  /proc/self/clear_refs): interpreter, libraries, model states and the step's transients; the largest rank's, and
  the spread between the largest and smallest rank; a step's **growth**: VmHWM after it less VmRSS before it;
- **all-to-all MiB**: the input bytes of every torch.distributed.all_to_all_single and all_to_all a rank called in
  a step (both engines' dispatch call all_to_all_single: zerokit/parallel/experts/dispatch.py, DeepSpeed's
  sharded_moe._AllToAll through deepspeed.comm), counted by wrapping those two functions in the rank process; the
  mean over the timed steps and ranks, and the part that left the rank (the input less what a rank sends itself);
- **states MiB**: model-state bytes a rank holds after its last step: zerokit's engine.memory_stats(); DeepSpeed's
  counted from its ZeRO optimizer's storages (parameter flats, fp32 partition, AdamW state), each storage once;
- every step's **loss** per rank, compared between zerokit and DeepSpeed at the same stage and ep_size: the first
  step's (the same weights and routes) and the largest difference over all steps (the training).
Every row runs --rounds times, the rows in alternating orders (A B C, C B A), each zerokit row beside its DeepSpeed
peer; a row's figures are those of its least disturbed round (the lowest median step s); every round's raw numbers
go to --out (default bench_results/bench_moe.json). A run whose rendezvous port another process took first is
started again.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: benchmarks/ is not a package on the path yet
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_sequence import free_port, reset_peak, status_bytes, versions, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 2 ** 20
WORLD_SIZE = 4
AUX_WEIGHT = 0.01  # the gate's aux loss in the training loss, as DeepSpeed's MoE tutorial adds it
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True}
SKIPPED = 4  # a rank's exit status when its engine does not import here
ZERO3_UNITS = {"stage3_unit_classes": ["MoE"], "stage3_param_persistence_threshold": 0}  # zerokit's keys


@dataclass(frozen=True)
class Shape:
    """The MoE GPT every contender trains."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 8192
    length: int = 256
    micro_batch: int = 2
    experts: int = 8
    k: int = 2


QUICK_SHAPE = Shape(hidden=32, layers=2, heads=2, vocab=256, length=32)


@dataclass(frozen=True)
class Row:
    engine: str  # zerokit or deepspeed
    stage: int
    ep: int

    @property
    def name(self) -> str:
        return f"{self.engine}-z{self.stage}-ep{self.ep}"


def all_rows() -> dict[str, Row]:
    """Every row this benchmark knows, in the table's and the runs' order: each zerokit row beside its DeepSpeed
    peer (ZeRO 1-2 only), so that a drift in the machine's load between runs weighs on both of a pair alike."""
    rows = [Row(engine, stage, ep) for ep in (1, 2, 4) for stage in (0, 1, 2, 3) for engine in ("zerokit", "deepspeed")
            if engine == "zerokit" or stage in (1, 2)]
    return {row.name: row for row in rows}


ROWS = all_rows()
# The full run: zerokit at ZeRO 1-3, DeepSpeed at ZeRO 1-2, each at every ep_size
DEFAULT_ROWS = tuple(name for name, row in ROWS.items() if row.stage > 0)
QUICK_ROWS = ("zerokit-z2-ep2", "deepspeed-z2-ep2")
ZERO3_NOTE = "no deepspeed-z3 rows: DeepSpeed refuses its native MoE at ZeRO 3, at any ep_size"


# --- the training script every rank runs ---------------------------------------------------------------------

def engine_package(engine: str) -> Any:
    """`deepspeed`, or `zerokit.deepspeed` as the script's `deepspeed` (the only line a switched script changes)."""
    if engine == "zerokit":
        import zerokit.deepspeed as deepspeed
        return deepspeed
    import deepspeed
    import deepspeed.comm.torch

    # init_distributed would compile DeepSpeed's shared-memory op (30-90 s); only inference_all_reduce uses it
    deepspeed.comm.torch.build_shm_op = lambda: None
    return deepspeed


class Attention(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.proj = nn.Linear(shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, width))


class Block(nn.Module):
    """Attention, then a mixture of MLP experts in the MLP's place (pre-norm, residual)."""

    def __init__(self, shape: Shape, moe_class: type, ep: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(shape.hidden), nn.LayerNorm(shape.hidden)
        self.attention = Attention(shape)
        expert = nn.Sequential(nn.Linear(shape.hidden, 4 * shape.hidden), nn.GELU(),
                               nn.Linear(4 * shape.hidden, shape.hidden))
        self.moe = moe_class(shape.hidden, expert, num_experts=shape.experts, ep_size=ep, k=shape.k,
                             drop_tokens=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.norm1(x))
        out, aux, _ = self.moe(self.norm2(x))
        return x + out, aux


class MoEGPT(nn.Module):
    def __init__(self, shape: Shape, moe_class: type, ep: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.position = nn.Embedding(shape.length, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape, moe_class, ep) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        aux = x.new_zeros(())
        for block in self.blocks:
            x, layer_aux = block(x)
            aux = aux + layer_aux
        return self.head(self.norm(x)), aux


def batch(shape: Shape, rank: int, step: int) -> torch.Tensor:
    """(micro_batch, length + 1) random tokens of `rank` at `step`, the same for every contender."""
    generator = torch.Generator().manual_seed(1_000 * step + rank)
    return torch.randint(0, shape.vocab, (shape.micro_batch, shape.length + 1), generator=generator)


def config_of(row: Row, shape: Shape) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": row.stage}
    if row.engine == "zerokit" and row.stage == 3 and row.ep > 1:
        zero.update(ZERO3_UNITS)  # each MoE layer a unit: gathered and freed around its split experts
    return {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": ADAMW},
            "zero_optimization": zero, "steps_per_print": 2 ** 30}


# The step-th training step (forward and loss, backward, optimizer step): its loss, and each phase's process time
Step = Callable[[int], tuple[float, dict[str, float]]]


def train_step(row: Row, shape: Shape, rank: int) -> tuple[Step, Any]:
    """The script: the engine built as a DeepSpeed MoE script builds it; its step, and the engine."""
    deepspeed = engine_package(row.engine)
    moe_layer = importlib.import_module(f"{deepspeed.__name__}.moe.layer")
    moe_utils = importlib.import_module(f"{deepspeed.__name__}.moe.utils")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)  # the same weights on every rank of every contender
    model = MoEGPT(shape, moe_layer.MoE, row.ep)
    groups = moe_utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config_of(row, shape))
    torch.manual_seed(1 + rank)  # the gate's random draws, from here on alike in both engines

    def step(index: int) -> tuple[float, dict[str, float]]:
        tokens, started = batch(shape, rank, index), time.process_time()
        logits, aux = engine(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1))
        loss = loss + AUX_WEIGHT * aux
        logits = None  # only autograd holds what backward needs
        forward = time.process_time()
        engine.backward(loss)
        backward = time.process_time()
        engine.step()
        phases = {"forward": forward - started, "backward": backward - forward, "step": time.process_time() - backward}
        return loss.item(), phases

    return step, engine


# --- what a rank measures -----------------------------------------------------------------------------------

class AllToAllCounter:
    """Input bytes of every all_to_all_single and all_to_all this process calls, and the part that leaves the rank.
    Both engines reach torch.distributed's functions by attribute at call time (zerokit's dispatch directly,
    DeepSpeed's through deepspeed.comm), so replacing the attributes sees every call of either."""

    def __init__(self) -> None:
        self.calls, self.bytes, self.off_rank = 0, 0, 0

    def install(self) -> None:
        import torch.distributed as dist

        single, listed = dist.all_to_all_single, dist.all_to_all

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            self.count(input.numel() * input.element_size(), self.own_share(input, input_split_sizes, group))
            return single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
            own = input_tensor_list[dist.get_rank(group)]
            self.count(sum(t.numel() * t.element_size() for t in input_tensor_list), own.numel() * own.element_size())
            return listed(output_tensor_list, input_tensor_list, group=group, async_op=async_op)

        dist.all_to_all_single, dist.all_to_all = all_to_all_single, all_to_all

    @staticmethod
    def own_share(input: torch.Tensor, split_sizes: list[int] | None, group: Any) -> int:
        """Bytes of `input` that this rank sends itself (they never leave it)."""
        import torch.distributed as dist

        ranks, me = dist.get_world_size(group), dist.get_rank(group)
        row_bytes = input[0].numel() * input.element_size() if input.dim() else input.element_size()
        rows = split_sizes[me] if split_sizes else input.shape[0] // ranks
        return rows * row_bytes

    def count(self, sent: int, own: int) -> None:
        self.calls, self.bytes, self.off_rank = self.calls + 1, self.bytes + sent, self.off_rank + sent - own

    def take(self) -> dict[str, int]:
        """What was counted since the last take."""
        counted = {"calls": self.calls, "bytes": self.bytes, "off_rank_bytes": self.off_rank}
        self.calls, self.bytes, self.off_rank = 0, 0, 0
        return counted


def measured_step(step: Step, index: int, counter: AllToAllCounter) -> dict[str, Any]:
    import torch.distributed as dist

    before = reset_peak()
    counter.take()
    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    loss, phases = step(index)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    peak = status_bytes("VmHWM")
    return {"seconds": seconds, "cpu_s": cpu, "phase_cpu_s": phases, "loss": loss, "rss_before": before,
            "peak_rss": peak, "growth": peak - before, "all_to_all": counter.take()}


def state_bytes(row: Row, engine: Any) -> dict[str, int]:
    """Model-state bytes this rank holds, by category (See the module's docstring)."""
    if row.engine == "zerokit":
        return dict(engine.memory_stats())
    zero = engine.optimizer  # DeepSpeedZeroOptimizer (stages 1-2): flat groups, fp32 partitions, the inner AdamW
    optimizer_state = [t for state in zero.optimizer.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor)]
    return distinct_storage_bytes({"parameters": [*zero.bit16_groups_flat, *engine.module.parameters()],
                                   "optimizer_state": [*zero.single_partition_of_fp32_groups, *optimizer_state]})


def distinct_storage_bytes(categories: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes of the distinct storages each category reaches, a storage counted once, in the first category that
    reaches it (a parameter is a view into DeepSpeed's flat group). benchmarks/accounting.py counts the same way,
    but it imports zerokit, which a DeepSpeed rank must not."""
    seen: set[int] = set()
    counted = {}
    for category, tensors in categories.items():
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        counted[category] = sum(size for pointer, size in storages.items() if pointer not in seen)
        seen.update(storages)
    return counted


def run_rank(args: argparse.Namespace) -> int:
    """One rank of one run: args.warmup + args.steps training steps, each measured."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 ranks on a few cores
    rank, out = int(os.environ["RANK"]), Path(args.rank_out) / f"rank{os.environ['RANK']}.json"
    row, shape = ROWS[args.contender], QUICK_SHAPE if args.quick else Shape()
    started = time.perf_counter()
    try:
        step, engine = train_step(row, shape, rank)
    except ImportError as error:
        out.write_text(json.dumps({"skipped": f"{type(error).__name__}: {error}"}))
        return SKIPPED
    setup_s = time.perf_counter() - started  # the engine's import, init_distributed, the model and initialize
    counter = AllToAllCounter()
    counter.install()
    steps = [measured_step(step, index, counter) for index in range(args.warmup + args.steps)]
    seconds = torch.tensor([s["seconds"] for s in steps], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # each step's slowest rank
    for measured, slowest in zip(steps, seconds.tolist()):
        measured["slowest_s"] = slowest
    parameters = sum(p.numel() for p in engine.module.parameters())  # this rank's module (its local experts)
    out.write_text(json.dumps({"steps": steps, "states": state_bytes(row, engine), "local_parameters": parameters,
                               "setup_s": setup_s}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --- the runs, from the parent (which imports neither zerokit nor DeepSpeed) ---------------------------------

@dataclass(frozen=True)
class Plan:
    warmup: int
    steps: int
    rounds: int
    timeout: float
    quick: bool


def launch(name: str, plan: Plan, attempts: int = 3) -> dict[str, Any]:
    """One run of a row. A run whose rendezvous port another process took between free_port and rank 0's bind
    (EADDRINUSE: others' jobs share this machine) is started again: the machine's race, not the row's failure."""
    for _ in range(attempts):
        run = launch_once(name, plan)
        if "EADDRINUSE" not in run.get("error", ""):
            break
    return run


def launch_once(name: str, plan: Plan) -> dict[str, Any]:
    """The 4 ranks of one run, each a fresh interpreter (as torchrun starts them); what they measured, joined."""
    with tempfile.TemporaryDirectory(prefix="zerokit-bench-moe-") as directory:
        port = free_port()
        command = [sys.executable, __file__, "--rank-out", directory, "--contender", name, "--warmup",
                   str(plan.warmup), "--steps", str(plan.steps), *(["--quick"] if plan.quick else [])]
        logs = [Path(directory) / f"log{rank}.txt" for rank in range(WORLD_SIZE)]
        ranks = [subprocess.Popen(command, env=rank_environment(rank, port), cwd=ROOT, stdout=log.open("w"),
                                  stderr=subprocess.STDOUT) for rank, log in enumerate(logs)]
        codes = wait_for(ranks, plan.timeout)
        results = [json.loads(path.read_text()) if path.exists() else {}
                   for path in (Path(directory) / f"rank{rank}.json" for rank in range(WORLD_SIZE))]
        return joined(codes, results, logs, plan)


def rank_environment(rank: int, port: int) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**environment, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_WORLD_SIZE": str(WORLD_SIZE), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))}


def joined(codes: list[int | None], results: list[dict], logs: list[Path], plan: Plan) -> dict[str, Any]:
    """One run: skipped, failed, or every rank's steps joined (the timed ones for times and memory)."""
    if SKIPPED in codes:
        return {"skipped": next(result["skipped"] for result in results if "skipped" in result)}
    if any(code != 0 for code in codes) or not all("steps" in result for result in results):
        tail = [line for log in logs for line in log.read_text().splitlines() if line.strip()]
        error = next((line for line in reversed(tail) if "Error" in line), tail[-1] if tail else "no output")
        return {"error": f"exit {codes}: {error[:400]}"}
    timed = [result["steps"][plan.warmup:] for result in results]  # per rank, its timed steps
    peaks = [max(s["peak_rss"] for s in result["steps"]) for result in results]  # per rank, over all its steps
    moved = [s["all_to_all"] for steps in timed for s in steps]
    phases = {phase: max(statistics.median(s["phase_cpu_s"][phase] for s in steps) for steps in timed)
              for phase in timed[0][0]["phase_cpu_s"]}
    return {"median_step_s": statistics.median(s["slowest_s"] for s in timed[0]),
            "median_cpu_s": statistics.median(max(per_rank) for per_rank in zip(*[[s["cpu_s"] for s in steps]
                                                                                   for steps in timed])),
            "median_phase_cpu_s": phases,  # each phase: the largest rank's median over the timed steps
            "peak_rss_mib": max(peaks) / MIB, "peak_rss_spread_mib": (max(peaks) - min(peaks)) / MIB,
            "step_growth_mib": max(s["growth"] for steps in timed for s in steps) / MIB,
            "all_to_all_mib": statistics.mean(m["bytes"] for m in moved) / MIB,
            "all_to_all_max_mib": max(m["bytes"] for m in moved) / MIB,
            "all_to_all_off_rank_mib": statistics.mean(m["off_rank_bytes"] for m in moved) / MIB,
            "all_to_all_calls": max(m["calls"] for m in moved),
            "states_mib": max(sum(result["states"].values()) for result in results) / MIB,
            "first_losses": [result["steps"][0]["loss"] for result in results],
            "losses": [[s["loss"] for s in result["steps"]] for result in results],  # per rank, every step
            "local_parameters": [result["local_parameters"] for result in results],
            "setup_s": max(result["setup_s"] for result in results),
            "ranks": results}


def timed_rounds(names: list[str], plan: Plan) -> dict[str, list[dict]]:
    """Each row's runs, one a round, the rounds in alternating orders (A B C, C B A), so that a machine that others
    load now and then weighs on every row alike."""
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(plan.rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            if rounds[name] and "median_step_s" not in rounds[name][-1]:
                continue  # skipped or failed: once is enough
            load, started = os.getloadavg()[0], time.perf_counter()
            run = {**launch(name, plan), "load_average": load, "wall_s": time.perf_counter() - started}
            rounds[name].append(run)
            print(f"  round {index + 1} {name:<17} {describe(run)}", flush=True)
    return rounds


def describe(run: dict[str, Any]) -> str:
    if "median_step_s" not in run:
        return run.get("error") or f"skipped ({run['skipped']})"
    return (f"step {run['median_step_s']:.2f} s, CPU {run['median_cpu_s']:.2f} s, peak RSS {run['peak_rss_mib']:.0f} "
            f"MiB, all-to-all {run['all_to_all_mib']:.1f} MiB, loss {run['first_losses'][0]:.6f} "
            f"(load {run['load_average']:.1f}, {run['wall_s']:.0f} s)")


def chosen(runs: list[dict]) -> dict[str, Any]:
    """The row's least disturbed round (the lowest median step s), or its last run where none finished."""
    done = [run for run in runs if "median_step_s" in run]
    return min(done, key=lambda run: run["median_step_s"]) if done else runs[-1]


# --- the table -------------------------------------------------------------------------------------------------

def peer_of(name: str) -> str:
    """The DeepSpeed row at a zerokit row's stage and ep_size."""
    return name.replace("zerokit-", "deepspeed-", 1)


def loss_difference(mine: list[list[float]], theirs: list[list[float]]) -> float:
    """The largest relative difference of the losses over the ranks (each rank trains its own batch) and steps."""
    return max(abs(a - b) / abs(b) for ours, peers in zip(mine, theirs) for a, b in zip(ours, peers))


def agreement(best: dict[str, dict]) -> dict[str, dict[str, float]]:
    """zerokit's losses beside DeepSpeed's at the same stage and ep_size: the first step's (the same weights and
    routes: the forward alone) and every step's (after clipped AdamW steps: the training)."""
    pairs = [(name, peer_of(name)) for name in best if name.startswith("zerokit")]
    return {f"{mine} vs {theirs}": {"first_step": loss_difference([[loss] for loss in best[mine]["first_losses"]],
                                                                   [[loss] for loss in best[theirs]["first_losses"]]),
                                    "every_step": loss_difference(best[mine]["losses"], best[theirs]["losses"])}
            for mine, theirs in pairs if "losses" in best[mine] and "losses" in best.get(theirs, {})}


def ratios(name: str, best: dict[str, dict]) -> str:
    mine, theirs = best[name], best.get(peer_of(name), {})
    if not name.startswith("zerokit") or "median_step_s" not in theirs or "median_step_s" not in mine:
        return "-"
    keys = ("median_step_s", "median_cpu_s", "peak_rss_mib", "states_mib")
    return " / ".join(f"{mine[key] / theirs[key]:.2f}x" for key in keys)


def table(rounds: dict[str, list[dict]]) -> list[str]:
    best = {name: chosen(runs) for name, runs in rounds.items()}
    lines = [f"{'row':<17} {'ZeRO':>4} {'ep':>2} {'step s':>6} {'[rounds]':>11} {'CPU s':>5} {'peak RSS MiB':>12} "
             f"{'(spread)':>8} {'growth':>6} {'a2a MiB':>7} {'(off-rank)':>10} {'states MiB':>10} "
             f"{'first loss':>10}   vs deepspeed: step / CPU / peak RSS / states"]
    for name, run in best.items():
        row = ROWS[name]
        if "median_step_s" not in run:
            lines.append(f"{name:<17} {row.stage:>4} {row.ep:>2} {run.get('error') or 'skipped: ' + run['skipped']}"
                         [:220])
            continue
        medians = [r["median_step_s"] for r in rounds[name] if "median_step_s" in r]
        spread = f"{min(medians):.2f}-{max(medians):.2f}"
        lines.append(f"{name:<17} {row.stage:>4} {row.ep:>2} {run['median_step_s']:>6.2f} {spread:>11} "
                     f"{run['median_cpu_s']:>5.2f} {run['peak_rss_mib']:>12.0f} {run['peak_rss_spread_mib']:>8.0f} "
                     f"{run['step_growth_mib']:>6.0f} {run['all_to_all_mib']:>7.1f} "
                     f"{run['all_to_all_off_rank_mib']:>10.1f} {run['states_mib']:>10.1f} "
                     f"{run['first_losses'][0]:>10.6f}   {ratios(name, best)}")
    return lines


def summary(rounds: dict[str, list[dict]], skipped: dict[str, str], plan: Plan) -> list[str]:
    best = {name: chosen(runs) for name, runs in rounds.items()}
    loads = "; ".join(f"{name} " + ", ".join(f"{run['load_average']:.1f}" for run in runs)
                      for name, runs in rounds.items())
    return [f"{WORLD_SIZE} gloo ranks; step s: the slowest rank, median of {plan.steps} after {plan.warmup} warm-up, "
            f"in the least disturbed of {plan.rounds} round(s) ([rounds]: each round's median); CPU s: the largest "
            "rank's process time; peak RSS: the largest rank's VmHWM (spread: largest less smallest rank); growth: a "
            "step's, MiB; a2a: all-to-all input MiB per step per rank (off-rank: less what a rank sends itself); "
            "states: model states a rank holds after its last step; first loss: rank 0's",
            *table(rounds), *(f"{name}: skipped, {reason}" for name, reason in skipped.items()), ZERO3_NOTE,
            *(f"loss, largest relative difference over the ranks: {pair} first step {difference['first_step']:.1e}, "
              f"every step {difference['every_step']:.1e}" for pair, difference in agreement(best).items()),
            f"1-minute load average as each run started, round by round (its own 4 ranks keep it near 4): {loads}"]


# --- the command line ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"rows, comma-separated, of: {', '.join(ROWS)} "
                        f"(default: {', '.join(DEFAULT_ROWS)})")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each row, in alternating orders")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one run's ranks")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a tiny model, 1 warm-up + 1 step, 1 round, "
                        f"rows {', '.join(QUICK_ROWS)} unless --only")
    parser.add_argument("--out", default="bench_results/bench_moe.json")
    parser.add_argument("--contender", help=argparse.SUPPRESS)  # a rank: which row
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)  # a rank: where it writes what it measured
    return parser.parse_args(argv)


def plan_of(args: argparse.Namespace) -> Plan:
    if args.quick:
        return Plan(warmup=1, steps=1, rounds=1, timeout=min(args.timeout, 120.0), quick=True)
    return Plan(warmup=args.warmup, steps=args.steps, rounds=args.rounds, timeout=args.timeout, quick=False)


def names_of(args: argparse.Namespace) -> list[str]:
    names = [name for name in args.only.split(",") if name] if args.only else \
        list(QUICK_ROWS if args.quick else DEFAULT_ROWS)
    unknown = set(names) - set(ROWS)
    if unknown:
        raise ValueError(f"unknown row(s) {', '.join(sorted(unknown))}; accepted: {', '.join(ROWS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_out:
        return run_rank(args)
    plan, names = plan_of(args), names_of(args)
    shape = QUICK_SHAPE if plan.quick else Shape()
    skipped = {name: "deepspeed is not installed (`pip install deepspeed`)" for name in names
               if name.startswith("deepspeed") and find_spec("deepspeed") is None}
    print(f"MoE GPT {shape} fp32, AdamW, {WORLD_SIZE} gloo ranks", flush=True)
    started = time.perf_counter()
    rounds = timed_rounds([name for name in names if name not in skipped], plan)
    skipped.update({name: runs[-1]["skipped"] for name, runs in rounds.items() if "skipped" in runs[-1]})
    rounds = {name: runs for name, runs in rounds.items() if name not in skipped}
    lines = summary(rounds, skipped, plan)
    print("\n".join(lines))
    command = ["python", "benchmarks/bench_moe.py", *(sys.argv[1:] if argv is None else argv)]
    report = {"command": " ".join(command), "torch": torch.__version__, "versions": versions(("torch", "deepspeed")),
              "shape": asdict(shape), "plan": asdict(plan), "world_size": WORLD_SIZE,
              "rows": {name: {**asdict(ROWS[name]), "best_round": runs.index(chosen(runs)), "rounds": runs}
                       for name, runs in rounds.items()},
              "skipped": skipped, "loss_difference": agreement({n: chosen(r) for n, r in rounds.items()}),
              "table": lines, "seconds": round(time.perf_counter() - started, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
