"""A DeepSpeed ALST (Ulysses sequence parallelism) training script as DeepSpeed's tutorial writes one
(deepspeed.ai/tutorials/ulysses-alst-sequence-parallelism): register_with_transformers, a Hugging Face model,
initialize(mpu=...), UlyssesSPDataLoaderAdapter, the loss of each shard combined by its targets. Two departures,
both for CPU ranks on gloo: the model is a small Llama built here (no hub), and the shards' losses are combined by
an all-reduce rather than the tutorial's torch.distributed.nn all_gather, whose backward fails on a gloo subgroup.
Its import lines are the only ones tests/test_sequence_parallel_scripts.py changes to run it on zerokit.

    torchrun --nproc_per_node 4 ds_alst.py --stage 3 --out results/
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from deepspeed.utils import groups

from alst_common import SEQ_LENGTH, SEQUENCE_PARALLEL, collate, model_config, rank_samples

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "gradient_clipping": 1.0, "sequence_parallel_size": SEQUENCE_PARALLEL, "steps_per_print": 1000}
    deepspeed.init_distributed(dist_backend="gloo")

    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config())
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=SEQUENCE_PARALLEL,
        micro_batch_size=1, seq_length=SEQ_LENGTH, seq_length_is_variable=True)
    engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters(), mpu=mpu)

    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()
    data = torch.utils.data.TensorDataset(rank_samples(dist.get_rank()))
    loader = torch.utils.data.DataLoader(data, batch_size=1, collate_fn=collate)
    loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size,
                                        device=engine.device)
    losses, norms = [], []
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        outputs = engine(**batch)
        shift_labels = batch["shift_labels"]
        loss = engine.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                           vocab_size=engine.module.config.vocab_size)
        good_tokens = (shift_labels != -100).view(-1).sum()
        total_loss = torch.distributed.nn.functional.all_reduce(loss * good_tokens, group=sp_group)
        total_good_tokens = torch.distributed.nn.functional.all_reduce(good_tokens.float(), group=sp_group)
        loss = total_loss / total_good_tokens.clamp(min=1)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    result = {"losses": losses, "norms": norms, "sp_rank": sp_rank, "rank": dist.get_rank()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
