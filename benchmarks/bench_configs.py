"""DeepSpeed configs through zerokit standalone and through real DeepSpeed: which train, which are refused, why.

    python benchmarks/bench_configs.py                       # every fixture: ds_configs/, refused/, public/
    python benchmarks/bench_configs.py --only 'public/*' --steps 3

Each config trains zerokit's tiny GPT (TinyGPT, hidden size 24) for --steps optimizer steps on 2 gloo ranks (1
where the config's batch identity fixes one rank), once with zerokit.initialize(model, optimizer, config) and
once with deepspeed.initialize. zerokit reads the config as written (standalone: "auto" is zerokit's to choose).
DeepSpeed gets "auto" filled in as Hugging Face's Trainer and accelerate fill it (`hf_fill`: their defaults,
hidden size 24, total_num_steps = --steps), and, where the config offloads the optimizer and names none,
DeepSpeedCPUAdam as accelerate maps a torch optimizer to it. A config without an `optimizer` block trains with
torch's AdamW on both sides. DeepSpeed 0.19.8 refuses fp16 on a CPU; such a config is run again with bf16 in
place of fp16, to tell a config DeepSpeed refuses from a device it does not support.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ds_configs"
HIDDEN, MICRO = 24, 1  # TinyGPT's n_embd; the per-device batch size (zerokit's own when no batch key fixes it)
HF_DEFAULTS = {  # TrainingArguments' defaults, as fill_match writes them (transformers/integrations/deepspeed.py)
    "gradient_clipping": 1.0, "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 5e-5, "scheduler.params.warmup_num_steps": 1, "fp16.enabled": False,
    "bf16.enabled": False, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}


def world_for(raw: dict) -> int:
    """2 ranks, unless train_batch_size = micro-batch x accumulation x world size fixes another."""
    sizes = [raw.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps")]
    if all(isinstance(size, int) for size in sizes) and sizes[1] * sizes[2]:
        return max(1, sizes[0] // (sizes[1] * sizes[2]))
    return 2


def hf_fill(raw: dict, world_size: int, steps: int) -> dict:
    """The config as Hugging Face's integration hands it to DeepSpeed: every "auto" it knows filled in."""
    out = copy.deepcopy(raw)
    zero = out.get("zero_optimization", {})
    fills = {**HF_DEFAULTS, "scheduler.params.total_num_steps": steps,
             "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
             "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
             "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN}
    for path, value in fills.items():
        *blocks, name = path.split(".")
        node = out
        for block in blocks:
            node = node.get(block, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict) and node.get(name) == "auto":
            node[name] = value
    gas = out.get("gradient_accumulation_steps")
    gas = 1 if gas in (None, "auto") else gas
    if out.get("train_micro_batch_size_per_gpu") in (None, "auto") and out.get("train_batch_size") in (None, "auto"):
        out["train_micro_batch_size_per_gpu"] = MICRO
    micro = out.get("train_micro_batch_size_per_gpu")
    micro = MICRO if micro in (None, "auto") else micro
    for name, value in (("gradient_accumulation_steps", gas),
                        ("train_micro_batch_size_per_gpu", micro),
                        ("train_batch_size", micro * gas * world_size)):
        if out.get(name) == "auto":
            out[name] = value
    if isinstance(zero, dict) and zero.get("stage") == "auto":
        zero["stage"] = 2  # accelerate's default zero_stage
    return out


def _tokens(rank: int, batch: int) -> torch.Tensor:
    return torch.randint(0, 67, (batch, 17), generator=torch.Generator().manual_seed(rank))


def _train(engine: Any, batch: int, accumulation: int, steps: int, rank: int) -> float:
    tokens = _tokens(rank, batch)
    for _ in range(steps * accumulation):
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
    return loss.item()


def run_zerokit(raw: dict, steps: int, rank: int) -> float:
    import zerokit

    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    optimizer = None if "optimizer" in raw else torch.optim.AdamW(param_groups(model), lr=1e-3)
    engine = zerokit.initialize(model, optimizer, raw)
    return _train(engine, engine.config.train_micro_batch_size_per_gpu, engine.config.gradient_accumulation_steps,
                  steps, rank)


def run_deepspeed(raw: dict, steps: int, rank: int) -> float:
    import deepspeed

    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    kwargs: dict[str, Any] = {"model_parameters": param_groups(model)}
    if "optimizer" not in raw:
        offloaded = raw.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
        forced = raw.get("zero_force_ds_cpu_optimizer", True) and offloaded
        cls = deepspeed.ops.adam.DeepSpeedCPUAdam if forced else torch.optim.AdamW
        kwargs = {"optimizer": cls(param_groups(model), lr=1e-3)}
        raw = {**raw, "zero_allow_untested_optimizer": True}  # as the Trainer sets it for its own optimizer
    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = deepspeed.initialize(model=model, config=raw, **kwargs)
    return _train(engine, int(engine.train_micro_batch_size_per_gpu()), int(engine.gradient_accumulation_steps()),
                  steps, rank)


def _outcome(run: Any, raw: dict, steps: int, rank: int) -> str:
    try:
        loss = run(raw, steps, rank)
    except Exception as error:  # a refusal: the first line of what the library says
        return f"refused: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    return f"trains (loss {loss:.3f})" if torch.isfinite(torch.tensor(loss)) else "non-finite loss"


def _without_fp16(raw: dict) -> dict:
    out = copy.deepcopy(raw)
    out["fp16"] = {"enabled": False}
    out["bf16"] = {"enabled": True}
    return out


def run_all(rank: int, world_size: int, named: dict[str, dict], steps: int, sides: tuple[str, ...]
            ) -> dict[str, dict[str, str]]:
    warnings.filterwarnings("ignore")
    if "deepspeed" in sides:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        os.environ.setdefault("MASTER_PORT", "29500")
        with contextlib.redirect_stdout(io.StringIO()):
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, raw in named.items():
        row = {"zerokit": _outcome(run_zerokit, raw, steps, rank) if "zerokit" in sides else "not run"}
        filled = hf_fill(raw, world_size, steps)
        row["deepspeed"] = _outcome(run_deepspeed, filled, steps, rank) if "deepspeed" in sides else "not run"
        if "fp16 is not supported" in row["deepspeed"]:
            row["deepspeed (bf16 for fp16)"] = _outcome(run_deepspeed, _without_fp16(filled), steps, rank)
        results[name] = row
    return results


def load(only: str) -> dict[str, dict]:
    paths = sorted(path for pattern in only.split(",") for path in FIXTURES.glob(pattern))
    return {str(path.relative_to(FIXTURES)): json.loads(path.read_text()) for path in paths}


def summary(results: dict[str, dict[str, str]]) -> list[str]:
    lines = []
    for side in ("zerokit", "deepspeed"):
        trains = [name for name, row in results.items() if row[side].startswith("trains")]
        lines.append(f"{side}: {len(trains)} of {len(results)} train")
    fp16 = [row for row in results.values() if "deepspeed (bf16 for fp16)" in row]
    lines.append(f"deepspeed refuses fp16 on this CPU in {len(fp16)}; with bf16 in its place "
                 f"{sum(row['deepspeed (bf16 for fp16)'].startswith('trains') for row in fp16)} of them train")
    zerokit = {name for name, row in results.items() if row["zerokit"].startswith("trains")}
    deepspeed = {name for name, row in results.items() if row["deepspeed"].startswith("trains")
                 or row.get("deepspeed (bf16 for fp16)", "").startswith("trains")}
    lines.append(f"both train: {len(zerokit & deepspeed)}")
    lines.append(f"only DeepSpeed trains (bf16 for fp16 counted): {', '.join(sorted(deepspeed - zerokit)) or '-'}")
    lines.append(f"only zerokit trains: {', '.join(sorted(zerokit - deepspeed)) or '-'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="*.json,refused/*.json,public/*.json",
                        help="globs under tests/fixtures/ds_configs, comma-separated")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument("--sides", default="zerokit,deepspeed", help="which libraries to run, comma-separated")
    args = parser.parse_args()
    configs = load(args.only)
    results: dict[str, dict[str, str]] = {}
    for world_size in sorted({world_for(raw) for raw in configs.values()}):
        group = {name: raw for name, raw in configs.items() if world_for(raw) == world_size}
        ranks = spawn(run_all, world_size, group, args.steps, tuple(args.sides.split(",")), timeout=3600)
        results.update({name: {**row, "ranks": str(world_size)} for name, row in ranks[0].items()})
    print("| config | ranks | zerokit | DeepSpeed 0.19.8 |")
    print("|---|---|---|---|")
    for name, row in sorted(results.items()):
        deepspeed = row["deepspeed"] + (f"; with bf16 for fp16: {row['deepspeed (bf16 for fp16)']}"
                                        if "deepspeed (bf16 for fp16)" in row else "")
        print(f"| {name} | {row['ranks']} | {row['zerokit']} | {deepspeed} |".replace("\n", " "))
    print()
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
