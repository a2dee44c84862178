"""What the sequence-parallel scripts here (ds_alst.py, accelerate_sp.py) share with the tests that check them: a
small Llama, each rank's token rows, the collator; plain torch and transformers (no DeepSpeed, no zerokit)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQUENCE_PARALLEL, SEQ_LENGTH, VOCAB, SAMPLES_PER_RANK = 2, 16, 97, 2


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       attn_implementation="sdpa")


def rank_samples(rank: int) -> torch.Tensor:
    """The token rows the loader gives `rank` (each rank its own)."""
    return torch.randint(0, VOCAB, (SAMPLES_PER_RANK, SEQ_LENGTH), generator=torch.Generator().manual_seed(rank))


def collate(rows: list) -> dict:
    input_ids = torch.stack([row[0] for row in rows])
    labels = input_ids.clone()
    labels[:, :3] = -100  # a prompt without targets: the first shard counts fewer
    positions = torch.arange(SEQ_LENGTH).expand_as(input_ids)
    return {"input_ids": input_ids, "position_ids": positions, "labels": labels}


def whole_row_batch(rows: list) -> dict:
    """Every token a target (each piece of a row counts as many), with the shifted labels a context-parallel loop
    passes (accelerate_cp.py)."""
    input_ids = torch.stack([row[0] for row in rows])
    shift_labels = torch.nn.functional.pad(input_ids, (0, 1), value=-100)[:, 1:].contiguous()
    positions = torch.arange(SEQ_LENGTH).expand_as(input_ids).contiguous()
    return {"input_ids": input_ids, "position_ids": positions, "labels": input_ids.clone(),
            "shift_labels": shift_labels}


def accelerate_rows() -> torch.Tensor:
    """accelerate_sp.py's dataset: 8 rows."""
    return torch.cat([rank_samples(rank) for rank in range(4)])


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(model_config())
