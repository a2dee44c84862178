"""Configs DeepSpeed trains with are not refused (issue 22): public projects' configs (tests/fixtures/ds_configs/
public/, each naming its project, path and commit in "_source") are read, resolved and trained on two gloo ranks,
and those asking for what zerokit does not offer, or that DeepSpeed 0.19.8 refuses too, are refused in one line
naming the key ("_refused"). Knobs whose only effect is speed or memory layout are accepted and logged, and
train the same numbers either way; "auto" sizes are resolved with or without the model's hidden size."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import zerokit
from zerokit.config.typed import Offload, ZeroConfig, load_config
from zerokit.config.defaults import DEFAULT_BUCKET_BYTES
from zerokit.config.dsconfig import read
from zerokit.masters.shards import piece_numel
from zerokit.comm.process import configure_logging
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups
from zerokit.testing.parity import Case, fp32_state, make_model, run_cases, run_reference
from zerokit.testing.spawn import spawn

PUBLIC = sorted((Path(__file__).parent / "fixtures" / "ds_configs" / "public").glob("*.json"))
TOKENS = 67


def raw_of(path: Path) -> dict:
    return json.loads(path.read_text())


def world_for(raw: dict) -> int:
    """2 ranks, unless the config fixes its batch identity for another world size (Megatron-DeepSpeed's
    ds_config.json: train_batch_size 16 = micro-batch 16 x 1 step x 1 rank)."""
    sizes = [raw.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps")]
    if all(isinstance(size, int) for size in sizes):
        return sizes[0] // (sizes[1] * sizes[2])
    return 2


ACCEPTED = [path for path in PUBLIC if "_refused" not in raw_of(path)]
# AutoTP configs split a model by its tensor-parallel plan: tests/test_tensor_parallel.py trains them (a Llama, 4 ranks)
SPLIT_BY_PLAN = [path for path in ACCEPTED if "tensor_parallel" in raw_of(path)]
REFUSED = [path for path in PUBLIC if "_refused" in raw_of(path)]


@pytest.mark.parametrize("path", PUBLIC, ids=lambda path: path.name)
def test_a_public_config_is_read_or_refused_in_one_line(path):
    raw = raw_of(path)
    assert raw["_source"].count(" ") == 2 and "@" in raw["_source"]  # project, path in it, @commit
    if "_refused" in raw:
        with pytest.raises(ValueError) as error:
            load_config(raw)
        assert str(error.value).startswith(raw["_refused"]) and "\n" not in str(error.value)
        return
    for hidden_size in (None, 24):  # a plain module, a model whose config says its hidden size
        config = load_config(raw).resolve(world_size=world_for(raw), hidden_size=hidden_size)
        assert not config.pending_auto and all("\n" not in line for line in config.startup_log_lines())


def test_the_public_set_covers_the_cases_of_issue_22():
    names = {path.name for path in PUBLIC}
    assert len({raw_of(path)["_source"].split()[0] for path in PUBLIC}) >= 9  # projects
    assert {"glm_config_block_10B.json", "ms_swift_zero3.json", "axolotl_zero3_bf16.json",
            "megatron_deepspeed_examples_ds_config.json", "llama_factory_ds_z3_config.json",
            "qwen_ds_config_zero3.json", "llava_zero3.json", "accelerate_ds_config_zero3.json",
            "transformers_ds_config_zero3.json", "accelerate_zero_stage2_config.json",
            "megatron_deepspeed_zero2_bf16.json"} <= names


# --- what each finding of the issue reads as ------------------------------------------------------------------

def lines_of(raw: dict, world_size: int = 2, hidden_size: int | None = None) -> list[str]:
    return load_config(raw).resolve(world_size=world_size, hidden_size=hidden_size).startup_log_lines()


@pytest.mark.parametrize("raw, line", [
    ({"zero_optimization": {"stage": 2, "contiguous_gradients": False}},
     "zero_optimization.contiguous_gradients=false: accepted, zerokit's gradient buckets are always contiguous"),
    ({"zero_optimization": {"stage": 3, "allgather_partitions": False}},
     "zero_optimization.allgather_partitions=false: accepted, zerokit gathers updated parameters"),
    ({"zero_optimization": {"stage": 3, "overlap_comm": False}},
     "zero_optimization.overlap_comm=false: stage 3 still reduces each unit during backward"),
    ({"zero_optimization": {"stage": 3, "sub_group_size": 0}},
     "zero_optimization.sub_group_size=0: one optimizer piece per parameter"),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_param.device=cpu: not used at stage 1, which keeps whole parameters on every rank"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/raid"}}},
     "zero_optimization.offload_optimizer.device=nvme: not used at stage 0, which keeps the whole optimizer state"),
    ({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9}},
     "zero_optimization.stage3_max_live_parameters=1000000000: not used at stage 2 (DeepSpeed reads it only at "
     "stage 3)"),
])
def test_knobs_deepspeed_trains_with_are_accepted_and_logged(raw, line):
    assert any(logged.startswith(line) for logged in lines_of(raw)), lines_of(raw)


@pytest.mark.parametrize("path, value", [
    ("zero_optimization.parameter_alignment", True), ("zero_optimization.elastic_checkpoint", True),
    ("zero_optimization.pipeline_loading_checkpoint", True),
    ("zero_optimization.stage3_model_persistence_threshold", 1e6),
    ("zero_optimization.stage3_module_granularity_threshold", 16),
    ("zero_optimization.leaf_module", {"classes": ["Block"]}),
    ("zero_optimization.offload_optimizer.super_offload", True),
    ("compile", {"deepcompile": True}), ("compile", {"disable": False, "backend": "inductor"}),
    ("datastates_ckpt", {"host_cache_size": 16}), ("checkpoint.writer", {"type": "fast", "decoupled": True}),
    ("checkpoint.checkpoint_serialization", False), ("checkpoint.parallel_write.pipeline_stage", True),
    ("disable_allgather", True), ("memory_breakdown", True), ("dump_state", True), ("disable_python_gc", True),
    ("bf16.check_grad_overflow", False), ("optimizer.legacy_fusion", True),
    ("seq_parallel_communication_data_type", "bf16"), ("use_data_before_expert_parallelism", True),
])
def test_speed_and_layout_only_keys_are_accepted_and_named(path, value):
    """The audit of every key the reader refused: each of these changes only speed, memory or file layout."""
    raw: dict = {"zero_optimization": {"stage": 3}}
    *blocks, name = path.split(".")
    node = raw
    for block in blocks:
        node = node.setdefault(block, {})
    node[name] = value
    if path.startswith("optimizer."):
        raw["optimizer"]["type"] = "AdamW"
    notes = read(raw).notes
    assert any(note.startswith(path) and ": accepted, " in note for note in notes), notes


@pytest.mark.parametrize("raw, start", [
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op='sum' is not supported"),
    ({"zero_optimization": {"load_from_fp32_weights": False}}, "zero_optimization.load_from_fp32_weights=false"),
    ({"zero_optimization": {"legacy_stage1": True}}, "zero_optimization.legacy_stage1=true asks for"),
    ({"optimizer": {"type": "AdamW", "params": {"bias_correction": False}}}, "optimizer.params.bias_correction"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
     "scheduler.params.total_num_steps='auto': zerokit cannot know how many steps you will train"),
    ({"communication_data_type": "bfp16"}, "communication_data_type='bfp16' is not a dtype: DeepSpeed 0.19.8 refuses"),
])
def test_what_changes_the_numbers_or_deepspeed_refuses_stays_a_one_line_refusal(raw, start):
    with pytest.raises(ValueError) as error:
        load_config(raw)
    assert str(error.value).startswith(start) and "\n" not in str(error.value)


def test_unknown_top_level_keys_are_ignored_with_a_warning_and_typos_refused():
    config = load_config({"comms_config": {"verbose": False}, "monitor_config": {"enabled": True}, "msamp": {}})
    assert config.warnings == tuple(f"unknown top-level key {name!r}: ignored, as DeepSpeed 0.19.8 ignores it"
                                    for name in ("comms_config", "monitor_config", "msamp"))
    for typo, meant in (("zero_optimisation", "zero_optimization"), ("gradient_acumulation_steps",
                                                                      "gradient_accumulation_steps"),
                        ("optimiser", "optimizer"), ("step_per_print", "steps_per_print")):
        with pytest.raises(ValueError, match=f"^unknown top-level key '{typo}'; did you mean {meant}\\?$"):
            load_config({typo: 1})
    with pytest.raises(ValueError, match="unknown comms_logger key 'verbos'; did you mean verbose"):
        load_config({"comms_logger": {"verbos": True}})  # inside a block DeepSpeed refuses unknown keys too


def test_the_engine_logs_what_it_ignored_as_a_warning(one_process, caplog):
    model = nn.Linear(4, 4)
    configure_logging()  # once configured, the zerokit logger stops propagating: let caplog see it here
    with caplog.at_level(logging.INFO, logger="zerokit"):
        logger = logging.getLogger("zerokit")
        propagate, logger.propagate = logger.propagate, True
        try:
            zerokit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {"zero_optimization": {"stage": 1, "contiguous_gradients": False},
                                "comms_config": {"verbose": False}})
        finally:
            logger.propagate = propagate
    levels = {record.getMessage(): record.levelno for record in caplog.records}
    assert levels["unknown top-level key 'comms_config': ignored, as DeepSpeed 0.19.8 ignores it"] == logging.WARNING
    assert any(message.startswith("zero_optimization.contiguous_gradients=false: accepted") and level == logging.INFO
               for message, level in levels.items())


def test_parameter_offload_below_stage_3_stays_refused_in_a_typed_config():
    with pytest.raises(ValueError, match="offload_param.device=cpu needs stage 3"):
        ZeroConfig(stage=1, offload_param=Offload(device="cpu"))


def test_sub_group_size_zero_is_one_piece_per_parameter(one_process):
    assert piece_numel(0, "cpu") == piece_numel(0, "cuda") > 10**15
    assert piece_numel(None, "cpu") == 1 << 16 and piece_numel(997, "cpu") == 997
    pieces = {}
    for sub_group_size in (None, 0):
        model = nn.Linear(300, 300)  # 90,000 weights: over the CPU's default piece of 65,536
        zero = {"stage": 1, **({} if sub_group_size is None else {"sub_group_size": sub_group_size})}
        engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_optimization": zero})
        pieces[sub_group_size] = engine.stage.masters.piece_count
    assert pieces == {None: 3, 0: 2}  # the weight in two pieces and the bias, or each parameter whole


def test_a_fused_optimizer_steps_whole_parameters_in_host_memory(one_process):
    """[Note: optimizer pieces]: in host memory (a CPU run's, or an offloaded optimizer's), torch's for-loop AdamW
    steps 64K-element pieces, its fused kernel whole parameters (cutting cost it a kernel call a piece: 69,000 of
    them for a 4.5B model); the fused step is the same to the bit either way, and the plan counts the engine's
    pieces to the byte."""
    from zerokit.planner.engine_model import EngineSetup, engine_states
    from zerokit.profiling.inventory import param_inventory
    from zerokit.profiling.record import steps_fused

    runs = {}
    for name, fused, sub_group_size in (("for-loop", False, None), ("fused", True, None),
                                        ("fused in 64K pieces", True, 1 << 16)):
        torch.manual_seed(0)
        model = nn.Linear(300, 300)  # 90,000 weights: over the CPU's default piece of 65,536
        optimizer = torch.optim.AdamW(model.parameters(), fused=fused)
        zero = {"stage": 2, **({} if sub_group_size is None else {"sub_group_size": sub_group_size})}
        engine = zerokit.initialize(model, optimizer, {"zero_optimization": zero})
        inputs = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            engine.backward(engine(inputs).square().mean())
            engine.step()
        setup = EngineSetup(stage=2, world=1, sub_group_size=sub_group_size,
                            fused_optimizer=steps_fused(engine.optimizer))
        predicted = engine_states(param_inventory(model, optimizer, engine.config.stage3), setup).after_step
        runs[name] = (engine.stage.masters.piece_count, [p.detach().clone() for p in model.parameters()],
                      (predicted, engine.memory_stats()))
    assert {name: run[0] for name, run in runs.items()} == {"for-loop": 3, "fused": 2, "fused in 64K pieces": 3}
    assert all(torch.equal(a, b) for a, b in zip(runs["fused"][1], runs["fused in 64K pieces"][1]))
    assert all(run[2][0] == run[2][1] for run in runs.values()), {n: r[2] for n, r in runs.items()}


def test_a_live_limit_below_the_models_need_is_read_as_that_need(one_process):
    """axolotl's ZeRO-3 templates: max_live_parameters 0, which DeepSpeed reads as "prefetch nothing"."""
    model = tiny()
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_optimization": {
        "stage": 3, "stage3_min_unit_params": 1000, "stage3_max_live_parameters": 0}})
    shards = engine.stage.shards
    assert shards.live_limit == shards.needed_live_numel > 0
    assert any(line.startswith("zero_optimization.stage3_max_live_parameters=0 is below the") and
               f"read as {shards.needed_live_numel:,}" in line for line in engine.stage.describe())


def test_auto_sizes_follow_the_hidden_size_or_zerokits_defaults():
    raw = raw_of(next(path for path in PUBLIC if path.name == "llava_zero3.json"))
    with_model = load_config(raw).resolve(world_size=2, hidden_size=24)
    assert (with_model.reduce_bucket_bytes, with_model.stage3.prefetch_numel,
            with_model.stage3.persistence_threshold) == (24 * 24 * 4, int(0.9 * 24 * 24), 240)
    plain = load_config(raw).resolve(world_size=2, hidden_size=None)
    assert (plain.reduce_bucket_bytes, plain.stage3.prefetch_numel, plain.stage3.persistence_threshold) == (
        DEFAULT_BUCKET_BYTES, 50_000_000, 100_000)
    assert sum("the model has no config.hidden_size" in line for line in plain.startup_log_lines()) == 3


# --- training: every accepted public config, and the knobs that must not change the numbers -----------------

class Plain(nn.Module):
    """TinyGPT behind a module with no `config`: a model that does not say its hidden size."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyGPT(TinyGPTConfig())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens)


def train(model: nn.Module, raw: dict, rank: int, steps: int = 2) -> tuple[zerokit.Engine, list[float]]:
    optimizer = None if "optimizer" in raw else torch.optim.AdamW(param_groups(model), lr=1e-3)
    engine = zerokit.initialize(model, optimizer, raw)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps * engine.config.gradient_accumulation_steps):
        tokens = torch.randint(0, TOKENS, (engine.config.train_micro_batch_size_per_gpu, 17), generator=generator)
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def tiny() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig())


# Each pair trains the same model on the same data with a knob DeepSpeed reads as speed/layout only, both ways.
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}
SAME_NUMBERS = {
    "overlap_comm at stage 3": ({"stage": 3, "stage3_min_unit_params": 1000}, {"overlap_comm": False}),
    "contiguous_gradients at stage 2": ({"stage": 2, "reduce_bucket_size": 4000}, {"contiguous_gradients": False}),
    "allgather_partitions at stage 1": ({"stage": 1, "reduce_bucket_size": 4000}, {"allgather_partitions": False}),
    "sub_group_size 0 at stage 3": ({"stage": 3, "stage3_min_unit_params": 1000, "sub_group_size": 1e9},
                                    {"sub_group_size": 0}),
    "offload_param at stage 1": ({"stage": 1}, {"offload_param": {"device": "cpu"}}),
    "max_live_parameters 0 at stage 3": ({"stage": 3, "stage3_min_unit_params": 1000},
                                         {"stage3_max_live_parameters": 0}),
}
# The same, against one process (zerokit/testing/parity.py): an `optimizer` block's fused AdamW, stage 3 with
# overlap_comm false, one optimizer piece per parameter.
PARITY = [Case("stage2-adamw-block", stage=2, optimizer="adamw-block"),
          Case("stage3-adamw-block-no-overlap", stage=3, optimizer="adamw-block", overlap_comm=False),
          Case("stage1-sub-group-0", stage=1, sub_group_size=0)]


def run_public(rank: int, world_size: int) -> dict:
    out: dict = {"losses": {}, "same": {}}
    for path in ACCEPTED:
        raw = raw_of(path)
        if world_for(raw) == world_size and path not in SPLIT_BY_PLAN:
            out["losses"][path.name] = train(tiny(), raw, rank)[1]
    engine, losses = train(Plain(), raw_of(next(p for p in PUBLIC if p.name == "llava_zero3.json")), rank)
    out["plain"] = (engine.config.reduce_bucket_bytes, engine.config.stage3.prefetch_numel, losses)
    for name, (zero, knob) in SAME_NUMBERS.items():
        states = []
        for extra in ({}, knob):
            engine, losses = train(tiny(), {**BASE, "zero_optimization": {**zero, **extra}}, rank, steps=3)
            states.append((engine.full_state_dict(), losses))
        out["same"][name] = states
    out["parity"] = run_cases(rank, world_size, PARITY)
    return out


@pytest.fixture(scope="module")
def public_runs() -> list[dict]:
    return spawn(run_public, 2, timeout=900)


def test_every_accepted_public_config_trains_on_two_ranks(public_runs):
    trained = public_runs[0]["losses"]
    expected = {path.name for path in ACCEPTED if world_for(raw_of(path)) == 2 and path not in SPLIT_BY_PLAN}
    assert set(trained) == expected and len(expected) >= 20
    for name, losses in trained.items():
        assert losses and all(torch.isfinite(torch.tensor(losses))), name


def test_a_config_that_needs_one_rank_trains_on_one(one_process):
    (path,) = [path for path in ACCEPTED if world_for(raw_of(path)) == 1]
    engine, losses = train(tiny(), raw_of(path), rank=0)
    assert engine.world_size == 1 and all(torch.isfinite(torch.tensor(losses)))


def test_auto_sizes_without_a_hidden_size_train_with_zerokits_defaults(public_runs):
    bucket_bytes, prefetch, losses = public_runs[0]["plain"]
    assert (bucket_bytes, prefetch) == (DEFAULT_BUCKET_BYTES, 50_000_000) and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("name", SAME_NUMBERS)
def test_a_speed_only_knob_trains_the_same_numbers_either_way(public_runs, name):
    for rank_out in public_runs:
        (without, losses_without), (with_knob, losses_with) = rank_out["same"][name]
        assert losses_without == losses_with
        assert without.keys() == with_knob.keys()
        assert all(torch.equal(without[key], with_knob[key]) for key in without), name


def test_stage3_reduces_during_backward_with_overlap_comm_false(public_runs):
    """DeepSpeed's stage 3 reduces each bucket in backward whatever overlap_comm says; holding every unit's
    gradient until backward ends would give up what stage 3 saves."""
    out = public_runs[0]["parity"]["stage3-adamw-block-no-overlap"]
    assert out["buckets"] > 1 and min(out["launched_in_backward"]) >= 1


@pytest.mark.parametrize("case", PARITY, ids=lambda case: case.name)
def test_block_built_optimizer_and_accepted_knobs_match_one_process(public_runs, case):
    """fp32, so within test_parity.py's tolerance (a few ulps: the ranks add in another order)."""
    expected = run_reference(case, 2)
    for rank, out in enumerate(public_runs):
        got = out["parity"][case.name]
        expected_losses = [loss for _, r, loss in expected["losses"] if r == rank]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(got["params"], expected["params"], rtol=0, atol=2e-5)
    assert fp32_state(make_model(case)).keys() == expected["params"].keys()
