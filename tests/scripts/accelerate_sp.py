"""An accelerate training loop with DeepSpeed's sequence parallelism as accelerate's docs set it up:
ParallelismConfig(sp_size=2, sp_backend="deepspeed") with a DeepSpeedSequenceParallelConfig, a DeepSpeedPlugin, and
prepare(), which registers Ulysses with transformers and wraps the loader in UlyssesSPDataLoaderAdapter. The shards'
losses are combined by an all-reduce (gloo: See ds_alst.py). Unchanged, it runs on zerokit under
`python -m zerokit.deepspeed.install` (tests/test_sequence_parallel_scripts.py).

    torchrun --nproc_per_node 4 -m zerokit.deepspeed.install accelerate_sp.py --stage 3 --out results/
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig, ParallelismConfig

from alst_common import SEQUENCE_PARALLEL, accelerate_rows, build_model, collate

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                 "zero_optimization": {"stage": args.stage}, "steps_per_print": 1000}
    parallelism = ParallelismConfig(sp_size=SEQUENCE_PARALLEL, sp_backend="deepspeed", dp_shard_size=2,
                                    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                               sp_attn_implementation="sdpa"))
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
                              parallelism_config=parallelism)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(accelerate_rows()), batch_size=1, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sp_group = model.mpu.get_sequence_parallel_group() if hasattr(model, "mpu") else None
    losses = []
    for batch in loader:
        outputs = model(**batch)
        shift_labels = batch["shift_labels"]
        loss = model.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                          vocab_size=model.module.config.vocab_size)
        good_tokens = (shift_labels != -100).view(-1).sum()
        total_loss = torch.distributed.nn.functional.all_reduce(loss * good_tokens, group=sp_group)
        total_good_tokens = torch.distributed.nn.functional.all_reduce(good_tokens.float(), group=sp_group)
        loss = total_loss / total_good_tokens.clamp(min=1)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
