"""Scripts that end as most scripts end must not abort a rank at exit, and Engine.close() releases what the engine
holds outside itself (See [Note: leaving at exit] in zerokit/comm/process.py).

The endings run as real process exits, 4 two-rank runs of each ending at each stage, half of them through
zerokit.deepspeed (tests/scripts/exit_endings.py forks both ranks of every run from one process that imported torch
once, so that 16 runs take a quarter of a minute, not two and a half).
An abort at exit is a race, rare on an idle machine; what makes it impossible is that no gloo thread is left when
the interpreter finalizes, and every run checks that too, so a few runs of each ending fail as surely as many would
(25 of each until 2026-11-27, 8 until 2026-11-29: the suite's time went to runs that checked the same thing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerokit
import zerokit.deepspeed
from zerokit.testing.parity import offload_dir
from zerokit.testing.spawn import spawn

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from common import SEQUENCE, VOCAB, build_model  # noqa: E402
from exit_endings import STAGE3_UNITS, gloo_threads, threads_now  # noqa: E402

RUNS = 4  # of each ending at each stage


@pytest.fixture(scope="module")
def endings(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every rank of RUNS runs of each ending at each stage, from one process (one start-up of torch and zerokit)."""
    out = tmp_path_factory.mktemp("endings") / "endings.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "exit_endings.py"), "--stage", "2", "3", "--ending", "destroy",
                           "none", "--runs", str(RUNS), "--out", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())["ranks"]


@pytest.mark.parametrize("stage", (2, 3))
@pytest.mark.parametrize("ending", ("destroy", "none"))
def test_common_endings_never_abort_and_leave_no_gloo_thread(endings, stage, ending) -> None:
    ranks = [rank for rank in endings if (rank["stage"], rank["ending"]) == (stage, ending)]
    assert len(ranks) == 2 * RUNS
    assert {rank["api"] for rank in ranks} == {"zerokit", "deepspeed"}
    failed = [rank for rank in ranks if rank.get("exit_status") != 0]
    assert not failed, (f"{len(failed)} of {len(ranks)} ranks did not exit cleanly, the first "
                        f"{ {k: v for k, v in failed[0].items() if k != 'stderr'} }:\n{failed[0]['stderr']}")
    left = [rank for rank in ranks if rank["gloo_threads_at_exit"] != 0]
    assert not left, (f"{len(left)} of {len(ranks)} ranks still had gloo threads when the interpreter began to "
                      f"finalize (run {left[0]['run']}, rank {left[0]['rank']}: {left[0]['gloo_threads_at_exit']})")


# --- Engine.close(), on 2 ranks (one spawn) -----------------------------------------------------------------

def _hooks_on(model: torch.nn.Module) -> int:
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return modules + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQUENCE + 1), generator=torch.Generator().manual_seed(0))


def _refusals(engine) -> list[str]:
    messages = []
    for call in (lambda: engine(_tokens()), lambda: engine.backward(torch.ones((), requires_grad=True)),
                 engine.step, lambda: engine.comm.all_reduce(torch.ones(1))):
        try:
            call()
            messages.append("accepted")
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def _close_cases(rank: int, world_size: int, root: str) -> dict:
    """Per case: what the engine held before close(), and what is left after it (and after a second close())."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it (deepspeed.initialize asks for it)
    dist.barrier()
    default_groups = threads_now()  # the default group's threads among them, named yet or not
    observed = {}
    for stage in (2, 3):
        zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": root}}
        if stage == 3:
            zero.update(STAGE3_UNITS, offload_param={"device": "nvme", "nvme_path": root})
        model = build_model()
        engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                    {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero})
        engine.backward(engine(_tokens()))
        engine.step()
        engine.save_checkpoint(Path(root) / f"checkpoint{stage}", async_save=True)  # its own group, its writer
        swaps = [str(swap.path) for swap in engine.stage.swap_directories()]
        before = {"hooks": _hooks_on(model), "gloo_threads": gloo_threads(besides=default_groups),
                  "swap_folders": sum(Path(path).is_dir() for path in swaps)}
        engine.close()
        engine.close()  # a no-op
        observed[f"stage{stage}"] = {
            "before": before, "hooks": _hooks_on(model),
            "gloo_threads": gloo_threads(settle=2.0, besides=default_groups),
            "swap_folders": sum(Path(path).is_dir() for path in swaps), "refusals": _refusals(engine),
            "groups_let_go": [c.group is None for c in (engine.comm, engine.stage.groups.gather)],
            "saved": (Path(root) / f"checkpoint{stage}" / "latest").exists()}
    engine, *_ = zerokit.deepspeed.initialize(model=build_model(), config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    threads = gloo_threads(besides=default_groups)
    engine.destroy()
    observed["deepspeed"] = {"before": {"gloo_threads": threads},
                             "gloo_threads": gloo_threads(settle=2.0, besides=default_groups),
                             "closed": engine.closed, "live": engine in zerokit.deepspeed.engine.live_engines()}
    observed["default_group_kept"] = dist.is_initialized()
    return observed


@pytest.fixture(scope="module")
def closed() -> list[dict]:
    root = tempfile.mkdtemp(prefix="zerokit-close-", dir=offload_dir())  # swap files and checkpoints
    try:
        yield spawn(_close_cases, 2, root, timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("case", ("stage2", "stage3"))
def test_close_removes_hooks_swap_files_and_the_engines_groups(closed, case) -> None:
    for rank in closed:
        seen = rank[case]
        assert seen["before"]["hooks"] > 0 and seen["hooks"] == 0
        assert seen["before"]["swap_folders"] >= 1 and seen["swap_folders"] == 0
        # the shard group, stage 3's gather group, the checkpoint group: gloo's threads beyond the default group's
        assert seen["before"]["gloo_threads"] > 0 and seen["gloo_threads"] == 0 and seen["groups_let_go"] == [True, True]
        assert seen["saved"]  # the asynchronous save was waited for, not dropped
        assert rank["default_group_kept"]  # the application's group is the application's to destroy


@pytest.mark.parametrize("case", ("stage2", "stage3"))
def test_a_closed_engine_refuses_to_train_with_one_line(closed, case) -> None:
    forward, backward, step, collective = closed[0][case]["refusals"]
    for call, message in (("forward", forward), ("backward", backward), ("step", step)):
        assert message.startswith(f"engine.{call}() after engine.close() (or destroy())") and "\n" not in message
    assert "after its engine was closed" in collective and "\n" not in collective


def test_deepspeed_destroy_is_close(closed) -> None:
    for rank in closed:
        seen = rank["deepspeed"]
        assert seen["before"]["gloo_threads"] > 0 and seen["gloo_threads"] == 0
        assert seen["closed"] and not seen["live"]
