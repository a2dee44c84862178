"""A Hugging Face Trainer fine-tune of a tiny causal LM, as a user writes one (issue 23). Launched by
tests/test_hf_trainer.py under torchrun on 2 gloo ranks:

    torchrun --nproc_per_node 2 hf_trainer.py --out DIR --pretrained MODEL_DIR                   # plain DDP
    torchrun --nproc_per_node 2 -m zerokit.deepspeed.install hf_trainer.py ... --deepspeed ds.json  # zerokit
    torchrun --nproc_per_node 2 hf_trainer.py ... --deepspeed ds.json --engine deepspeed         # real DeepSpeed

The model is `from_pretrained(MODEL_DIR)` (at stage 3 that is built under zero.Init and its weights written through
GatheredParameters); TrainingArguments come first, then deepspeed.init_distributed(), as issue 23 found real
DeepSpeed needs. Training: gradient accumulation whose last window per epoch is short (each rank's 19 samples
make 10 micro-batches of 2, in windows of 3, 3, 3 and 1), clipping, a linear warm-up schedule. Each rank writes DIR/rank{r}.json: the Trainer's
per-step loss, grad norm and learning rate, what engine trained (a silent fallback to DDP must be seen) and its
collectives, and, with --resume-at, the same from a second Trainer resumed from the checkpoint of that step.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

SAMPLES, SEQUENCE, VOCAB = 37, 16, 96  # 37 = not a multiple of micro-batch x accumulation x world (2 x 3 x 2)


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE,
                       tie_word_embeddings=False)


def save_pretrained_model(directory: str, seed: int = 0) -> None:
    """The tiny model built from its config with `seed`, saved where --pretrained reads it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_llama_config()).save_pretrained(directory)


class Sequences(torch.utils.data.Dataset):
    """Token sequences counting up from a random start with a random stride: learnable, so losses fall."""

    def __init__(self, seed: int = 7) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=generator)
        stride = torch.randint(1, 4, (SAMPLES, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(SEQUENCE)) % VOCAB

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def arguments(args: argparse.Namespace, output_dir: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, use_cpu=True, deepspeed=args.deepspeed, per_device_train_batch_size=2,
        gradient_accumulation_steps=args.accumulation, num_train_epochs=args.epochs, learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=3, lr_scheduler_type="linear", max_grad_norm=args.max_grad_norm, logging_steps=1,
        save_strategy="steps" if args.resume_at else "no", save_steps=args.resume_at or 500, report_to=[],
        seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=args.bf16, fp16=args.fp16)


def steps(trainer) -> list[dict[str, float]]:
    keys = ("step", "loss", "grad_norm", "learning_rate")
    return [{key: float(entry[key]) for key in keys} for entry in trainer.state.log_history if "loss" in entry]


def engine_facts(engine) -> dict:
    """What trained: the engine's class and module, and, for zerokit, its collectives by kind."""
    facts = {"engine": f"{type(engine).__module__}.{type(engine).__qualname__}"}
    if hasattr(engine, "comm_stats"):
        facts["comm_calls"] = {kind: counts["calls"] for kind, counts in engine.comm_stats().items()}
        facts["stage"] = engine.config.stage
        facts["gradient_clipping"] = engine.config.gradient_clipping
        facts["fp16"] = engine.fp16_enabled()
    return facts


def loaded_difference(engine, pretrained: str) -> float:
    """Largest difference between the zerokit engine's weights before training and the pretrained file's."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(pretrained) / "model.safetensors"))
    held = engine.full_state_dict()
    if set(saved) - set(held):
        raise RuntimeError(f"weights not held by the engine: {sorted(set(saved) - set(held))}")
    return max((held[name].float() - tensor.float()).abs().max().item() for name, tensor in saved.items())


def train(args: argparse.Namespace, output_dir: str, resume: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

    training_args = arguments(args, output_dir)
    if args.deepspeed:
        import deepspeed

        deepspeed.init_distributed()  # after TrainingArguments: See this file's docstring
    model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
    seen: dict = {}

    class Inspect(TrainerCallback):
        def on_train_begin(self, _args, state, control, **kwargs) -> None:
            engine = trainer.model_wrapped
            if hasattr(engine, "full_state_dict") and resume is None:
                seen["loaded_difference"] = loaded_difference(engine, args.pretrained)

    trainer = Trainer(model=model, args=training_args, train_dataset=Sequences(), callbacks=[Inspect()])
    trainer.train(resume_from_checkpoint=resume)
    result = {"steps": steps(trainer), **engine_facts(trainer.model_wrapped), **seen}
    if args.save_model and resume is None:
        result["whole_state_dicts"] = save_model_counting_whole_state_dicts(trainer, args.save_model)
    return result


def save_model_counting_whole_state_dicts(trainer, output_dir: str) -> int | None:
    """trainer.save_model(output_dir); how often it had the engine build the whole model's state dict (None: the
    engine has no such call, as DDP's)."""
    engine = trainer.model_wrapped
    if not hasattr(engine, "_zero3_consolidated_16bit_state_dict"):
        trainer.save_model(output_dir)
        return None
    built, whole = [], engine._zero3_consolidated_16bit_state_dict
    engine._zero3_consolidated_16bit_state_dict = lambda *a, **k: built.append(1) or whole(*a, **k)
    trainer.save_model(output_dir)
    return len(built)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config (JSON path); none: plain DDP")
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=0.5)
    parser.add_argument("--accumulation", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--save-model", default=None, help="trainer.save_model() here after training")
    parser.add_argument("--resume-at", type=int, default=0,
                        help="checkpoint at this step, then train again resumed from it in a second Trainer")
    args = parser.parse_args()
    out = Path(args.out)
    result = {"run": train(args, str(out / "checkpoints"))}
    if args.resume_at:
        checkpoint = out / "checkpoints" / f"checkpoint-{args.resume_at}"
        result["resumed"] = train(args, str(out / "checkpoints"), resume=str(checkpoint))
    rank = int(os.environ.get("RANK", 0))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
