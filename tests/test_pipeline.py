"""zerokit.pipeline: torch's pipeline schedules across stages, a zerokit engine over each stage's data group, against
one process on the union of every replica's micro-batches (See [Note: what the pipeline reference computes] in
zerokit/testing/pipeline.py)."""

from __future__ import annotations

import math

import pytest
import torch

from zerokit.parallel.mesh import Layout
from zerokit.pipeline import BubbleWarning
from zerokit.pipeline.checks import schedule_class_of, warn_about_the_bubble
from zerokit.testing.pipeline import (TENSOR_SPLIT_CASES, PipeCase, mlp_layers, reference,
                                      run_cases_refusals_and_resume, run_pipeline_cases)
from zerokit.testing.spawn import spawn

# fp32: the same sums in another order, so rounding (rtol 1e-5); atol 1e-6 for weights near zero, whose Adam steps
# differ by ~1e-8 (See optimizer_for).
FP32 = {"rtol": 1e-5, "atol": 1e-6}

TWO_BY_TWO = [
    PipeCase("gpipe-zero0", stage=0, schedule="GPipe"),
    PipeCase("1f1b-zero1", stage=1),
    PipeCase("gpipe-zero2", stage=2, schedule="GPipe"),
    PipeCase("1f1b-zero3", stage=3),
    PipeCase("gpipe-zero3-gather-per-micro-batch", stage=3, schedule="GPipe", gathering="micro_batch"),
    PipeCase("1f1b-zero2-bf16", stage=2, dtype="bf16"),
    PipeCase("1f1b-zero1-fp16-overflow-on-one-rank", stage=1, dtype="fp16", overflow_at=(1, 0), steps=2),
]


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> list[dict]:
    """One spawn of 4 ranks (2 stages x 2 replicas) runs every case."""
    directory = str(tmp_path_factory.mktemp("pipeline-checkpoint"))
    return spawn(run_cases_refusals_and_resume, 4, TWO_BY_TWO, directory, timeout=400)


def _check_exact(case: PipeCase, ranks: list[dict], replicas: int, tolerance: dict) -> None:
    expected = reference(case, replicas)
    for rank, result in enumerate(ranks):
        got = result[case.name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]),
                                   rtol=tolerance["rtol"], atol=0, msg=lambda m: f"rank {rank} losses: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"], dtype=torch.float64),
                                   torch.tensor(expected["norms"], dtype=torch.float64),
                                   rtol=tolerance["rtol"], atol=0, msg=lambda m: f"rank {rank} norms: {m}")
        for name, value in got["weights"].items():
            torch.testing.assert_close(value, expected["weights"][name], **tolerance,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("name", [c.name for c in TWO_BY_TWO if c.dtype == "fp32"])
def test_a_pipeline_of_zero_stages_equals_one_process(two_by_two, name) -> None:
    """2 stages x 2 replicas, 4 micro-batches a step (accumulation), clipping on every step: losses, the global norm
    and every stage's final weights equal one process's."""
    _check_exact(next(c for c in TWO_BY_TWO if c.name == name), two_by_two, 2, FP32)


def test_bf16_stays_within_what_bf16_rounding_explains(two_by_two) -> None:
    """bf16 compute (fp32 masters) against the fp32 reference: the losses to bf16's resolution of the logits (2^-8
    relative, averaged over 256 tokens: measured 1.6e-4), the norm to 1%, and the weights within 2 x lr x steps:
    Adam moves a weight by at most ~lr a step, and a bf16 gradient whose sign differs from fp32's (the tiny ones)
    moves it the other way (measured: 0.0077 after 3 steps at lr 1e-2)."""
    case = next(c for c in TWO_BY_TWO if c.dtype == "bf16")
    expected = reference(case, 2)
    for result in two_by_two:
        got = result[case.name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-3, atol=0)
        torch.testing.assert_close(torch.tensor(got["norms"], dtype=torch.float64),
                                   torch.tensor(expected["norms"], dtype=torch.float64),
                                   rtol=1e-2, atol=0)
        bound = 2 * 1e-2 * case.steps
        worst = max((value - expected["weights"][name]).abs().max().item() for name, value in got["weights"].items())
        assert worst < bound, f"bf16 weights differ by {worst:g} (bound {bound:g})"


def test_an_overflow_on_one_stage_and_replica_skips_the_step_on_every_rank(two_by_two) -> None:
    """fp16: an inf in stage 1's gradients on replica 0 only; every rank of both stages sees a nan norm and skips
    step 0, then all step 1 with one norm."""
    case = next(c for c in TWO_BY_TWO if c.overflow_at)
    results = [r[case.name] for r in two_by_two]
    assert all(r["skipped"] == [True, False] for r in results)
    assert all(math.isnan(r["norms"][0]) for r in results)
    assert len({r["norms"][1] for r in results}) == 1 and math.isfinite(results[0]["norms"][1])
    assert len({tuple(r["scales"]) for r in results}) == 1


@pytest.mark.parametrize("name", ["gpipe-zero0", "1f1b-zero1", "gpipe-zero2"])
def test_stages_0_to_2_reduce_gradients_once_per_optimizer_step(two_by_two, name) -> None:
    """4 micro-batches a step, yet each bucket is all-reduced once a step (gloo keeps the shard of an all-reduce): on
    the data group, beside one scalar for the norm (stages 1-2) and, on the last stage, one for the reported loss."""
    case = next(c for c in TWO_BY_TWO if c.name == name)
    for rank, result in enumerate(two_by_two):
        got = result[case.name]
        norm = 1 if case.stage else 0
        loss = 1 if got["stage"] == case.stages - 1 else 0
        assert got["comm"]["all_reduce"]["calls"] == case.steps * (got["buckets"] + norm + loss), rank


def test_stage3_gathers_once_per_step_or_per_micro_batch_as_set(two_by_two) -> None:
    """"step" keeps a stage's units gathered through the step's micro-batches; "micro_batch" gathers each for every
    micro-batch's forward and again for its backward: many times the gathers, for the memory of one unit."""
    for result in two_by_two:
        once = result["1f1b-zero3"]["comm"]["all_gather"]["calls"]
        again = result["gpipe-zero3-gather-per-micro-batch"]["comm"]["all_gather"]["calls"]
        assert once <= 2 * result["1f1b-zero3"]["buckets"] * 3  # at most the step's gather and the update's
        assert again >= 4 * once


def test_three_stages_on_one_replica_equal_one_process() -> None:
    """3 stages (two layers each) on 3 ranks, ZeRO-1 over a data group of one: only the pipeline distributes."""
    case = PipeCase("3x1-1f1b-zero1", stage=1, stages=3, micro_batches=3, steps=2)
    _check_exact(case, spawn(run_pipeline_cases, 3, [case], timeout=300), 1, FP32)


def test_two_stages_of_three_replicas_equal_one_process() -> None:
    """2 stages x 3 replicas on 6 ranks, ZeRO-3: shards of 3, whose sizes do not divide evenly."""
    case = PipeCase("2x3-1f1b-zero3", stage=3, steps=2)
    _check_exact(case, spawn(run_pipeline_cases, 6, [case], timeout=400), 3, FP32)


def test_a_stage_that_does_not_accept_the_previous_ones_output_is_refused_on_every_rank(two_by_two) -> None:
    messages = {result["refused_shapes"] for result in two_by_two}
    assert len(messages) == 1
    message = messages.pop()
    assert message.startswith("pipeline stage 1 does not accept stage 0's output of shape(s) [(2, 8, 24)]: ")
    assert "\n" not in message


NOT_TWO_EQUAL = ("a pipeline step's inputs (first stage) hold {} rows on a replica, which do not split into "
                 "gradient_accumulation_steps=2 equal micro-batches: pass a multiple of 2 rows per replica, or set "
                 "train_micro_batch_size_per_gpu")


def test_a_batch_that_does_not_split_as_configured_is_refused_on_every_rank(two_by_two) -> None:
    """2 micro-batches of 2 rows: 12 rows (torch would train 2 micro-batches of 6), 10 (the last stage failed with
    torch's batch-size mismatch while the others hung) and a wrong batch on one replica only are refused on all four
    ranks in one line, nothing trained, and a right batch trains after them (issue 44)."""
    outcomes = [result["refused_batches"]["config"] for result in two_by_two]
    for rows, given in ((12, 12), (10, 10), ("one replica", 6)):
        assert {outcome[rows] for outcome in outcomes} == {
            f"a pipeline step's inputs (first stage) hold {given} rows on a replica, but the config makes each step "
            "gradient_accumulation_steps=2 micro-batches of train_micro_batch_size_per_gpu=2 rows: pass 4 rows per "
            "replica"}, rows
    assert {outcome[9] for outcome in outcomes} == {NOT_TWO_EQUAL.format(9)}
    assert all(outcome["unchanged"] for outcome in outcomes)
    assert len({outcome[4] for outcome in outcomes}) == 1 and outcomes[0][4].startswith("trained ")


def test_the_deepspeed_drop_in_takes_its_micro_batches_from_the_batch_as_deepspeed_does(two_by_two) -> None:
    """micro_batch_from="batch" (the drop-in's train_batch, which concatenates the micro-batches its iterator
    yields): the first step's batch decides the micro-batch (10 rows: 2 of 5, whatever the config's 2), as DeepSpeed
    trains what its iterator gives; replicas of different sizes, a later step of another size (torch's stages keep
    their first step's shapes: it hung before) and 9 rows, which no 2 equal micro-batches make, are refused."""
    outcomes = [result["refused_batches"]["batch"] for result in two_by_two]
    assert {outcome["one replica"] for outcome in outcomes} == {
        "a pipeline step's inputs (first stage) hold 6 rows on a replica, but another replica passes 4 rows (every "
        "replica's micro-batches are one size): pass 4 rows per replica"}
    assert all(outcome[rows].startswith("trained ") for outcome in outcomes for rows in (10, "10 again"))
    assert {outcome[12] for outcome in outcomes} == {
        "a pipeline step's inputs (first stage) hold 12 rows on a replica, but this pipeline's first step ran "
        "gradient_accumulation_steps=2 micro-batches of 5 rows, and torch's pipeline stages keep the shapes of their "
        "first step: pass 10 rows per replica"}
    assert {outcome[9] for outcome in outcomes} == {NOT_TWO_EQUAL.format(9)}


def test_fewer_micro_batches_than_stages_warns_naming_the_bubble() -> None:
    with pytest.warns(BubbleWarning, match=r"^2 micro-batch\(es\) per step on 4 pipeline stages: the bubble is 60% "):
        warn_about_the_bubble(2, 4)


def test_what_a_pipeline_cannot_be_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^6 ranks do not split into 4 pipeline stage\(s\)"):
        Layout.resolve(6, pipeline=4)
    with pytest.raises(ValueError, match=r"^the pipeline schedule 'ScheduleInterleavedZeroBubble' is not supported "
                                         r"with zerokit engines; accepted: GPipe, 1F1B"):
        from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
        schedule_class_of(ScheduleInterleavedZeroBubble)
    from zerokit.deepspeed.pipe import partition
    with pytest.raises(ValueError, match=r"^3 pipeline stages for 2 layers: every stage needs a layer; accepted: at "
                                         r"most 2 stages$"):
        partition([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], 3, "uniform")


def test_a_pipeline_checkpoint_resumes_exactly(two_by_two) -> None:
    """Every stage saves with its replicas (stage<s>/ under the directory); new engines that load it take the next
    step as the run that went straight on did, bit for bit."""
    for result in two_by_two:
        assert result["resume"]["resumed"] == result["resume"]["straight"][2]


def test_a_pipeline_checkpoint_loads_into_flat_zero_and_back(two_by_two) -> None:
    """The save after step 2 loads into flat ZeRO-3 on the same 4 ranks (the stages' files read as one model), whose
    third step on the same micro-batches reports the straight run's loss; its own save loads into a new 2 x 2
    pipeline, whose fourth step does too: the parameters and Adam's moments crossed both ways. fp32, rtol 1e-5 as
    this file's parity (the flat step adds the gradients in another order; measured: both losses equal; loaded
    without the optimizer states, the fourth loss is 4.6e-3 relative away)."""
    for result in two_by_two:
        resume = result["resume"]
        assert resume["flat"] == pytest.approx(resume["straight"][2], rel=1e-5)
        assert resume["back"] == pytest.approx(resume["straight"][3], rel=1e-5)
    assert two_by_two[0]["resume"]["consolidated"] is True  # `zerokit consolidate` of the stages: what flat loaded


def test_stages_that_name_their_layers_locally_are_refused_into_another_layout(two_by_two) -> None:
    """A Sequential per stage names its first layer "0" on both stages: flat ZeRO cannot tell the layers apart, so
    every rank refuses in one line, naming what to do."""
    for result in two_by_two:
        message = result["locally_named"]
        assert message.startswith("rank ") and "is on stages 0 and 1, and not as a tied weight" in message, message
        assert "\n" not in message


@pytest.mark.parametrize("case", TENSOR_SPLIT_CASES, ids=[case.name for case in TENSOR_SPLIT_CASES])
def test_stages_split_over_a_tensor_group_equal_one_process(two_by_two, case) -> None:
    """2 stages x a tensor group of 2 (the same 4 ranks): each stage's MLP blocks split by torch's parallelize_module
    on the layout's tensor mesh, at ZeRO-1 and ZeRO-3: the losses and global norms of one process, every rank alike
    (fp32, rtol 1e-5 as this file's parity; measured: losses within 6e-8 relative, norms within 1e-8)."""
    expected = reference(case, replicas=1, make_layers=mlp_layers)
    for result in two_by_two:
        got = result["tensor_split"][case.name]
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert got["norms"] == pytest.approx(expected["norms"], rel=1e-5)


def test_stages_cut_by_torchs_tracer_train_as_stages_cut_by_hand() -> None:
    """torch's pipeline() tracer's stage modules (a GraphModule each) under zerokit engines: the same losses as the
    same layers cut by hand, on 2 ranks."""
    from zerokit.testing.pipeline import traced_and_hand_split
    for result in spawn(traced_and_hand_split, 2, timeout=200):
        assert result["traced"] == result["hand"]
