"""Post-training as Hugging Face TRL runs it (issue 36): a DPO job with a reference model, a GRPO job with a reward
function and a reference model, and an SFT job with packing, on a tiny Llama and a word-level tokenizer made here
(no download). Launched by tests/test_trl.py under torchrun on 2 gloo ranks:

    torchrun --nproc_per_node 2 trl_jobs.py --job dpo --out DIR --pretrained MODEL_DIR                   # DDP
    torchrun --nproc_per_node 2 -m zerokit.deepspeed.install trl_jobs.py ... --deepspeed ds.json       # zerokit
    torchrun --nproc_per_node 2 trl_jobs.py ... --deepspeed ds.json                                    # DeepSpeed

`--jobs dpo,grpo` runs several jobs one after the other in one launch (a launch costs seconds); the job `generate`
samples from a ZeRO-3 engine both ways TRL generates, beside the same model in one process. Each rank writes
DIR/<job>/rank{r}.json: the Trainer's per-step logs (loss, grad norm, and the job's own metrics), what engine
trained the policy and what engine holds the reference model, and, with --resume-at, the same job resumed from the
checkpoint of that step.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "rug", "red", "blue", "big", "small", "and",
         "then", "quickly", "slowly", "good", "bad", "yes", "no", "one", "two", "three", "four", "five"]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<bos>"]
SEQUENCE = 64


def tokenizer():
    """A word-level tokenizer over WORDS, built in memory: what TRL needs of a tokenizer (pad, eos, a chat-free
    text interface) with nothing to download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<bos>")


def tiny_llama_config():
    from transformers import LlamaConfig

    special = tokenizer()
    return LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=SEQUENCE, tie_word_embeddings=False,
                       pad_token_id=special.pad_token_id, eos_token_id=special.eos_token_id,
                       bos_token_id=special.bos_token_id)


def save_pretrained_model(directory: str, seed: int = 0) -> None:
    """The tiny model built from its config with `seed`, and the tokenizer, saved where --pretrained reads them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_llama_config()).save_pretrained(directory)
    tokenizer().save_pretrained(directory)


def sentence(generator: torch.Generator, length: int) -> str:
    picks = torch.randint(0, len(WORDS), (length,), generator=generator)
    return " ".join(WORDS[i] for i in picks.tolist())


def preference_data(samples: int = 16):
    """Prompts with a chosen answer that repeats the prompt's first word and a rejected one that does not."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(11)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(samples):
        prompt = sentence(generator, 4)
        rows["prompt"].append(prompt)
        rows["chosen"].append(" " + " ".join([prompt.split()[0]] * 3))
        rows["rejected"].append(" " + sentence(generator, 3))
    return Dataset.from_dict(rows)


def prompt_data(samples: int = 8):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(13)
    return Dataset.from_dict({"prompt": [sentence(generator, 3) for _ in range(samples)]})


def text_data(samples: int = 24):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(17)
    return Dataset.from_dict({"text": [sentence(generator, int(3 + i % 7)) for i in range(samples)]})


def letters_a(completions: list[str], **_: object) -> list[float]:
    """GRPO's reward: how many letters "a" the completion holds (it differs between most completions, so that
    advantages, and so the loss, are not zero)."""
    return [float(text.count("a")) for text in completions]


def common_arguments(args: argparse.Namespace, output_dir: str) -> dict:
    return dict(output_dir=output_dir, use_cpu=True, deepspeed=args.deepspeed, per_device_train_batch_size=args.batch,
                gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=args.lr,
                logging_steps=1, save_strategy="steps" if args.resume_at else "no",
                save_steps=args.resume_at or 500, report_to=[], seed=0, disable_tqdm=True,
                dataloader_num_workers=0, max_grad_norm=1.0, lr_scheduler_type="constant", bf16=args.bf16)


def dpo_trainer(args: argparse.Namespace, output_dir: str):
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(**common_arguments(args, output_dir), beta=0.1, max_length=32)
    model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
    return DPOTrainer(model=model, ref_model=reference, args=config, train_dataset=preference_data(),
                      processing_class=tokenizer())


def grpo_trainer(args: argparse.Namespace, output_dir: str, gather_for_generation: bool = True):
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(**common_arguments(args, output_dir), beta=0.1, num_generations=2,
                        max_completion_length=6, temperature=1.0, ds3_gather_for_generation=gather_for_generation)
    # the model as a local path: GRPO builds its reference model from it (under ZeRO-3, inside zero.Init)
    return GRPOTrainer(model=args.pretrained, reward_funcs=letters_a, args=config, train_dataset=prompt_data(),
                       processing_class=tokenizer())


def sft_trainer(args: argparse.Namespace, output_dir: str):
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(**common_arguments(args, output_dir), packing=True, max_length=16)
    model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
    return SFTTrainer(model=model, args=config, train_dataset=text_data(), processing_class=tokenizer())


def grpo_layer_by_layer_trainer(args: argparse.Namespace, output_dir: str):
    """GRPO generating through ZeRO-3's own gathers, unit by unit for every token (ds3_gather_for_generation=False)."""
    return grpo_trainer(args, output_dir, gather_for_generation=False)


TRAINERS = {"dpo": dpo_trainer, "grpo": grpo_trainer, "sft": sft_trainer,
            "grpo_layer_by_layer": grpo_layer_by_layer_trainer}
RESUMABLE = ("dpo", "grpo", "sft")


def logged_steps(trainer) -> list[dict[str, float]]:
    """Each step's logged numbers (loss, grad norm, the job's metrics), those that are numbers."""
    return [{key: float(value) for key, value in entry.items() if isinstance(value, (int, float))}
            for entry in trainer.state.log_history if "loss" in entry]


def engine_facts(engine) -> dict:
    facts = {"engine": f"{type(engine).__module__}.{type(engine).__qualname__}"}
    if hasattr(engine, "comm_stats"):  # zerokit's
        facts["stage"] = engine.config.stage
        facts["comm_calls"] = {kind: counts["calls"] for kind, counts in engine.comm_stats().items()}
        facts["memory"] = engine.memory_stats()
        facts["forward_only"] = engine.optimizer is None  # an engine without an optimizer runs forward only
    return facts


def loaded_difference(engine, pretrained: str) -> float:
    """Largest difference between the weights a zerokit engine holds and the pretrained file's."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(pretrained) / "model.safetensors"))
    held = engine.full_state_dict()
    return max((held[name].float() - tensor.float()).abs().max().item() for name, tensor in saved.items())


def run(job: str, args: argparse.Namespace, output_dir: str, resume: str | None = None) -> dict:
    if args.deepspeed:
        import deepspeed

        deepspeed.init_distributed()
    trainer = TRAINERS[job](args, output_dir)
    trainer.train(resume_from_checkpoint=resume)
    result = {"steps": logged_steps(trainer), "policy": engine_facts(trainer.model_wrapped)}
    reference = getattr(trainer, "ref_model", None)
    if reference is not None:
        result["reference"] = engine_facts(reference)
        if hasattr(reference, "full_state_dict"):  # built by from_pretrained (under zero.Init at ZeRO-3), never trained
            result["reference"]["loaded_difference"] = loaded_difference(reference, args.pretrained)
    return result


def generation_checks(pretrained: str) -> dict:
    """Samples from the model in this process, then from a ZeRO-3 engine over it (under the drop-in), both ways TRL
    generates: every parameter gathered with GatheredParameters around TRL's remove_hooks/add_hooks
    (unwrap_model_for_generation), and layer by layer through the engine's own gathers
    (ds3_gather_for_generation=False), with the same seed each time."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from trl.models.utils import add_hooks, remove_hooks

    deepspeed.init_distributed()
    rank = int(os.environ.get("RANK", 0))
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    prompts = torch.randint(len(SPECIAL), model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(rank))

    def sample(module: torch.nn.Module, **options) -> list[list[int]]:
        torch.manual_seed(1234)
        return module.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=8,
                               pad_token_id=0, **options).tolist()

    one_process = sample(model)
    config = {"zero_optimization": {"stage": 3, "stage3_min_unit_params": 1000,
                                    "stage3_param_persistence_threshold": 100},
              "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    engine.eval()
    gathers = engine.comm_stats()["all_gather"]["calls"]
    with deepspeed.zero.GatheredParameters(engine.parameters()):
        remove_hooks(engine)
        gathered = sample(engine.module)
        add_hooks(engine)
    gathers_gathered = engine.comm_stats()["all_gather"]["calls"] - gathers
    layer_by_layer = sample(engine.module, synced_gpus=True)  # ranks that finish early keep stepping with the others
    gathers_layer = engine.comm_stats()["all_gather"]["calls"] - gathers - gathers_gathered
    status = {name: p.ds_status.name for name, p in engine.module.named_parameters()}
    engine.close()
    return {"one_process": one_process, "gathered": gathered, "layer_by_layer": layer_by_layer,
            "gathers": [gathers_gathered, gathers_layer], "status": status,
            "class_back": all(type(p) is torch.nn.Parameter for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="comma-separated: dpo, grpo, sft, grpo_layer_by_layer, generate")
    parser.add_argument("--out", required=True)
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config (JSON path); none: plain DDP")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="per rank (one process with twice it: the same samples)")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="TRL's default; fp32 without it")
    parser.add_argument("--resume-at", type=int, default=0,
                        help="checkpoint at this step, then train again resumed from it in a second Trainer")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    for job in args.jobs.split(","):
        out = Path(args.out) / job
        if job == "generate":
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps(generation_checks(args.pretrained)))
            continue
        result = {"run": run(job, args, str(out / "checkpoints"))}
        if args.resume_at and job in RESUMABLE:
            checkpoint = out / "checkpoints" / f"checkpoint-{args.resume_at}"
            result["resumed"] = run(job, args, str(out / "checkpoints"), resume=str(checkpoint))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
