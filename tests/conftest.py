"""Multi-rank runs are expensive (a spawn costs seconds on 2 cores), so each world size is spawned
once per session and every parity case for it runs inside that one spawn."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch.distributed as dist

from zerokit.testing.parity import Case, run_cases
from zerokit.testing.spawn import spawn

WORLD_SIZES = (1, 2, 3, 5)
SCRIPTS = Path(__file__).parent / "scripts"


def deepspeed_script(name: str, needs: str, why: str) -> ModuleType:
    """The launch script tests/scripts/`name`.py, or the test skipped, saying `why`, where DeepSpeed's module
    `needs` is not installed (the tests that run real DeepSpeed)."""
    if importlib.util.find_spec(needs) is None:
        pytest.skip(f"deepspeed is not installed: {why}")
    sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


@pytest.fixture
def one_process():
    """A test that initializes in this process (world size 1) gets a fresh process group, and leaves none."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def cases_for(world_size: int) -> list[Case]:
    """The matrix: every stage x {fp32, bf16}, plus fp16 with loss scaling, gradient accumulation
    (both stage-2 policies), SGD with momentum, Adam, activation checkpointing and an fp16 run that
    starts with an overflowing loss scale. World size 3 (shards of uneven size) and one process run all of it;
    5 ranks (on 2 cores) the core; 2 ranks the core and what is exact there alone: 16 bits without clipping, and
    Muon (See [Note: the sweep's world sizes]). Stages 1-3 reduce buckets as zerokit does by default on gloo
    (all-reduce, keep the shard), and the "-reduce-scatter" cases as it does on NCCL."""
    base = [Case(f"stage{s}-{d}", stage=s, dtype=d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")] + [
        Case(f"stage{s}-{d}-reduce-scatter", stage=s, dtype=d, reduce_scatter=True)
        for s in (1, 2, 3) for d in ("fp32", "bf16")]
    if world_size == 5:
        return base
    exact_steps = [Case(f"stage{s}-{d}-{name}", stage=s, dtype=d, **options)
                   for s in (0, 1, 2, 3) for d in ("fp32", "bf16") for name, options in EXACT_STEP_CASES]
    offloaded = [Case(f"stage{s}-{d}-{name}", stage=s, dtype=d, **options)
                 for s in (1, 2, 3) for d in ("fp32", "bf16") for name, options in OFFLOAD_CASES
                 if s == 3 or "offload_param" not in options]  # parameters are sharded at stage 3 only
    # Without clipping, 1 or 2 ranks add and halve exactly what one process does: bit-exact even at 16 bits.
    exact = [Case(f"stage{s}-{d}-noclip", stage=s, dtype=d, clip=0.0) for s in (0, 1, 2, 3) for d in ("bf16", "fp16")]
    if world_size == 2:
        return base + exact + [case for case in exact_steps if "muon" in case.optimizer]
    return base + (exact if world_size == 1 else []) + [
        *[Case(f"stage{s}-fp16-accum2", stage=s, dtype="fp16", accumulation=2) for s in (0, 1, 2)],
        Case("stage0-fp32-accum3", stage=0, accumulation=3),
        Case("stage1-fp32-accum3", stage=1, accumulation=3),
        Case("stage2-fp32-accum2-every-micro-step", stage=2, accumulation=2),
        Case("stage2-fp32-accum2-at-boundary", stage=2, accumulation=2, reduce_every_micro_step=False),
        Case("stage1-bf16-sgd", stage=1, dtype="bf16", optimizer="sgd"),
        Case("stage2-fp32-sgd-noclip", stage=2, optimizer="sgd", clip=0.0),
        Case("stage2-fp32-adam-checkpointed", stage=2, optimizer="adam", checkpoint=True),
        Case("stage1-fp16-overflowing-scale", stage=1, dtype="fp16", initial_scale_power=19, steps=6),
        Case("stage2-fp32-one-bucket", stage=2, bucket_bytes=2**30),
        # Masters stepped in pieces that cut through parameters and shards (prime size on purpose).
        *[Case(f"stage{s}-{d}-sub-groups", stage=s, dtype=d, bucket_bytes=2**20, sub_group_size=997)
          for s, d in ((0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16"))],
        *STAGE3_EXTRAS,
        *exact_steps,
        *offloaded,
    ]


# Every optimizer step is the one a single process takes (issue 9): a layer no rank runs on even steps and rank 0
# alone runs on odd ones (also across an accumulation window that uses it once); MoE experts idle everywhere or on
# rank 0 only (kept inside the root unit at stage 3: a unit that some ranks skip is another matter); optimizers
# that need whole tensors (Muon beside AdamW, Adafactor); SGD with momentum, whose buffer an unused layer must keep.
EXACT_STEP_CASES = [
    ("idle-branch", {"usage": "idle-or-rank0"}),
    ("idle-branch-accum2", {"usage": "idle-or-rank0", "accumulation": 2}),
    ("moe-idle-experts", {"model": "moe", "usage": "idle-or-rank0", "min_unit_params": 10**6}),
    ("muon-adamw", {"optimizer": "muon+adamw", "usage": "idle-or-rank0"}),
    ("adafactor", {"optimizer": "adafactor", "usage": "idle-or-rank0"}),
    ("sgd-momentum-idle-branch", {"optimizer": "sgd", "usage": "idle-or-rank0", "clip": 0.0}),
]


# Offload tiers (issue 10): every combination the config allows, at stages 1-3 (parameters: stage 3 only). On this
# CPU-only machine the "device" is the CPU, but the tiers still keep their own copies and move every gradient in
# and every update out, as on a GPU.
OFFLOAD_CASES = [
    ("offload-cpu", {"offload_optimizer": "cpu", "usage": "idle-or-rank0"}),
    ("offload-cpu-ratio", {"offload_optimizer": "cpu", "offload_ratio": 0.5, "accumulation": 2}),
    ("offload-cpu-muon", {"offload_optimizer": "cpu", "optimizer": "muon+adamw"}),
    ("offload-params-cpu", {"offload_param": "cpu", "freeze_norms": True}),
    ("offload-params-and-optimizer-cpu", {"offload_param": "cpu", "offload_optimizer": "cpu", "accumulation": 2}),
    ("offload-nvme", {"offload_optimizer": "nvme", "usage": "idle-or-rank0", "accumulation": 2}),
    ("offload-nvme-adafactor", {"offload_optimizer": "nvme", "optimizer": "adafactor", "usage": "idle-or-rank0"}),
    ("offload-params-nvme", {"offload_param": "nvme", "freeze_norms": True, "offload_max_in_cpu": 0}),
    # a host cache of 3000 elements: some shards in host memory, the rest read from the file
    ("offload-params-and-optimizer-nvme", {"offload_param": "nvme", "offload_optimizer": "nvme", "accumulation": 2,
                                           "offload_max_in_cpu": 3000}),
    ("offload-activations-units-checkpointed", {"offload_param": "cpu", "checkpoint_units": True,
                                                "cpu_checkpointing": True}),
]


# Stage 3 with what its gather/free hooks must survive. The limit case: root (2.6k, and its 0.6k frozen
# layer) + two 7.2k blocks fit under 18.1k elements, a third gathered block would not; four blocks make
# prefetch want one.
STAGE3_EXTRAS = [
    # Prefetch follows last step's order; when the order changes, the wrong guess costs a gather, not
    # correctness: the unit that runs is gathered when it is needed.
    Case("stage3-fp32-order-changes", stage=3, n_layer=3, reverse_on_odd_steps=True),
    Case("stage3-bf16-order-changes-checkpointed", stage=3, dtype="bf16", n_layer=3, reverse_on_odd_steps=True,
         checkpoint=True),
    Case("stage3-fp16-accum2", stage=3, dtype="fp16", accumulation=2),
    Case("stage3-fp32-accum2", stage=3, accumulation=2),
    Case("stage3-bf16-checkpointed", stage=3, dtype="bf16", checkpoint=True),
    Case("stage3-fp32-block-called-twice", stage=3, reuse_first_block=True),
    # Frozen parameters are sharded by unit too (See [Note: frozen parameters at stage 3]): a LoRA-like
    # run whose blocks' matrices are frozen, built eagerly or on the meta device; frozen LayerNorms, whose
    # backward in a block comes after every trainable gradient of it; blocks with no trainable parameter.
    Case("stage3-fp32-norms-only-finetune", stage=3, freeze_matrices=True, min_unit_params=100),
    Case("stage3-bf16-norms-only-finetune", stage=3, dtype="bf16", freeze_matrices=True, min_unit_params=100),
    Case("stage3-fp32-norms-only-finetune-built-on-meta", stage=3, meta=True, freeze_matrices=True,
         min_unit_params=100),
    Case("stage3-fp32-frozen-norms", stage=3, freeze_norms=True),
    Case("stage3-fp32-frozen-block", stage=3, frozen_blocks=(1,)),
    Case("stage3-bf16-frozen-block-checkpointed", stage=3, dtype="bf16", frozen_blocks=(0,), checkpoint=True),
    Case("stage3-fp32-nested-frozen-norms", stage=3, freeze_norms=True, unit_classes=("Block", "CausalSelfAttention")),
    Case("stage3-fp32-persistent-small-units", stage=3, persistence_threshold=8000, n_layer=3),
    Case("stage3-fp32-built-on-meta", stage=3, meta=True),
    Case("stage3-bf16-built-on-meta", stage=3, dtype="bf16", meta=True),
    Case("stage3-fp32-live-limit", stage=3, n_layer=4, max_live_parameters=18_100),
    Case("stage3-sgd-no-prefetch-room", stage=3, optimizer="sgd", clip=0.0, n_layer=4, max_live_parameters=17_700),
    *[Case(f"stage3-{m}-{d}", stage=3, dtype=d, model=m, min_unit_params=100)
      for m in ("hf-gpt2", "hf-llama") for d in ("fp32", "bf16")],
    # Nested units (See [Note: nested units]): the attention is a unit inside each Block unit.
    *[Case(f"stage3-{d}-nested-units", stage=3, dtype=d, unit_classes=("Block", "CausalSelfAttention"))
      for d in ("fp32", "bf16")],
    Case("stage3-bf16-nested-checkpointed-accum2", stage=3, dtype="bf16", checkpoint=True, accumulation=2,
         unit_classes=("Block", "CausalSelfAttention")),
    # ln_1 runs first in its Block, so the Block's own gradients are all in before ln_1's backward starts:
    # the Block is freed for good while an inner unit still has its backward to run.
    Case("stage3-fp32-nested-inner-runs-first", stage=3, unit_classes=("Block", "LayerNorm")),
    # Root 2.6k + its frozen 0.6k + Block 4.8k + its attention 2.4k + the other Block 4.8k = 15.3k: the
    # nested limit, just met.
    Case("stage3-fp32-nested-live-limit", stage=3, unit_classes=("Block", "CausalSelfAttention"),
         max_live_parameters=15_350),
    # Units given as module instances (resolved on each rank): one nested, and an MLP whose Block is no unit.
    Case("stage3-fp32-units-by-instance", stage=3, unit_modules=("blocks.0", "blocks.0.attn", "blocks.1.mlp")),
]


# [Note: the sweep's world sizes]
# Every case of the matrix runs on 3 ranks, which split the model into shards of uneven size and add the ranks'
# gradients in another order than one process does, and in one process, where offload tiers and ZeRO-Offload on one
# device are real uses. 2 ranks run the core (every stage, dtype and reduction) and what is exact on 2 ranks only:
# bit-equal 16-bit training without clipping, and Muon's bf16 Newton-Schulz (See tests/test_parity.py). Until
# 2026-11-29 they ran the whole matrix too: 154 cases, 43 s of the suite's, each a feature 3 ranks already check
# with shards that do not divide evenly.


@functools.lru_cache(maxsize=None)
def _runs(world_size: int) -> list[dict]:
    return spawn(run_cases, world_size, cases_for(world_size))


@pytest.fixture(scope="session")
def parity_runs():
    """parity_runs(world_size) -> one result dict per rank, keyed by case name."""
    return _runs


# --- how the suite is shared between workers (issue 42) ------------------------------------------------------------
# [Note: the suite on two workers]
# `make test` runs pytest with two xdist workers (`-n 2`), one per core of the 2-core machine it is budgeted on. Each
# test module is one unit of work, given whole to one worker, so its module-scoped fixtures (a module's shared launch
# or spawn) run once; the modules that compare with the parity sweep are one unit, so the sweep (a session fixture)
# runs on one worker only. Units start longest first by the recorded durations (tests/durations.json), so that the
# last unit to start is a short one. (xdist's own `--dist loadgroup` cannot do this under pytest 9, which no longer
# reads the test id xdist rewrites.) Beside the other worker a test has about one core: its seconds grow, the run's
# fall (docs/testing.md, "The suite's time").
RECORDED_DURATIONS = Path(__file__).parent / "durations.json"
PARITY_GROUP = {"test_accounting", "test_parity", "test_exact_steps", "test_offload"}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or "parity" for the modules that share the sweep."""
    module = Path(nodeid.partition("::")[0]).stem
    return "parity" if module in PARITY_GROUP else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    recorded = json.loads(RECORDED_DURATIONS.read_text()) if RECORDED_DURATIONS.exists() else {}
    weight: dict[str, float] = {}
    for item in items:
        group = unit_of(item.nodeid)
        weight[group] = weight.get(group, 0.0) + recorded.get(item.nodeid, 0.0)
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-weight[unit_of(item.nodeid)], order[id(item)]))


# `make test-fast` (`-m fast`): one case of each capability, for the loop of development; CI runs everything. Each is
# chosen among its module's cheap cases (no module-wide launch or sweep behind it where the module allows).
FAST = (
    "tests/test_parity.py::test_matches_single_process[N1-stage3-bf16]",  # the N=1 sweep: every stage's path
    "tests/test_two_engines.py::",  # stages 2 and 3 on 2 ranks against one process
    "tests/test_stage3_access.py::",
    "tests/test_checkpoint.py::test_optimizer_hyperparameters_scheduler_and_counters_come_back",
    "tests/test_resume.py::test_a_killed_job_resumes_from_the_newest_checkpoint_and_ends_bit_equal",
    "tests/test_pipeline.py::test_three_stages_on_one_replica_equal_one_process",
    "tests/test_hybrid.py::test_settings_resolve_the_groups",
    "tests/test_parallel_layout.py::",
    "tests/test_offload_budget.py::",
    "tests/test_reliability.py::test_ranks_that_disagree_are_named_at_initialize[stage-stage2-3]",
    "tests/test_deepspeed_api.py::test_initialize_returns_deepspeeds_four_and_the_engine_answers_as_deepspeed",
    "tests/test_hf_trainer.py::test_the_trainer_trains_as_ddp_does[2]",
    "tests/test_restart.py::test_a_script_that_starts_the_group_itself_is_told_the_setting",
    "tests/test_exit.py::test_close_removes_hooks_swap_files_and_the_engines_groups",
    "tests/test_config.py::", "tests/test_dsconfig.py::", "tests/test_code_shape.py::test_no_import_circle",
    "tests/test_suite_budget.py::", "tests/planner/test_planner_memory.py::", "tests/planner/test_planner_advice.py::",
)


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.nodeid.startswith(FAST):
        item.add_marker(pytest.mark.fast)


if importlib.util.find_spec("xdist") is not None:  # the test extra installs it; a plain pytest needs no scheduler
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        """xdist's scope scheduling, with `unit_of` as the scope, in the collection's (longest first) order."""

        def __init__(self, config: pytest.Config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling | None:
        return ModuleUnits(config, log) if config.getvalue("dist") != "each" else None


class DurationRecorder:
    """Each test's seconds (setup, call and teardown added), written to `path` at the end of the session:
    `ZEROKIT_RECORD_DURATIONS=tests/durations.json make test` records the file the budget check reads."""

    def __init__(self, path: Path) -> None:
        self.path, self.seconds = path, {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        self.path.write_text(json.dumps({k: round(v, 2) for k, v in sorted(self.seconds.items())}, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get("ZEROKIT_RECORD_DURATIONS")
    if path and not hasattr(config, "workerinput"):  # the controller, which sees every worker's reports
        config.pluginmanager.register(DurationRecorder(Path(path)), "zerokit-durations")
