"""Hugging Face files out of a running engine and into one (issue 46, items 3 and 5): engine.save_pretrained writes
what transformers' from_pretrained loads, equal to the bit to engine.full_state_dict() (tied weights included, the
alias left out as transformers leaves it out), sharded with an index past max_shard_size, streamed so that rank 0's
memory grows by about two of the largest tensors and not by the model; a failed write leaves the earlier files as
they were; the drop-in's save_16bit_model writes one file the same way; `zerokit consolidate --format hf` writes the
same directory offline; engine.load_pretrained reads a directory (zerokit's or transformers' own) into a stage-3
engine on 3 ranks, and refuses a directory of another model in one line, loading nothing.

Two spawns serve every test: 2 ranks (a GPT-2 at stage 1, the memory bound at stage 3, the drop-in), then 3 ranks
(a Llama at stage 3 in bf16, 3 dividing none of its parameter counts; loads at stage 3).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import zerokit
from zerokit.cli import main as cli_main
from zerokit.testing.parity import Case, engine_config, forward_loss, make_batch, make_model, make_optimizer
from zerokit.testing.spawn import spawn

transformers = pytest.importorskip("transformers")

LARGEST_BYTES = 32 * 2**20  # each of the memory model's six 2048 x 4096 fp32 matrices
GPT2 = Case("gpt2-s1", stage=1, model="hf-gpt2")
LLAMA = Case("llama-s3-bf16", stage=3, model="hf-llama", dtype="bf16", min_unit_params=100)
GPT2_AT_STAGE3 = Case("gpt2-s3", stage=3, model="hf-gpt2", min_unit_params=100)


def trained(case: Case, rank: int) -> zerokit.Engine:
    """The case's model on this rank's engine, one optimizer step in (so its weights are no longer the
    initialisation every rank builds)."""
    model = make_model(case)
    engine = zerokit.initialize(model, make_optimizer(case, model), engine_config(case))
    engine.backward(forward_loss(engine, make_batch(case, 0, 0, rank)))
    engine.step()
    return engine


def peak_growth(call) -> tuple[int | None, object]:
    """How much this process's peak resident memory grew while `call` ran (None where the kernel does not let a
    process reset its peak), and what it returned."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    except OSError:
        return None, call()
    baseline = _status("VmRSS")
    result = call()
    return _status("VmHWM") - baseline, result


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(key)).split()[1]) * 1024


def _files_equal(directory: Path, full: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> bool:
    """Every tensor of a directory's (or file's) safetensors equals full_state_dict's, cast to the file's dtype."""
    paths = [directory] if directory.suffix == ".safetensors" else sorted(directory.glob("*.safetensors"))
    for path in paths:
        with safe_open(path, framework="pt") as file:
            for key in file.keys():
                value = file.get_tensor(key)
                if (dtype and value.dtype != dtype) or not torch.equal(value, full[key].to(value.dtype)):
                    return False
    return True


# --- 2 ranks: GPT-2 at stage 1, a failed write, the memory bound, the drop-in ---------------------------------

def _two_ranks(rank: int, world_size: int, root: Path) -> dict:
    out: dict = {}
    engine = trained(GPT2, rank)
    out["gpt2_files"] = [p.name for p in engine.save_pretrained(root / "gpt2-s1")]
    engine.save_pretrained(root / "gpt2-s1-sharded", max_shard_size="20KB", dtype="bf16")
    out["gpt2_full"] = engine.full_state_dict()
    if rank == 0:  # the writer: the second shard cannot be written
        before = {p.name: p.read_bytes() for p in (root / "gpt2-s1-sharded").iterdir()}
        (root / "gpt2-s1-sharded" / "model-00002-of-00007.safetensors.tmp").mkdir()
    try:
        engine.save_pretrained(root / "gpt2-s1-sharded", max_shard_size="20KB")
    except (OSError, RuntimeError) as error:
        out["failed_write"] = f"{type(error).__name__}: {error}"
    if rank == 0:
        out["untouched"] = before == {p.name: p.read_bytes() for p in (root / "gpt2-s1-sharded").iterdir()
                                      if p.is_file()}
    engine.close()
    out.update(_memory_bound(rank, root))
    return out


def _memory_bound(rank: int, root: Path) -> dict:
    """Stage 3, each of six 32 MiB matrices a unit of its own, through the drop-in: save_pretrained's growth on rank 0
    (first, so that nothing of an earlier call is cached), then save_16bit_model's files, then full_state_dict's
    growth for comparison."""
    import zerokit.deepspeed as deepspeed

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets, and DeepSpeed's initialize reads
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 2048, bias=False) for _ in range(6)])
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_min_unit_params": 1000, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    save_growth, _ = peak_growth(lambda: engine.save_pretrained(root / "big", max_shard_size="110MB"))
    engine.save_16bit_model(root / "big16", "model.safetensors")
    engine.save_16bit_model(root / "big16", "pytorch_model.bin")
    full_growth, full = peak_growth(engine.full_state_dict)
    out = {}
    if rank == 0:
        bin_state = torch.load(root / "big16" / "pytorch_model.bin", weights_only=True)
        out = {"save_growth": save_growth, "full_growth": full_growth,
               "big_equal": _files_equal(root / "big", full), "bin_equal": bin_state.keys() == full.keys() and all(
                   torch.equal(bin_state[key], full[key]) for key in full),
               "sixteen_equal": _files_equal(root / "big16" / "model.safetensors", full),
               "big_files": sorted(p.name for p in (root / "big").iterdir())}
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("pretrained")
    return root, spawn(_two_ranks, 2, root)


# --- 3 ranks: a Llama at stage 3 in bf16, loads --------------------------------------------------------------

def _three_ranks(rank: int, world_size: int, root: Path) -> dict:
    out: dict = {}
    engine = trained(LLAMA, rank)
    engine.save_pretrained(root / "llama-s3")
    engine.save_pretrained(root / "llama-s3-sharded", max_shard_size="30KB")
    engine.save_checkpoint(root / "llama-ckpt")
    out["llama_full"] = engine.full_state_dict()
    engine.close()
    target = zerokit.initialize(make_model(LLAMA), None, engine_config(LLAMA))  # forward only: no optimizer
    initial = target.full_state_dict()
    try:
        target.load_pretrained(root / "bad")
    except ValueError as error:
        out["bad"] = str(error)
    out["bad_loaded_nothing"] = _same(target.full_state_dict(), initial)
    target.load_pretrained(root / "llama-s3-sharded")
    out["loaded"] = target.full_state_dict()
    target.load_pretrained(root / "hf-llama-sharded")  # transformers' own files
    out["loaded_hf"] = target.full_state_dict()
    target.close()
    target = trained(GPT2_AT_STAGE3, rank)  # with an optimizer: its state is left as it is
    target.load_pretrained(root / "gpt2-s1")  # saved by 2 ranks at stage 1
    out["gpt2_loaded"] = target.full_state_dict()
    target.close()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.fixture(scope="module")
def three(two) -> tuple[Path, list[dict], dict[str, torch.Tensor]]:
    """Beside the 2 ranks' directories: transformers' own save of the Llama, and a directory with one key renamed."""
    root = two[0]
    reference = make_model(LLAMA)
    reference.save_pretrained(root / "hf-llama")
    reference.save_pretrained(root / "hf-llama-sharded", max_shard_size="30KB")
    state = load_file(root / "hf-llama" / "model.safetensors")
    state["model.final_norm.weight"] = state.pop("model.norm.weight")
    (root / "bad").mkdir()
    save_file(state, root / "bad" / "model.safetensors")
    return root, spawn(_three_ranks, 3, root), reference.state_dict()


# --- save_pretrained ---------------------------------------------------------------------------------------------

def test_from_pretrained_loads_what_the_engine_holds(two, three) -> None:
    """GPT-2 (fp32, stage 1, 2 ranks) and Llama (bf16, stage 3, 3 ranks): every weight from_pretrained loads, the tied
    head included, equals full_state_dict() at the engine's compute precision, to the bit."""
    for directory, full, dtype in ((two[0] / "gpt2-s1", two[1][0]["gpt2_full"], torch.float32),
                                   (three[0] / "llama-s3", three[1][0]["llama_full"], torch.bfloat16)):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        loaded = model.state_dict()
        assert loaded.keys() == full.keys()
        for key, value in loaded.items():
            assert value.dtype == dtype and torch.equal(value, full[key].to(dtype)), key
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied again
        assert _files_equal(directory, full, dtype)


def test_the_directory_is_laid_out_as_transformers_writes_it(three) -> None:
    """The same files and keys as transformers' save_pretrained of the same model (the tied head left out), the
    index in its format, config.json saying the dtype the weights are in."""
    root = three[0]
    ours, theirs = root / "llama-s3", root / "hf-llama"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    with safe_open(ours / "model.safetensors", "pt") as mine, safe_open(theirs / "model.safetensors", "pt") as hf:
        assert set(mine.keys()) == set(hf.keys()) and "lm_head.weight" not in mine.keys()
        assert mine.metadata() == hf.metadata() == {"format": "pt"}
    config = json.loads((ours / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    index = json.loads((root / "llama-s3-sharded" / "model.safetensors.index.json").read_text())
    hf_index = json.loads((root / "hf-llama-sharded" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == hf_index["metadata"]["total_parameters"]
    assert index["weight_map"].keys() == hf_index["weight_map"].keys() and list(index["weight_map"]) == sorted(
        index["weight_map"])


def test_past_max_shard_size_the_weights_are_sharded_with_an_index(two) -> None:
    root, ranks = two
    directory, full = root / "gpt2-s1-sharded", ranks[0]["gpt2_full"]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00004.safetensors"
                                                                  for i in range(1, 5)]
    assert not (directory / "model.safetensors").exists()
    for name in files:
        assert (directory / name).stat().st_size < 20_000 + 4096  # a header beside at most 20KB of weights
    assert set(index["weight_map"]) == set(full) - {"lm_head.weight"}
    assert _files_equal(directory, full, torch.bfloat16)  # dtype="bf16": the engine's values, cast
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert torch.equal(model.lm_head.weight, full["transformer.wte.weight"].bfloat16())


def test_a_failed_write_leaves_the_earlier_files_as_they_were(two) -> None:
    """Rank 0 cannot write the second shard: every rank raises, and the directory holds the earlier save, byte for
    byte, and no temporary file."""
    root, ranks = two
    assert ranks[0]["failed_write"].startswith("IsADirectoryError")
    assert ranks[1]["failed_write"].startswith("RuntimeError: rank 0 could not write")
    assert ranks[0]["untouched"]
    leftovers = [p.name for p in (root / "gpt2-s1-sharded").iterdir() if p.name.endswith(".tmp") and p.is_file()]
    assert leftovers == []


def test_rank0_memory_grows_by_the_unit_gathered_not_by_the_model(two) -> None:
    """A model of six 32 MiB matrices at stage 3: saving grows rank 0's peak by the unit gathered, written from its
    own memory (measured 32.0 MiB), where full_state_dict() grows it by the model (224 MiB)."""
    measured = two[1][0]
    if measured["save_growth"] is None:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    assert measured["big_equal"] and measured["big_files"] == ["model-00001-of-00002.safetensors",
                                                               "model-00002-of-00002.safetensors",
                                                               "model.safetensors.index.json"]
    assert measured["save_growth"] < 1.5 * LARGEST_BYTES, f"grew by {measured['save_growth'] / 2**20:.1f} MiB"
    assert measured["full_growth"] > 5 * LARGEST_BYTES  # the comparison means something


def test_the_drop_ins_save_16bit_model_writes_one_file(two) -> None:
    """A .safetensors name: safetensors, streamed; any other: torch.save of the state dict, as DeepSpeed writes."""
    measured = two[1][0]
    assert measured["sixteen_equal"] and measured["bin_equal"]


def test_consolidate_format_hf_writes_what_save_pretrained_writes(three, tmp_path, capsys) -> None:
    """Offline from the Llama's checkpoint: the same files as save_pretrained (less generation_config.json, which no
    checkpoint keeps), the same keys, and in bf16 the same bits (the compute parameters are the masters in bf16)."""
    root = three[0]
    out = tmp_path / "hf"
    assert cli_main(["consolidate", str(root / "llama-ckpt"), str(out), "--format", "hf", "--dtype", "bf16",
                     "--max-shard-size", "30KB"]) == 0
    saved = root / "llama-s3-sharded"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in saved.iterdir()
                                                           if p.name != "generation_config.json")
    assert _files_equal(out, three[1][0]["llama_full"], torch.bfloat16)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].keys() == json.loads(
        (saved / "model.safetensors.index.json").read_text())["weight_map"].keys()
    one_file = tmp_path / "all.safetensors"
    assert cli_main(["consolidate", str(root / "llama-ckpt"), str(one_file), "--format", "safetensors"]) == 0
    assert "lm_head.weight" in load_file(one_file)  # one file: every key of the state dict
    assert cli_main(["consolidate", str(root / "llama-ckpt"), str(one_file), "--format", "hf"]) == 2
    assert "the hf format writes a directory" in capsys.readouterr().err


# --- load_pretrained -----------------------------------------------------------------------------------------

def test_load_pretrained_on_3_ranks_at_stage_3_gives_the_saved_weights(three) -> None:
    ranks = three[1]
    source = ranks[0]["llama_full"]
    for rank in ranks:
        assert _same(rank["loaded"], source)


def test_load_pretrained_reads_transformers_own_files_and_other_stages_saves(two, three) -> None:
    """transformers' sharded save of the Llama (fp32, loaded into a bf16 engine), and the GPT-2 that 2 ranks saved at
    stage 1, loaded by 3 ranks at stage 3."""
    reference = three[2]
    loaded = three[1][0]["loaded_hf"]
    assert loaded.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(loaded[key], value.bfloat16().float()), key
    assert _same(three[1][2]["gpt2_loaded"], two[1][0]["gpt2_full"])


def test_a_directory_of_another_model_is_refused_in_one_line_and_nothing_is_loaded(three) -> None:
    for rank in three[1]:
        assert rank["bad"] == (f"rank 0: {three[0] / 'bad'}: is not this model's (LlamaForCausalLM): it has no "
                               "'model.norm.weight'; it has 'model.final_norm.weight', which this model lacks; "
                               "nothing was loaded")
        assert rank["bad_loaded_nothing"]


def test_a_directory_without_weights_is_named(one_process, tmp_path) -> None:
    model = make_model(GPT2)
    engine = zerokit.initialize(model, None, {"zero_optimization": {"stage": 0}})
    with pytest.raises(ValueError, match="has no model.safetensors or model.safetensors.index.json"):
        engine.load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safe_serialization=False"):
        engine.save_pretrained(tmp_path, safe_serialization=False)
    with pytest.raises(ValueError, match="max_shard_size 'lots' is not a size"):
        engine.save_pretrained(tmp_path, max_shard_size="lots")
    engine.close()
    assert not os.listdir(tmp_path)
