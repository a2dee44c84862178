"""The plan against real runs on 2 gloo ranks (one spawn serves every case): model states after backward
and after the step to the byte, every collective kind exactly, at every stage and precision, with gloo's
all-reduce and with a forced reduce-scatter; then a recorded run of a small Llama (a model nothing was
tuned on) checked by `plan_report`: activations and the allocator's peak within 10%."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import zerokit  # noqa: E402
from zerokit.planner.engine_model import EngineSetup, engine_comm, engine_states  # noqa: E402
from zerokit.profiling.inventory import param_inventory  # noqa: E402
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

WORLD = 2
CASES = [(stage, dtype, rs) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16") for rs in (None, True)
         if not (stage == 0 and rs)]
LLAMA = dict(vocab_size=1000, hidden_size=96, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _exact_case(rank: int, stage: int, dtype: str, reduce_scatter: bool | None, model: str) -> dict:
    torch.manual_seed(0)
    if model == "tiny":
        net, unit = TinyGPT(TinyGPTConfig(with_test_features=False, n_layer=3)), {"stage3_unit_classes": ["Block"]}
        # buffers of two dtypes: broadcast_buffers sends one broadcast per dtype a step
        net.blocks[0].register_buffer("scale", torch.ones(5))
        net.blocks[1].register_buffer("counter", torch.zeros(3, dtype=torch.int64), persistent=False)
        batch = lambda: torch.randint(0, 67, (2, 17), generator=generator)  # noqa: E731
        loss_of = lambda tokens: lm_loss(engine(tokens[:, :-1]), tokens)  # noqa: E731
    else:  # Hugging Face GPT-2 with the default persistence threshold: its norms and biases join the root
        net = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(
            vocab_size=300, n_positions=32, n_embd=64, n_layer=2, n_head=2))
        unit = {"stage3_min_unit_params": 1000}
        batch = lambda: torch.randint(0, 300, (2, 16), generator=generator)  # noqa: E731
        loss_of = lambda tokens: engine(input_ids=tokens, labels=tokens).loss  # noqa: E731
    optimizer = torch.optim.AdamW(param_groups(net))
    zero = {"stage": stage, "reduce_bucket_bytes": 40_000, "reduce_scatter": reduce_scatter, **(unit if stage == 3 else {})}
    engine = zerokit.initialize(net, optimizer, {"zero_optimization": zero, "bf16": {"enabled": dtype == "bf16"}})
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the second step: the optimizer's state exists
        before = engine.comm_stats()
        engine.backward(loss_of(batch()))
        after_backward = engine.memory_stats()
        engine.step()
    after = engine.comm_stats()
    return {"after_backward": after_backward, "after_step": engine.memory_stats(),
            "comm": {k: {key: after[k][key] - before[k][key] for key in after[k]} for k in after
                     if after[k]["calls"] != before[k]["calls"]},
            "inventory": param_inventory(net, optimizer, engine.config.stage3),
            "setup": {"precision": dtype, "reduce_scatter": engine.config.reduce_scatter,
                      "bucket_bytes": engine.config.reduce_bucket_bytes,
                      "persistence_threshold": engine.config.stage3.persistence_threshold}}


def _recorded_llama(rank: int) -> dict:
    from dataclasses import asdict

    from zerokit.profiling.record import record_run

    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    optimizer = torch.optim.AdamW(param_groups(net))
    engine = zerokit.initialize(net, optimizer, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    generator = torch.Generator().manual_seed(rank)
    batches = iter(lambda: torch.randint(0, LLAMA["vocab_size"], (4, 128), generator=generator), None)
    record = record_run(engine, batches, lambda e, tokens: e(input_ids=tokens, labels=tokens).loss,
                        optimizer=optimizer, micro_batch=4, seq_len=128, warmup=1, steps=1)
    return asdict(record)


def _recorded_sequence_llama(rank: int) -> dict:
    """The recorded Llama at ZeRO-3 with its sequences split over both ranks (Ulysses): each rank runs its half of
    every sequence, attention for half of the heads over the whole of it."""
    from dataclasses import asdict

    from zerokit.profiling.record import record_run

    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    optimizer = torch.optim.AdamW(param_groups(net))
    engine = zerokit.initialize(net, optimizer, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                                 "sequence_parallel_size": WORLD})
    generator = torch.Generator().manual_seed(0)  # one replica: both ranks read the same sequences
    batches = iter(lambda: torch.randint(0, LLAMA["vocab_size"], (4, 128), generator=generator), None)

    def loss(e, tokens):
        shard = e.sequence.shard({"input_ids": tokens, "labels": tokens})
        logits = e(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        return e.sequence.loss(logits, shard["shift_labels"])

    record = record_run(engine, batches, loss, optimizer=optimizer, micro_batch=4, seq_len=128, warmup=1, steps=1)
    return asdict(record)


def _all_runs(rank: int, world: int) -> dict:
    runs = {case: _exact_case(rank, *case, "tiny") for case in CASES}
    runs[(3, "bf16", None, "hf")] = _exact_case(rank, 3, "bf16", None, "hf")
    runs["record"] = _recorded_llama(rank)
    runs["sequence record"] = _recorded_sequence_llama(rank)
    return runs


@functools.lru_cache(maxsize=None)
def runs() -> dict:
    return spawn(_all_runs, WORLD)[0]


def _setup(run: dict, stage: int) -> EngineSetup:
    return EngineSetup(stage=stage, world=WORLD, backend="gloo", **run["setup"])


@pytest.mark.parametrize("stage,dtype,reduce_scatter", CASES)
def test_model_states_and_collectives_are_exact_on_gloo(stage, dtype, reduce_scatter):
    run = runs()[(stage, dtype, reduce_scatter)]
    setup = _setup(run, stage)
    states = engine_states(run["inventory"], setup)
    assert states.after_backward == run["after_backward"]
    assert states.after_step == run["after_step"]
    assert engine_comm(run["inventory"], setup) == run["comm"]
    kinds = set(run["comm"])
    if stage >= 1:  # gloo all-reduces each bucket in place unless a reduce-scatter is forced
        assert ("reduce_scatter" in kinds) == bool(reduce_scatter)


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_one_process_calls_the_collectives_the_plan_counts(one_process, stage):
    """One rank (a plain `python train.py`, or one GPU) still calls its collectives, each a local copy, but
    broadcasts no buffer: the plan counted none at all before."""
    run = _exact_case(0, stage, "bf16", None, "tiny")
    setup = EngineSetup(stage=stage, world=1, backend="gloo", **run["setup"])
    assert engine_comm(run["inventory"], setup) == run["comm"]
    assert "broadcast" not in run["comm"] and run["comm"]["all_reduce"]["calls"] >= 1
    assert engine_states(run["inventory"], setup).after_step == run["after_step"]


def test_small_parameters_join_the_root_unit_at_stage_3():
    run = runs()[(3, "bf16", None, "hf")]
    setup = _setup(run, 3)
    assert any(e.unit == 0 and e.numel < setup.persistence_threshold and ".h." in e.name for e in run["inventory"].entries)
    assert engine_states(run["inventory"], setup).after_backward == run["after_backward"]
    assert engine_comm(run["inventory"], setup) == run["comm"]


@functools.lru_cache(maxsize=None)
def calibrated_llama():
    """The recorded Llama's 2-block copy, calibrated at small shapes."""
    from zerokit.profiling.calibrate import calibrate

    return calibrate(transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        **{**LLAMA, "num_hidden_layers": 2})), precision="bf16", seqs=(32, 64))


def test_plan_report_on_a_recorded_llama():
    """Calibrated on a 2-block copy at small shapes, the plan meets the 4-block run at (4, 128)."""
    from zerokit.planner.calibration import Calibration
    from zerokit.profiling.report import plan_report

    record = runs()["record"]
    calibration = calibrated_llama()
    rows = {row["category"]: row for row in plan_report(record=record, calibration=calibration)}
    for name in ("parameters", "gradients", "optimizer_state", "parameters_after_step", "all_reduce.elements",
                 "all_reduce.bytes", "all_reduce.calls", "all_gather.elements",
                 "broadcast.calls", "broadcast.elements"):  # broadcast: the rotary embedding's inv_freq buffer
        assert rows[name]["error"] == 0, name
    assert rows["broadcast.calls"]["measured_count"] == 1
    assert abs(rows["activations"]["error"]) < 0.10
    assert abs(rows["peak_allocated"]["error"]) < 0.10
    assert rows["peak_total"]["measured_bytes"] > rows["peak_allocated"]["measured_bytes"]
    assert Calibration.from_dict(calibration.as_dict()) == calibration
    # the resident peak: framework + model states + the fixed excess + the step's allocations x (1 + slack)
    resident = replace(calibration, resident_bytes=200 * 2**20, allocator_slack=0.5)
    totals = [{row["category"]: row for row in plan_report(record=record, calibration=replace(
        resident, resident_fixed_bytes=fixed))}["peak_total"]["predicted_bytes"] for fixed in (0, 3 * 2**20)]
    assert totals[1] - totals[0] == 3 * 2**20


def test_plan_report_on_a_recorded_llama_split_over_sequence_ranks():
    """The same Llama at ZeRO-3 with sequence_parallel_size 2: the plan's activations are the whole sequences'
    calibrated ones over the sequence degree (memory.py's / sp), and meet each rank's measured ones, and its peak, within
    10% as the unsplit run's do; the model states to the byte."""
    from zerokit.profiling.report import plan_report

    record = runs()["sequence record"]
    assert record["setup"]["sequence"] == WORLD
    rows = {row["category"]: row for row in plan_report(record=record, calibration=calibrated_llama())}
    for name in ("parameters", "gradients", "optimizer_state", "parameters_after_step"):
        assert rows[name]["error"] == 0, name
    assert abs(rows["activations"]["error"]) < 0.10, rows["activations"]
    assert abs(rows["peak_allocated"]["error"]) < 0.10, rows["peak_allocated"]
    whole = {row["category"]: row for row in plan_report(record=runs()["record"], calibration=calibrated_llama())}
    assert rows["activations"]["measured_bytes"] < 0.6 * whole["activations"]["measured_bytes"]


def test_times_are_read_on_the_line_through_two_timed_copies():
    """A 4-block run from copies of 2 and 3 blocks: fixed + per block x 4, per phase, wall and CPU apart; a
    phase that shrank between the copies (noise) stays at the larger copy's; communication, where the copies
    replayed the run's own collectives, is the fastest replay."""
    from zerokit.planner.calibration import Calibration
    from zerokit.profiling.report import plan_report

    record = runs()["record"]
    assert record["model"]["n_layers"] == 4
    copies = ({"blocks": 2, "seconds": {"forward": 0.5, "backward": 1.0, "step": 0.3, "communication": 0.2},
               "cpu_seconds": {"forward": 0.4, "backward": 0.9, "step": 0.3}},
              {"blocks": 3, "seconds": {"forward": 0.6, "backward": 1.3, "step": 0.25, "communication": 0.3},
               "cpu_seconds": {"forward": 0.5, "backward": 1.1, "step": 0.3}})
    calibration = Calibration.from_dict({**calibrated_llama().as_dict(), "copy_seconds": copies})
    rows = {row["category"]: row for row in plan_report(record=record, calibration=calibration)}
    predicted = {name: rows[name]["predicted_seconds"] for name in rows if "time." in name}
    assert predicted == pytest.approx({"time.forward": 0.7, "time.backward": 1.6, "time.step": 0.25,
                                       "time.communication": 0.4, "cpu_time.forward": 0.6, "cpu_time.backward": 1.3,
                                       "cpu_time.step": 0.3})
    assert rows["time.forward"]["measured_seconds"] == record["measured"]["seconds"]["forward"]
    assert "line through copies of 2 and 3 blocks" in rows["time.forward"]["note"]
    # with the run's own collectives replayed on each copy's ranks, the fastest replay is the prediction
    replayed = tuple({**copy, "seconds": {**copy["seconds"], "run_communication": seconds}}
                     for copy, seconds in zip(copies, (0.21, 0.18)))
    calibration = Calibration.from_dict({**calibration.as_dict(), "copy_seconds": replayed})
    rows = {row["category"]: row for row in plan_report(record=record, calibration=calibration)}
    assert rows["time.communication"]["predicted_seconds"] == 0.18 and rows["time.forward"]["predicted_seconds"] == \
        pytest.approx(0.7)
    assert "replayed" in rows["time.communication"]["note"]


def test_the_resident_excess_is_a_line_through_two_copies():
    from zerokit.profiling.resident import excess_line

    assert excess_line((100, 300), (200, 450)) == (0.5, 150)  # 1.5 bytes per byte of growth, 150 fixed
    # no line that can be (no difference in growth; less than a byte per byte; a negative fixed part): the
    # larger copy alone
    assert excess_line((100, 300), (100, 320)) == pytest.approx((2.2, 0))
    assert excess_line((100, 300), (200, 320)) == pytest.approx((0.6, 0))
    assert excess_line((100, 300), (110, 440)) == pytest.approx((3.0, 0))


def test_check_command_prints_the_run_beside_its_plan(tmp_path, capsys):
    """`zerokit plan --check RUN --calibration FILE --json`: the same rows as plan_report, from the command line."""
    import json
    from dataclasses import asdict

    import zerokit.cli
    from zerokit.profiling.calibrate import calibrate

    run_file, calibration_file = tmp_path / "run.json", tmp_path / "calibration.json"
    run_file.write_text(json.dumps(runs()["record"]))
    calibrate(transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        **{**LLAMA, "num_hidden_layers": 2})), precision="bf16", seqs=(32, 64)).save(calibration_file)
    assert zerokit.cli.main(["plan", "--check", str(run_file), "--calibration", str(calibration_file), "--json"]) == 0
    rows = {row["category"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["optimizer_state"]["error"] == 0 and abs(rows["peak_allocated"]["error"]) < 0.10
    assert set(asdict(zerokit.profiling.record.RunRecord(**runs()["record"]))) >= {"setup", "inventory", "measured"}
    memo = tmp_path / "memo.md"
    assert zerokit.cli.main(["plan", "--check", str(run_file), "--calibration", str(calibration_file),
                             "--memo", str(memo)]) == 0
    assert "peak_total" in capsys.readouterr().out and "## Predicted vs measured" in memo.read_text()


def test_copies_of_the_recorded_run_time_its_phases(tmp_path):
    """calibrate_for_record trains copies of 1 and 3 blocks at the run's stage, world size and shape in fresh
    processes: every phase is timed on both, and the report reads the run's times and resident peak from them."""
    from zerokit.profiling.report import calibrate_for_record, plan_report

    record = runs()["record"]
    calibration = calibrate_for_record(record, layers=1)
    assert [copy["blocks"] for copy in calibration.copy_seconds] == [1, 3]
    for copy in calibration.copy_seconds:
        assert set(copy["seconds"]) == {"forward", "backward", "step", "total", "communication", "run_communication"}
        assert set(copy["cpu_seconds"]) == {"forward", "backward", "step"}
        assert all(seconds > 0 for seconds in [*copy["seconds"].values(), *copy["cpu_seconds"].values()])
    assert calibration.resident_bytes > 50 * 2**20  # Python, torch and transformers, before the model
    rows = {row["category"]: row for row in plan_report(record=record, calibration=calibration)}
    for phase in ("forward", "backward", "step"):
        row = rows[f"time.{phase}"]
        assert row["predicted_seconds"] > 0 and "line through copies of 1 and 3 blocks" in row["note"]
    assert rows["time.communication"]["predicted_seconds"] == min(
        copy["seconds"]["run_communication"] for copy in calibration.copy_seconds)
    assert rows["peak_total"]["predicted_bytes"] > calibration.resident_bytes


def test_copies_group_parameters_as_the_run_does():
    """A copy's optimizer groups are the run's, by parameter name: the recorded Llama decays matrices only."""
    from zerokit.profiling.report import copy_targets
    from zerokit.profiling.resident import _grouped_as_run

    targets = copy_targets(runs()["record"])
    assert targets["replay"] == runs()["record"]["measured"]["comm_per_step"]
    copy = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**LLAMA, "num_hidden_layers": 1}))
    decay, no_decay = _grouped_as_run(copy, targets["groups"])
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(copy.parameters()))


@pytest.mark.parametrize("changes", [{}, {"stage": 3, "persistence_threshold": 1000, "precision": "bf16"},
                                     {"stage": 2, "grad_accum": 4, "reduce_scatter": True, "bucket_bytes": 40_000,
                                      "reduce_every_micro_step": False, "precision": "fp16", "reduce_dtype": "bf16"},
                                     {"stage": 1, "sub_group_size": 4096, "broadcast_buffers": False},
                                     {"stage": 2, "offload_optimizer": "cpu"},
                                     {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                                      "max_in_cpu": 1000}])
def test_a_recorded_setup_gives_back_the_config_it_was_recorded_from(changes):
    """Copies of a recorded run are built with engine_config(setup): every setting the record holds survives."""
    from dataclasses import asdict

    from zerokit.config.typed import from_dict
    from zerokit.profiling.record import engine_config

    setup = asdict(EngineSetup(**{"stage": 0, "world": 2, **changes}))
    config = from_dict(engine_config(setup))
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    assert (config.stage, names[config.precision.param_dtype], names[config.precision.reduce_dtype],
            config.reduce_bucket_bytes, config.gradient_accumulation_steps, config.reduce_scatter,
            config.sub_group_size, config.reduce_every_micro_step, config.broadcast_buffers) == (
        setup["stage"], setup["precision"], setup["reduce_dtype"], setup["bucket_bytes"], setup["grad_accum"],
        setup["reduce_scatter"], setup["sub_group_size"], setup["reduce_every_micro_step"], setup["broadcast_buffers"])
    assert config.stage3.persistence_threshold == setup["persistence_threshold"]
    assert (config.offload_optimizer.device, config.offload_param.device) == (setup["offload_optimizer"],
                                                                              setup["offload_param"])
    if setup["offload_param"] != "none":
        assert config.offload_param.max_in_cpu == setup["max_in_cpu"]


def _offloaded_setup(rank: int, world: int) -> dict:
    from dataclasses import asdict

    from zerokit.profiling.record import engine_setup

    net = TinyGPT(TinyGPTConfig(with_test_features=False))
    engine = zerokit.initialize(net, torch.optim.AdamW(net.parameters()), {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})
    return asdict(engine_setup(engine, "adamw"))


def test_a_record_names_the_run_offload():
    """The plan of a recorded offloaded run prices its offload: engine_setup reads it from the engine."""
    setup = spawn(_offloaded_setup, 1)[0]
    assert (setup["offload_optimizer"], setup["offload_param"]) == ("cpu", "cpu")
