"""A tiny Mixtral trained through the Hugging Face Trainer or an accelerate loop, as a user writes either, with its
experts split over ranks by DeepSpeed's AutoEP config when --ep is given. Launched by tests/test_hf_experts.py on 2
gloo ranks:

    torchrun --nproc_per_node 2 hf_moe_ep.py --via trainer --out DIR                                   # DDP
    torchrun --nproc_per_node 2 -m zerokit.deepspeed.install hf_moe_ep.py --via trainer --stage 3 --ep 2 --out DIR

The DeepSpeed config is the user's: `"expert_parallel": {"enabled": true, "autoep_size": EP}` beside the ZeRO stage.
The router's auxiliary loss is part of the loss (output_router_logits), clipping at 0.5, SGD (Adam would hide a
constant factor in the experts' gradients). Each rank writes DIR/rank{r}.json: its per-step losses and, from the
Trainer, its logged grad norms, and what trained it; the Trainer then saves the model (save_model) in DIR/model.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

ROWS, TOKENS, VOCAB, STEPS, CLIP, LR = 2, 8, 61, 4, 0.5, 0.5


def tiny_mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1, max_position_embeddings=32))


class Rows(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        self.rows = torch.randint(0, VOCAB, (count, TOKENS), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def ds_config(args: argparse.Namespace) -> dict | None:
    if args.stage is None:
        return None
    return {"zero_optimization": {"stage": args.stage}, "train_micro_batch_size_per_gpu": ROWS,
            "gradient_accumulation_steps": 1, "gradient_clipping": CLIP, "train_batch_size": "auto",
            "expert_parallel": {"enabled": True, "autoep_size": args.ep}}


def with_trainer(args: argparse.Namespace, world: int) -> dict:
    from transformers import Trainer, TrainingArguments

    class InOrder(Trainer):
        def _get_train_sampler(self, *unused, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=ROWS, max_steps=STEPS,
                                 logging_steps=1, report_to=[], deepspeed=ds_config(args), save_strategy="no",
                                 learning_rate=LR, optim="sgd", max_grad_norm=CLIP, use_cpu=True,
                                 lr_scheduler_type="constant", disable_tqdm=True, average_tokens_across_devices=False)
    trainer = InOrder(model=tiny_mixtral(), args=training, train_dataset=Rows(ROWS * STEPS * world))
    trainer.train()
    trainer.save_model(str(Path(args.out) / "model"))  # split experts: the whole model, under its own keys
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": [entry["loss"] for entry in history], "norms": [entry["grad_norm"] for entry in history],
            "engine": type(trainer.model_wrapped).__module__}


def with_accelerate(args: argparse.Namespace, world: int) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    if args.stage is None:
        accelerator = Accelerator(cpu=True)  # DDP over gloo
    else:  # without a GPU the backend must be named, or accelerate counts one process
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(args)),
                                  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = tiny_mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(Rows(ROWS * STEPS * world), batch_size=ROWS)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "engine": type(model).__module__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--via", choices=("trainer", "accelerate"), required=True)
    parser.add_argument("--stage", type=int, default=None)  # None: DDP
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    result = (with_trainer if args.via == "trainer" else with_accelerate)(args, world)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
