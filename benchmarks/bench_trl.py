"""TRL's DPO with a reference model at ZeRO-3 (issue 36): peak resident memory per rank under plain DDP, the real
DeepSpeed and zerokit (through `python -m zerokit.deepspeed.install`, the script unchanged), and what each model
holds. The job: DPOTrainer(model, ref_model) on a Llama-shaped model of 23.2M parameters (hidden 512, 8 layers,
a 31-word vocabulary from a word-level tokenizer made here), both loaded with from_pretrained (under zero.Init at
ZeRO-3), fp32, AdamW, 2 ranks on CPU (gloo), 2 preference pairs per rank and step, 4 steps.

    python benchmarks/bench_trl.py                                  # ddp, deepspeed-3, zerokit-3
    python benchmarks/bench_trl.py --only zerokit-3,deepspeed-3 --json /tmp/bench_trl.json

Measured per contender, in a fresh torchrun launch each, on each rank:
- **VmHWM MiB**: the process's peak resident set at the end (VmHWM in /proc/self/status); it includes the
  interpreter and the imported libraries.
- **growth MiB**: VmHWM at the end less the resident size just before the models are built (the peak is reset there
  through /proc/self/clear_refs): what the two models, the policy's training states and the steps added.
- **policy / reference MiB**: the parameter bytes each model holds on the rank when training ends: zerokit's
  engine.memory_stats()["parameters"] (its shards, and any unit still gathered); DeepSpeed's partitions (each
  parameter's ds_tensor); under DDP each model whole. zerokit's policy row adds its gradients and optimizer state
  (fp32 masters, when separate, and AdamW's moments), also from memory_stats().
The losses are printed so that a contender that did not train, or trained another job, is seen.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CONTENDERS = ("ddp", "deepspeed-3", "zerokit-3")
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "rug", "red", "blue", "big", "small", "and",
         "then", "quickly", "slowly", "good", "bad", "yes", "no", "one", "two", "three", "four", "five"]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<bos>"]
MIB = 2 ** 20


def resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<bos>")


def save_model(directory: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(SPECIAL + WORDS), hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def preference_data(samples: int):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(11)
    words = lambda n: " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=generator).tolist())  # noqa: E731
    prompts = [words(4) for _ in range(samples)]
    return Dataset.from_dict({"prompt": prompts, "chosen": [" " + " ".join([p.split()[0]] * 3) for p in prompts],
                              "rejected": [" " + words(3) for _ in prompts]})


def deepspeed_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "train_batch_size": "auto", "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}


def held_bytes(engine, model: torch.nn.Module) -> dict[str, int]:
    """What a model holds on this rank: parameters (and, for zerokit, gradients and optimizer state)."""
    if hasattr(engine, "memory_stats"):
        return engine.memory_stats()
    if any(hasattr(p, "ds_tensor") for p in model.parameters()):  # DeepSpeed ZeRO-3: this rank's partitions
        return {"parameters": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())}
    return {"parameters": sum(p.numel() * p.element_size() for p in model.parameters())}


def run_job(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    sharded = args.contender != "ddp"
    config = DPOConfig(output_dir=args.out, use_cpu=True, per_device_train_batch_size=2, max_steps=args.steps,
                       learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                       disable_tqdm=True, dataloader_num_workers=0, bf16=False, beta=0.1, max_length=32,
                       deepspeed=deepspeed_config(int(args.contender[-1])) if sharded else None)
    if sharded:
        import deepspeed  # zerokit's under `-m zerokit.deepspeed.install`

        deepspeed.init_distributed()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    before = resident_kib("VmRSS")
    policy = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer = DPOTrainer(model=policy, ref_model=reference, args=config, processing_class=tokenizer(),
                         train_dataset=preference_data(2 * world * args.steps))
    trainer.train()
    result = {"losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
              "vmhwm_kib": resident_kib("VmHWM"), "before_kib": before,
              "engine": f"{type(trainer.model_wrapped).__module__}.{type(trainer.model_wrapped).__qualname__}",
              "policy": held_bytes(trainer.model_wrapped, policy), "reference": held_bytes(trainer.ref_model, reference),
              "parameters": sum(p.numel() for p in policy.parameters()) if not sharded else None}
    Path(args.out, f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(result))


def launch(contender: str, steps: int, pretrained: str, out: Path) -> None:
    install = ["-m", "zerokit.deepspeed.install"] if contender.startswith("zerokit") else []
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *install,
               __file__, "--worker", "--contender", contender, "--steps", str(steps), "--out", str(out),
               "--pretrained", pretrained]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{done.stderr[-4000:]}")


# What trained the policy under each contender: a run that fell back to another engine must not pass as the one named
EXPECTED_ENGINE = {"ddp": "torch.nn.parallel.distributed.DistributedDataParallel",
                   "deepspeed": "deepspeed.runtime.engine.DeepSpeedEngine",
                   "zerokit": "zerokit.deepspeed.engine.DeepSpeedEngine"}


def row(contender: str, ranks: list[dict]) -> str:
    expected = EXPECTED_ENGINE[contender.split("-")[0]]
    if any(rank["engine"] != expected for rank in ranks):
        raise RuntimeError(f"{contender}: the policy was trained by {ranks[0]['engine']}, not {expected}")
    peak = max(r["vmhwm_kib"] for r in ranks) / 1024
    growth = max(r["vmhwm_kib"] - r["before_kib"] for r in ranks) / 1024
    policy, reference = ranks[0]["policy"], ranks[0]["reference"]
    states = (f" + {policy['gradients'] / MIB:.1f} grads + {policy['optimizer_state'] / MIB:.1f} optimizer"
              if "optimizer_state" in policy else "")
    losses = " ".join(f"{loss:.4f}" for loss in ranks[0]["losses"])
    return (f"| {contender} | {peak:.0f} | {growth:.0f} | {policy['parameters'] / MIB:.1f}{states} | "
            f"{reference['parameters'] / MIB:.1f} | {losses} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CONTENDERS), help=f"comma-separated, from {', '.join(CONTENDERS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None, help="write every rank's measurements here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pretrained", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_job(args)
        return 0
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as root:
        pretrained = str(Path(root) / "pretrained")
        save_model(pretrained)
        for contender in args.only.split(","):
            out = Path(root) / contender
            out.mkdir()
            launch(contender, args.steps, pretrained, out)
            results[contender] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    print("| contender | VmHWM MiB (larger rank) | growth MiB | policy holds MiB (rank 0) | reference holds MiB | "
          "losses |")
    print("|---|---|---|---|---|---|")
    for contender, ranks in results.items():
        print(row(contender, ranks))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
