"""accelerate runs zerokit end to end (issue 23): tests/scripts/accelerate_loop.py, an `Accelerator` with a
`DeepSpeedPlugin(hf_ds_config=...)` and an `accumulate()` loop (clipping, a warm-up schedule, a short last
window each epoch), launched with torchrun on 2 gloo ranks through `python -m zerokit.deepspeed.install` at
stages 2 and 3, against the same loop under accelerate's own DDP. Per micro-step losses, and grad norms and
learning rates at each optimizer step, equal DDP's within the tolerance of tests/test_hf_trainer.py (fp32; sums
in another order). `accelerator.save_state()` at the first epoch's end, right after its short window, and `load_state()` in a new launch continue exactly as the
uninterrupted run did (the same engine, world size and data: bit for bit). Also what accelerate needs of the drop-in before any training: `steps_per_print` set to
infinity, and `deepspeed.runtime.*` read as attributes after `import deepspeed` alone."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from test_hf_trainer import SCRIPTS, ZEROKIT_ENGINE, assert_zerokit_trained, environment, job
from zerokit.testing.jobs import launch

sys.path.insert(0, str(SCRIPTS))
import hf_trainer  # noqa: E402

TOLERANCE = 2e-6  # See tests/test_hf_trainer.py
SAVE_AT = 10  # micro-steps: the first epoch's end, right after its short window (issue 31); the resumed run's ends in one

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """accelerate's DDP, then zerokit at stages 2 and 3 (each saving its state after SAVE_AT micro-steps), and each
    stage resumed from that state by a run of its own: five runs, in order, in one torchrun launch (See [Note: jobs
    forked inside one torchrun launch])."""
    root = tmp_path_factory.mktemp("accelerate")
    pretrained = root / "pretrained"
    with torch.random.fork_rng():  # the model's seed, not this process's generator
        hf_trainer.save_pretrained_model(str(pretrained))
    jobs = []
    for name, stage in (("ddp", None), ("zero2", 2), ("zero3", 3), ("zero2_resumed", 2), ("zero3_resumed", 3)):
        args = ["--out", str(root / name), "--pretrained", str(pretrained)]
        if stage is not None:
            args += ["--stage", str(stage)]
            resumed = name.endswith("_resumed")
            args += (["--resume-from", str(root / f"zero{stage}" / "state"), "--resume-at", str(SAVE_AT)] if resumed
                     else ["--save-at", str(SAVE_AT)])
        jobs.append(job(name, "accelerate_loop.py", args, zerokit=stage is not None))  # HF_PRELOAD: accelerate too
    outcomes = launch(jobs, root / "jobs", env=environment())
    out = {}
    for each in jobs:
        outcomes.check(each.name)
        out[each.name] = [json.loads((root / each.name / f"rank{rank}.json").read_text()) for rank in range(2)]
    return out


def relative(expected: list[float], got: list[float]) -> float:
    assert len(expected) == len(got)
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(expected, got))


@pytest.mark.parametrize("stage", [2, 3])
def test_an_accumulate_loop_trains_as_accelerates_ddp(runs: dict[str, list[dict]], stage: int) -> None:
    for rank in range(2):
        ddp, zerokit = runs["ddp"][rank], runs[f"zero{stage}"][rank]
        assert ddp["engine"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        assert len(ddp["losses"]) == 20 and len(ddp["grad_norms"]) == 8  # 2 epochs: windows of 3, 3, 3 and 1
        assert max(ddp["grad_norms"]) > 0.5 and ddp["lrs"][0] == 0.0  # clipping bites; warm-up from 0
        assert_zerokit_trained(zerokit, stage)
        assert zerokit["engine"] == ZEROKIT_ENGINE and zerokit["gradient_clipping"] == 0.5
        for key in ("losses", "grad_norms", "lrs"):
            assert relative(ddp[key], zerokit[key]) <= TOLERANCE, key
        if stage == 3:  # from_pretrained under the plugin's zero.Init loads the file's weights
            assert zerokit["loaded_difference"] == 0.0


@pytest.mark.parametrize("stage", [2, 3])
def test_load_state_resumes_the_uninterrupted_run(runs: dict[str, list[dict]], stage: int) -> None:
    for rank in range(2):
        uninterrupted, resumed = runs[f"zero{stage}"][rank], runs[f"zero{stage}_resumed"][rank]
        assert_zerokit_trained(resumed, stage)
        steps = uninterrupted["saved_after_steps"]
        assert steps == 4 and len(resumed["losses"]) == len(uninterrupted["losses"]) - SAVE_AT == 10
        assert resumed["losses"] == uninterrupted["losses"][SAVE_AT:]
        assert resumed["grad_norms"] == uninterrupted["grad_norms"][steps:]
        assert resumed["lrs"] == uninterrupted["lrs"][steps:]


def test_steps_per_print_infinity_means_never() -> None:
    """accelerate's DeepSpeedPlugin writes float("inf") to silence DeepSpeed's step lines."""
    from zerokit.config.typed import load_config

    config = {"train_micro_batch_size_per_gpu": 1}
    assert load_config({**config, "steps_per_print": math.inf}).steps_per_print is None
    for bad in (-math.inf, math.nan, 2.5):
        with pytest.raises(ValueError, match="must be a whole number"):
            load_config({**config, "steps_per_print": bad})


def test_deepspeed_runtime_is_an_attribute_after_import_deepspeed() -> None:
    """accelerate reads deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES with no import of its own, as DeepSpeed's
    `import deepspeed` imports its runtime and ops."""
    code = ("import zerokit.deepspeed; zerokit.deepspeed.install()\nimport deepspeed\n"
            "print(deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES[2], deepspeed.ops.adam.__name__,\n"
            "      deepspeed.runtime.zero.partition_parameters.__name__, deepspeed.checkpoint.utils.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["WarmupLR", "zerokit.deepspeed.ops.adam",
                                   "zerokit.deepspeed.runtime.zero.partition_parameters",
                                   "zerokit.deepspeed.checkpoint.utils"]
