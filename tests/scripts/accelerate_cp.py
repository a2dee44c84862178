"""An accelerate training loop with context parallelism as accelerate's own example sets it up
(examples/torch_native_parallelism/nd_parallel.py): ParallelismConfig(cp_size=2), and each step inside
`accelerator.maybe_context_parallel(buffers=[input_ids, shift_labels, labels, position_ids], ...)`, which cuts them
along the sequence; the model's own loss (`outputs.loss`, each rank's tokens' mean) goes to backward. Where the example
passes an FSDP2 plugin, this passes a DeepSpeed one (FSDP2 trains a CPU job as DDP, and torch's ring attention has no
CPU kernel); under `python -m zerokit.deepspeed.install` the same loop trains with zerokit's Ulysses
(tests/test_sequence_parallel_scripts.py).

    torchrun --nproc_per_node 2 -m zerokit.deepspeed.install accelerate_cp.py --stage 3 --out results/
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, ParallelismConfig

from alst_common import SEQUENCE_PARALLEL, accelerate_rows, build_model, whole_row_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                 "zero_optimization": {"stage": args.stage}, "steps_per_print": 1000}
    parallelism = ParallelismConfig(cp_size=SEQUENCE_PARALLEL, dp_shard_size=int(os.environ["WORLD_SIZE"]) // SEQUENCE_PARALLEL)
    # Without a GPU, accelerate counts one process unless the backend is named.
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config), parallelism_config=parallelism,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(accelerate_rows()), batch_size=1,
                                         collate_fn=whole_row_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, pieces = [], []
    for batch in loader:
        buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1],
                                                no_restore_buffers=set(buffers)):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=accelerator.torch_device_mesh["dp_cp"].get_group())
        losses.append(loss.item())
        pieces.append({"positions": batch["position_ids"][0].tolist(), "tokens": batch["input_ids"][0].tolist()})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps({"losses": losses, "pieces": pieces}))


if __name__ == "__main__":
    main()
