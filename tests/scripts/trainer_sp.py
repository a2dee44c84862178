"""The Hugging Face Trainer with DeepSpeed's sequence parallelism, as transformers' docs set it up: TrainingArguments'
parallelism_config (accelerate's ParallelismConfig(sp_size=2, sp_backend="deepspeed")) beside a DeepSpeed config.
The Trainer then computes each shard's loss and combines them (its torch.distributed.nn all_gather, whose backward
works over a gloo group of ranks 0 and 1: 2 ranks). Unchanged, it runs on zerokit under
`python -m zerokit.deepspeed.install` (tests/test_sequence_parallel_scripts.py); DeepSpeed 0.19.8 stops on a CPU here
(its parallel_state_sp asserts an initialised deepspeed.comm the Trainer never starts on a CPU).

    torchrun --nproc_per_node 2 -m zerokit.deepspeed.install trainer_sp.py --stage 3 --out results/

With --context-parallel the same Trainer takes accelerate's context parallelism instead, ParallelismConfig(cp_size=2):
it cuts each batch's input ids, labels, shifted labels and position ids inside accelerator.maybe_context_parallel
and scales each rank's loss (its tokens' sum over the step's target count, times the processes) so that the average
over ranks is the step's mean; on zerokit, Ulysses runs in place of torch's ring attention
(zerokit/integrations/accelerate_cp.py).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
from transformers import Trainer, TrainingArguments

from alst_common import SEQUENCE_PARALLEL, accelerate_rows, build_model, collate

STEPS = 6


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.rows = accelerate_rows()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple:
        return (self.rows[index],)


class InOrder(Trainer):
    """Rows in order (the test's one process reads them so)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--context-parallel", action="store_true")
    cli = parser.parse_args()
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                 "zero_optimization": {"stage": cli.stage},
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    parallelism = ParallelismConfig(sp_size=SEQUENCE_PARALLEL, sp_backend="deepspeed", dp_shard_size=1,
                                    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                               sp_attn_implementation="sdpa"))
    if cli.context_parallel:
        parallelism = ParallelismConfig(cp_size=SEQUENCE_PARALLEL, dp_shard_size=1)
    args = TrainingArguments(output_dir=cli.out, per_device_train_batch_size=1, max_steps=STEPS, logging_steps=1,
                             report_to=[], deepspeed=ds_config, parallelism_config=parallelism, save_strategy="no",
                             learning_rate=1e-3, max_grad_norm=1.0, use_cpu=True, remove_unused_columns=False,
                             lr_scheduler_type="constant", disable_tqdm=True)
    trainer = InOrder(model=build_model(), args=args, train_dataset=Rows(), data_collator=collate)
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    Path(cli.out).mkdir(parents=True, exist_ok=True)
    (Path(cli.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"losses": [entry["loss"] for entry in history], "norms": [entry["grad_norm"] for entry in history]}))


if __name__ == "__main__":
    main()
