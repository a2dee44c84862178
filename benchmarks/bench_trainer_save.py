"""The Hugging Face Trainer's save_model at ZeRO-3: the memory rank 0 needs to write the model, zerokit beside DeepSpeed.

    python benchmarks/bench_trainer_save.py                 # 2 gloo ranks, a 58M-parameter Llama, fp32
    python benchmarks/bench_trainer_save.py --layers 4 --hidden 256

One Trainer script (this file, run under torchrun) fine-tunes the model two steps at stage 3 and calls
trainer.save_model(dir), three ways, each in its own launch:
- zerokit: through `-m zerokit.deepspeed.install`, where save_model streams (See [Note: the Trainer's save_model
  streams] in zerokit/integrations/hf_trainer.py);
- zerokit-unstreamed: the same, with the Trainer's own save_model put back (accelerator.get_state_dict, then
  rank 0's model.save_pretrained(state_dict=...)), which is what zerokit did before;
- deepspeed: the real DeepSpeed, whose save_model runs the Trainer's own path.
Per contender: each rank's peak RSS growth during save_model (what training freed returned to the system with
malloc_trim, then VmHWM reset just before it through /proc/self/clear_refs),
the largest rank's and rank 0's; the save's seconds (slowest rank); each the median of --rounds launches; and whether the files hold the same tensors as
zerokit's streamed ones (bit for bit for zerokit-unstreamed; DeepSpeed trains in another summation order, so its
largest difference is given). The model's fp32 size and its largest tensor are printed beside them.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = ("zerokit", "zerokit-unstreamed", "deepspeed")
SEQUENCE, SAMPLES = 32, 16


def llama_config(layers: int, hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=SEQUENCE, tie_word_embeddings=False)


def _status_kib(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def job(pretrained: str, out: Path, contender: str) -> None:
    """One rank of one contender: two steps at stage 3, then save_model measured."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    config = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
              "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    arguments = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=2, max_steps=2,
                                  learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=1,
                                  deepspeed=config, use_cpu=True, disable_tqdm=True)
    if contender == "deepspeed":
        import deepspeed

        deepspeed.init_distributed()  # after TrainingArguments, as real DeepSpeed needs (tests/scripts/hf_trainer.py)
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    tokens = torch.randint(0, 32000, (SAMPLES, SEQUENCE), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    trainer = Trainer(model=model, args=arguments, train_dataset=data)
    trainer.train()  # deepspeed.initialize, where zerokit wraps save_model
    if contender == "zerokit-unstreamed":
        Trainer.save_model = getattr(Trainer.save_model, "__wrapped__", Trainer.save_model)
    if getattr(Trainer.save_model, "zerokit_streams", False) != (contender == "zerokit"):
        raise RuntimeError(f"{contender}: the Trainer's save_model is not the one this contender measures")
    torch.distributed.barrier()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory training freed goes back, so that reusing it counts as growth
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    before, start = _status_kib("VmRSS"), time.perf_counter()
    trainer.save_model(str(out / "saved"))
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"peak_growth_mib": (_status_kib("VmHWM") - before) / 1024,
                                                      "seconds": seconds}))


def median_of_rounds(contender: str, pretrained: Path, out: Path, ranks: int, rounds: int) -> dict:
    """Each figure's median over `rounds` launches (a rank's growth varies by some tens of MiB between launches)."""
    runs = [run(contender, pretrained, out / f"round{index}", ranks) for index in range(rounds)]
    return {key: statistics.median(each[key] for each in runs) for key in runs[0]} | {"rounds": rounds}


def run(contender: str, pretrained: Path, out: Path, ranks: int) -> dict:
    install = ["-m", "zerokit.deepspeed.install"] if contender.startswith("zerokit") else []
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               *install, __file__, "--job", contender, "--pretrained", str(pretrained), "--out", str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{done.stderr[-4000:]}")
    per_rank = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    return {"rank0_peak_growth_mib": round(per_rank[0]["peak_growth_mib"], 1),
            "largest_peak_growth_mib": round(max(each["peak_growth_mib"] for each in per_rank), 1),
            "seconds": round(max(each["seconds"] for each in per_rank), 3)}


def saved_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    return {name: tensor for path in files for name, tensor in load_file(str(path)).items()}


def compare(reference: dict, other: dict) -> float:
    if reference.keys() != other.keys():
        raise RuntimeError(f"the saved keys differ: {sorted(reference.keys() ^ other.keys())[:4]}")
    return max((reference[name] - other[name]).abs().max().item() for name in reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="launches per contender; each figure their median")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--job", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--pretrained", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args.pretrained, Path(args.out), args.job)
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="zerokit-trainer-save-") as root:
        pretrained = Path(root) / "pretrained"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(llama_config(args.layers, args.hidden))
        model.save_pretrained(pretrained)
        sizes = [p.numel() * 4 for p in model.parameters()]
        results = {"model_fp32_mib": round(sum(sizes) / 2**20, 1), "largest_tensor_mib": round(max(sizes) / 2**20, 1),
                   "ranks": args.ranks, "contenders": {}}
        del model
        for contender in CONTENDERS:
            results["contenders"][contender] = median_of_rounds(contender, pretrained, Path(root) / contender,
                                                                args.ranks, args.rounds)
            print(contender, results["contenders"][contender], flush=True)
        streamed = saved_tensors(Path(root) / "zerokit" / "round0" / "saved")
        for contender in CONTENDERS[1:]:
            results["contenders"][contender]["largest_difference_from_zerokit"] = compare(
                streamed, saved_tensors(Path(root) / contender / "round0" / "saved"))
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
