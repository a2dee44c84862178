"""Model specs: preset parameter counts, config.json reading, LoRA counts, bad input."""

from __future__ import annotations

import json

import pytest

from zerokit.planner.models import (
    PRESETS,
    Architecture,
    from_hf_config,
    from_param_count,
    lora_params,
    param_counts,
    preset,
    resolve_model,
)
from zerokit.planner.spec import Trainable

# Parameter counts the Hugging Face checkpoints report (tied GPT-2 embeddings counted once).
HF_COUNTS = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("key", list(HF_COUNTS))
def test_preset_parameter_counts(key):
    assert preset(key).total_params == HF_COUNTS[key]
    assert preset(key).source  # every preset says where its shapes come from


def test_presets_cover_the_required_families():
    assert set(HF_COUNTS) <= set(PRESETS)


def test_llama2_7b_by_hand():
    """Embedding and head 2 x 32,000 x 4,096 = 262,144,000; per block q,k,v,o 4 x 4096^2 = 67,108,864,
    MLP 3 x 4096 x 11,008 = 135,266,304, two RMSNorms 8,192 -> 202,383,360 x 32 = 6,476,267,520;
    final norm 4,096. Total 6,738,415,616."""
    arch = preset("llama2-7b").architecture
    assert arch.block_params() == 202_383_360
    assert 262_144_000 + 32 * 202_383_360 + 4_096 == 6_738_415_616


def test_root_is_what_the_blocks_leave():
    """Stage 3 keeps the root gathered: Llama-2-13B embedding + head 2 x 32,000 x 5,120 + final norm 5,120;
    GPT-2 token and position embeddings 50,257 x 768 + 1,024 x 768 + final LayerNorm 2 x 768 (head tied)."""
    assert preset("llama2-13b").architecture.root_params() == 2 * 163_840_000 + 5_120 == 327_685_120
    assert preset("gpt2").architecture.root_params() == 38_597_376 + 786_432 + 1_536


def test_lora_rank_16_on_llama2_7b():
    """Per block r (d_in + d_out): q, k, v, o 4 x 16 x 8192 = 524,288; gate, up, down 3 x 16 x (4096 + 11008)
    = 724,992 -> 1,249,280 x 32 blocks = 39,976,960 (what PEFT prints for this setup)."""
    arch = preset("llama2-7b").architecture
    assert lora_params(arch, Trainable(lora_rank=16)) == 39_976_960
    # q and v only, r = 8: 2 x 8 x 8192 x 32 = 4,194,304 (PEFT's default targets for Llama)
    assert lora_params(arch, Trainable(lora_rank=8, lora_targets=("q", "v"))) == 4_194_304


def test_trainable_fraction_counts():
    counts = param_counts(from_param_count(1e9), Trainable(fraction=0.1))
    assert (counts.total, counts.trainable, counts.frozen) == (10**9, 10**8, 9 * 10**8)


def test_lora_needs_shapes():
    with pytest.raises(ValueError, match="LoRA rank needs the model's shapes"):
        param_counts(from_param_count(1e9), Trainable(lora_rank=8))


def test_gpt2_has_no_gate_projection():
    with pytest.raises(ValueError, match="gate"):
        lora_params(preset("gpt2").architecture, Trainable(lora_rank=8, lora_targets=("gate",)))


def write(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


LLAMA2_13B_CONFIG = {"model_type": "llama", "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40,
                     "num_key_value_heads": 40, "intermediate_size": 13824, "vocab_size": 32000,
                     "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_hf_config_llama(tmp_path):
    spec = from_hf_config(write(tmp_path, LLAMA2_13B_CONFIG))
    assert spec.total_params == 13_015_864_320 and spec.context == 4096


def test_hf_config_gpt2(tmp_path):
    config = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024,
              "n_inner": None}
    assert from_hf_config(write(tmp_path, config)).total_params == 124_439_808


def test_hf_config_qwen2_has_qkv_biases(tmp_path):
    """Qwen2 puts biases on q, k and v: + (q_dim + 2 kv_dim) per block over the bias-free count."""
    config = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True}
    spec = from_hf_config(write(tmp_path, config))
    plain = Architecture(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=100, tied_embeddings=True)
    assert spec.total_params == plain.total_params() + 2 * (64 + 2 * 32)


def test_resolve_model_accepts_each_form(tmp_path):
    assert resolve_model("llama2-13b").total_params == HF_COUNTS["llama2-13b"]
    assert resolve_model(str(write(tmp_path, LLAMA2_13B_CONFIG))).total_params == HF_COUNTS["llama2-13b"]
    assert resolve_model(13e9).total_params == 13 * 10**9
    assert resolve_model(preset("gpt2").architecture).total_params == HF_COUNTS["gpt2"]


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ({"model_type": "t5"}, "model_type 't5' is not supported; accepted: gpt2, llama, mistral, qwen2"),
    ({**LLAMA2_13B_CONFIG, "hidden_size": None}, "missing key 'hidden_size'"),
    ({**LLAMA2_13B_CONFIG, "num_hidden_layers": -2}, "num_hidden_layers=-2 must be a positive integer"),
    ({**LLAMA2_13B_CONFIG, "num_key_value_heads": 7}, "not a multiple of kv_heads=7"),
])
def test_malformed_config_json(tmp_path, content, message):
    path = write(tmp_path, content)
    if isinstance(content, dict) and content.get("hidden_size", 0) is None:
        path.write_text(json.dumps({k: v for k, v in content.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_hf_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        from_hf_config(tmp_path / "nope.json")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "13B"])
def test_bad_parameter_counts(bad):
    with pytest.raises(ValueError):
        resolve_model(bad)


def test_unknown_preset_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="unknown model preset 'llama9'; accepted: gpt2, "):
        resolve_model("llama9")
