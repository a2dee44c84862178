"""The planner held against real runs: Hugging Face GPT-2 6x384 and 12x512 and a Llama 8x512 (and, with
--extra, a Qwen2-style model with grouped-query attention that nothing was tuned on), stages 0-3, fp32 and
bf16, 2 gloo ranks, each run recorded by zerokit.profiling.record_run in fresh processes and predicted by
zerokit.planner.check from a calibration of a 2-block copy of the model at small shapes, a measured
device, and copies of 2 and 6 blocks trained at the run's stage, shape and optimizer groups (their resident
excess, their phases' times and a replay of the run's collectives, See [Note: timing copies] in
zerokit/profiling/resident.py). Printed per run:
predicted, measured and error for every category; then one line per run, beside what DeepSpeed's and
accelerate's estimators say for the same run (model states only: they do not price activations).

    python benchmarks/bench_planner.py                 # the 24 runs (about 24 minutes on 2 cores)
    python benchmarks/bench_planner.py --extra         # and the Qwen2-style model: 32 runs, about 29 minutes
    python benchmarks/bench_planner.py --models gpt2-6x384 --stages 2 --dtypes bf16   # one run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from zerokit.planner.check import check_rows, format_rows  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

MODELS = {
    "gpt2-6x384": {"model_type": "gpt2", "n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 50257,
                   "n_positions": 1024},
    "gpt2-12x512": {"model_type": "gpt2", "n_layer": 12, "n_embd": 512, "n_head": 8, "vocab_size": 50257,
                    "n_positions": 1024},
    "llama-8x512": {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 512, "intermediate_size": 1376,
                    "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000,
                    "max_position_embeddings": 2048},
}
EXTRA = {"qwen2-6x384-gqa": {"model_type": "qwen2", "num_hidden_layers": 6, "hidden_size": 384,
                             "intermediate_size": 1024, "num_attention_heads": 6, "num_key_value_heads": 2,
                             "vocab_size": 20000, "max_position_embeddings": 2048}}
SUMMARY = ("activations", "peak_allocated", "peak_total", "gradients", "optimizer_state", "wire_bytes",
           "time.forward", "time.backward", "time.step", "time.communication", "cpu_time.forward",
           "cpu_time.backward", "cpu_time.step")


def build(config: dict) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))


def record_rank(rank: int, world: int, config: dict, stage: int, dtype: str, batch: int, seq: int, steps: int) -> dict:
    import zerokit
    from zerokit.profiling.record import record_run
    from zerokit.testing.models import param_groups

    model = build(config)
    optimizer = torch.optim.AdamW(param_groups(model))
    engine = zerokit.initialize(model, optimizer, {"zero_optimization": {"stage": stage},
                                                   "bf16": {"enabled": dtype == "bf16"}})
    generator = torch.Generator().manual_seed(rank)
    vocab = config["vocab_size"]
    batches = iter(lambda: torch.randint(0, vocab, (batch, seq), generator=generator), None)
    record = record_run(engine, batches, lambda e, tokens: e(input_ids=tokens, labels=tokens).loss,
                        optimizer=optimizer, micro_batch=batch, seq_len=seq, warmup=1, steps=steps)
    return asdict(record)


def peers(config: dict, record: dict) -> dict:
    """DeepSpeed's and accelerate's answers for the same model and world (bytes per GPU, model states)."""
    model = build(config)
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    stage, world, dtype = record["setup"]["stage"], record["setup"]["world"], record["setup"]["precision"]
    out = {}
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        if stage == 2:
            out["deepspeed"] = estimate_zero2_model_states_mem_needs(total, world, 1, cpu_offload=False)[1]
        elif stage == 3:
            out["deepspeed"] = estimate_zero3_model_states_mem_needs(total, largest, world, 1, cpu_offload=False,
                                                                     cpu_offload_params=False)[1]
    except ImportError:
        pass
    try:
        from accelerate.commands.estimate import calculate_maximum_sizes, estimate_training_usage

        size, _ = calculate_maximum_sizes(model)
        usage = estimate_training_usage(size, "float32" if dtype == "fp32" else "float16")  # it has no bf16 column
        out["accelerate"] = max(v for v in usage.values() if v is not None and v > 0)
    except ImportError:
        pass
    return out


def calibrations(name: str, config: dict, record: dict, cache: dict):
    from zerokit.profiling.calibrate import calibrate
    from zerokit.profiling.report import copy_targets
    from zerokit.profiling.resident import measure_copies

    dtype = record["setup"]["precision"]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config))
        if (name, dtype) not in cache:
            cache[(name, dtype)] = replace(calibrate(str(path), precision=dtype, layers=2), model=f"{name}, 2 blocks")
        copies = measure_copies(str(path), record["micro_batch"], record["seq_len"], layers=2, world=2,
                                **copy_targets(record))
    return replace(cache[(name, dtype)], resident_bytes=copies.framework, allocator_slack=copies.slack,
                   resident_fixed_bytes=copies.fixed, copy_seconds=copies.seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--extra", action="store_true", help="also the Qwen2-style model nothing was tuned on")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--out", default="planner-sweep.json", help="every record and row, as JSON (after each run)")
    args = parser.parse_args(argv)
    table = {**MODELS, **EXTRA}
    names = args.models.split(",") + (list(EXTRA) if args.extra else [])
    torch.set_num_threads(1)  # as each rank runs
    from zerokit.profiling.device import measure_device

    device = measure_device(threads=1)
    cache, results, summary = {}, [], []
    for name in names:
        for dtype in args.dtypes.split(","):
            for stage in map(int, args.stages.split(",")):
                started = time.perf_counter()
                record = spawn(record_rank, 2, table[name], stage, dtype, args.batch, args.seq, args.steps)[0]
                calibration = calibrations(name, table[name], record, cache)
                rows = check_rows(record, calibration, device)
                label = f"{name} stage {stage} {dtype} (b={args.batch}, s={args.seq})"
                print(f"\n== {label}: {time.perf_counter() - started:.0f} s\n" + "\n".join(format_rows(rows)), flush=True)
                results.append({"run": label, "record": record, "rows": [r.as_dict() for r in rows],
                                "peers": peers(table[name], record), "calibration": calibration.as_dict()})
                summary.append((label, {r.category: r for r in rows}, results[-1]["peers"]))
                Path(args.out).write_text(json.dumps({"device": asdict(device), "runs": results}, indent=1, default=str))
    print_summary(summary)
    return 0


def print_summary(summary: list) -> None:
    print("\n| run | " + " | ".join(SUMMARY) + " | exact states and comm | DeepSpeed (vs peak) | accelerate (vs peak) |")
    print("|---" * (len(SUMMARY) + 4) + "|")
    worst = {name: 0.0 for name in SUMMARY}
    for label, rows, peer in summary:
        cells = []
        for name in SUMMARY:
            error = rows[name].error if name in rows else None
            cells.append("-" if error is None else f"{error:+.1%}")
            if error is not None:
                worst[name] = max(worst[name], abs(error))
        exact = all(r.error == 0 for r in rows.values() if r.unit != "seconds" and r.category not in SUMMARY[:3])
        measured = rows["peak_total"].measured
        ds = peer.get("deepspeed")
        acc = peer.get("accelerate")
        cells += ["yes" if exact else "no", "-" if ds is None else f"{ds / 2**20:.0f} MiB ({ds / measured - 1:+.0%})",
                  "-" if acc is None else f"{acc / 2**20:.0f} MiB ({acc / measured - 1:+.0%})"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| worst |abs| | " + " | ".join(f"{worst[n]:.1%}" for n in SUMMARY) + " | | | |")


if __name__ == "__main__":
    sys.exit(main())
