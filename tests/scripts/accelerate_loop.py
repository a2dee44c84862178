"""An accelerate training loop over the tiny causal LM of hf_trainer.py, as a user writes one (issue 23):
`Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))` and an `accumulate()` loop with clipping and a
warm-up schedule. Launched by tests/test_accelerate.py under torchrun on 2 gloo ranks:

    torchrun --nproc_per_node 2 accelerate_loop.py --out DIR --pretrained MODEL_DIR            # accelerate's DDP
    torchrun --nproc_per_node 2 -m zerokit.deepspeed.install accelerate_loop.py ... --stage 3    # zerokit

Each rank writes DIR/rank{r}.json: its loss at every micro-step and, at every optimizer step, the grad norm
and learning rate; what engine trained and its collectives. With --save-at K the run also saves
`accelerator.save_state(DIR/state)` after its K-th micro-step (a window's end) and goes on; a run with
--resume-from DIR/state --resume-at K is a new launch that loads it with `accelerator.load_state()`, skips the K
micro-batches already trained (`accelerator.skip_first_batches`) and records only what follows.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from hf_trainer import Sequences, engine_facts, loaded_difference

ACCUMULATION, MICRO_BATCH, CLIP, LR, WARMUP = 3, 2, 0.5, 3e-3, 3


def plugin(stage: int):
    from accelerate.utils import DeepSpeedPlugin

    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": CLIP, "train_batch_size": "auto"}
    return DeepSpeedPlugin(hf_ds_config=config, gradient_accumulation_steps=ACCUMULATION)


def train(args: argparse.Namespace) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    if args.stage is None:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)  # DDP over gloo
    else:
        # Not cpu=True: accelerate drops a DeepSpeed plugin under it (to DDP, silently). Without a GPU, the
        # backend must be named, or accelerate counts one process and derives train_batch_size from that.
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, deepspeed_plugin=plugin(args.stage),
                                  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    # After the Accelerator: at stage 3 its plugin makes from_pretrained build the model under zero.Init.
    model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(Sequences(), batch_size=MICRO_BATCH, shuffle=False)
    # accelerate steps a schedule once per process at each optimizer step: its counts are in those ticks.
    ticks = accelerator.num_processes
    total = args.epochs * -(-len(loader) // (ACCUMULATION * ticks))
    schedule = get_linear_schedule_with_warmup(optimizer, WARMUP * ticks, total * ticks)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    result = {"losses": [], "grad_norms": [], "lrs": []}
    if hasattr(model, "full_state_dict"):
        result["loaded_difference"] = loaded_difference(model, args.pretrained)
    if args.resume_from:
        accelerator.load_state(args.resume_from)
    model.train()
    micro_step = 0
    for epoch in range(args.epochs):
        trained = min(max(args.resume_at - epoch * len(loader), 0), len(loader))  # before the resume, this epoch
        micro_step += trained
        if trained == len(loader):
            continue
        for batch in accelerator.skip_first_batches(loader, trained) if trained else loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                    result["grad_norms"].append(float(norm))
                    result["lrs"].append(schedule.get_last_lr()[0])
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
            result["losses"].append(loss.item())
            micro_step += 1
            if micro_step == args.save_at:
                accelerator.save_state(str(Path(args.out) / "state"))
                result["saved_after_steps"] = len(result["grad_norms"])  # optimizer steps taken by then
    return {**result, **engine_facts(model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--stage", type=int, default=None, help="a DeepSpeed plugin at this ZeRO stage; none: DDP")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-at", type=int, default=None, help="save_state() after this many micro-steps")
    parser.add_argument("--resume-from", default=None, help="load_state() from this directory, then go on")
    parser.add_argument("--resume-at", type=int, default=0, help="micro-steps the loaded state had trained")
    args = parser.parse_args()
    result = train(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
