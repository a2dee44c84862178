"""Resume without bookkeeping (issue 33, item 3): the config's `resume` block loads the newest complete checkpoint in
a directory at start-up, with the data position of the loader the engine tracks, so that a resumed run takes exactly
the samples the uninterrupted run would have taken from the saved step on.

tests/scripts/resume_job.py, a drop-in job whose loop keeps no books (no step to start from, no epoch, no load of its
own), is killed by SIGKILL on rank 1 after step 7 under `torchrun --max-restarts 1` (two launches, shared by the first
tests: 16 s together on this 2-core machine when quiet, up to a minute when busy). The rest runs in this process:
which checkpoint is the newest complete one, an empty directory, a checkpoint saved before positions were, and the
sampler's own arithmetic."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerokit
import zerokit.deepspeed as deepspeed
from zerokit.checkpoint.newest import newest_checkpoint
from zerokit.comm.process import configure_logging
from zerokit.checkpoint.sampling import ResumableLoader, ResumableSampler, resumable_loader
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups

SCRIPT = Path(__file__).parent / "scripts" / "resume_job.py"
RESUMED_AT_MICRO_STEP = 8  # the save after step 4, at 2 micro-batches a step


def launch(out: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--max-restarts", "1", str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    return json.loads((out / "result.json").read_text())


def samples(out: Path, rank: int, attempt: int) -> list[tuple[int, int]]:
    """(micro-step, sample) for each sample the rank took, in order."""
    return [tuple(map(int, line.split())) for line in (out / f"samples_rank{rank}_attempt{attempt}.txt").open()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    uninterrupted, killed = tmp_path_factory.mktemp("uninterrupted"), tmp_path_factory.mktemp("killed")
    launch(uninterrupted)
    launch(killed, "--kill-at", "7")
    return {"uninterrupted": uninterrupted, "killed": killed}


def test_a_killed_job_resumes_from_the_newest_checkpoint_and_ends_bit_equal(runs) -> None:
    uninterrupted = json.loads((runs["uninterrupted"] / "result.json").read_text())
    resumed = json.loads((runs["killed"] / "result.json").read_text())
    assert (uninterrupted["attempt"], uninterrupted["resumed_from"]) == (0, 0)  # an empty directory: a fresh start
    assert (resumed["attempt"], resumed["resumed_from"]) == (1, 4)  # the newest save before the kill
    assert resumed["weights"] == uninterrupted["weights"]


@pytest.mark.parametrize("rank", [0, 1])
def test_no_sample_is_seen_twice_or_skipped_after_the_resume(runs, rank) -> None:
    """Counted per rank: 10 steps x 2 micro-batches x 2 samples = 40, over 4 epochs of 12 (the last one partial);
    the resumed attempt starts in the middle of the second epoch and crosses two epoch boundaries."""
    expected = samples(runs["uninterrupted"], rank, 0)
    before = [entry for entry in samples(runs["killed"], rank, 0) if entry[0] < RESUMED_AT_MICRO_STEP]
    after = samples(runs["killed"], rank, 1)
    assert len(expected) == 40 and len(before) == 16 and len(after) == 24
    assert after[0][0] == RESUMED_AT_MICRO_STEP and after == expected[16:]  # none repeated, none missing, in order
    assert before + after == expected
    epochs = [[number for micro, number in expected if micro // 6 == epoch] for epoch in range(3)]
    assert all(len(set(epoch)) == 12 for epoch in epochs)  # this rank's half of the 24, each sample once an epoch
    assert epochs[0] != epochs[1] != epochs[2]  # a new order (and half) each epoch: the resumed epoch was restored


# --- in this process ----------------------------------------------------------------------------------------------

@pytest.fixture
def zerokit_log(caplog):
    """caplog, with the zerokit logger propagating to it (once configured, it writes to stderr alone)."""
    configure_logging()  # which stops propagation the first time: done before it is turned back on
    logger = logging.getLogger("zerokit")
    propagate, logger.propagate = logger.propagate, True
    with caplog.at_level(logging.INFO, logger="zerokit"):
        yield caplog
    logger.propagate = propagate


def make_engine(resume_from: Path | None = None) -> zerokit.Engine:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=1))
    config = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}
    if resume_from is not None:
        config["resume"] = {"load_dir": str(resume_from)}
    return zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2), config)


class Numbered(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((9,), index)


def train(engine: zerokit.Engine, batches) -> list[int]:
    taken = []
    for batch in batches:
        taken += batch[:, 0].tolist()
        engine.backward(lm_loss(engine(batch[:, :-1]), batch))
        engine.step()
    return taken


def test_a_zerokit_loader_tracked_after_the_resume_continues_where_the_save_stood(one_process, tmp_path) -> None:
    engine = make_engine()
    loader = engine.data_position.track(resumable_loader(Numbered(), 2, rank=0, world_size=1))
    batches = iter(loader)
    train(engine, [next(batches) for _ in range(4)])  # 2 steps, 8 of the epoch's 10 samples
    engine.save_checkpoint(tmp_path)
    rest = [number for batch in batches for number in batch[:, 0].tolist()]
    engine.close()
    resumed = make_engine(resume_from=tmp_path)
    assert resumed.progress.optimizer_step == 2
    loader = resumed.data_position.track(resumable_loader(Numbered(), 2, rank=0, world_size=1))
    assert [number for batch in loader for number in batch[:, 0].tolist()] == rest and len(rest) == 2


def test_the_newest_complete_checkpoint_is_never_a_staging_directory_or_one_without_a_manifest(one_process,
                                                                                                 tmp_path) -> None:
    engine = make_engine()
    batches = iter(resumable_loader(Numbered(), 2, rank=0, world_size=1))
    for tag in ("global_step1", "global_step2"):
        train(engine, [next(batches), next(batches)])
        engine.save_checkpoint(tmp_path, tag=tag)
    staging = tmp_path / ".global_step3.partial-0123456789ab"  # a killed save: whole-looking, never moved in place
    staging.mkdir()
    (staging / "manifest.json").write_text((tmp_path / "global_step2" / "manifest.json").read_text())
    (tmp_path / "global_step9").mkdir()  # a rank file, no manifest
    (tmp_path / "global_step9" / "rank00000.safetensors").write_bytes(b"")
    assert newest_checkpoint(tmp_path) == tmp_path / "global_step2"  # what `latest` names
    (tmp_path / "latest").write_text("global_step1")
    assert newest_checkpoint(tmp_path) == tmp_path / "global_step1"  # `latest` names a complete one: it wins
    (tmp_path / "latest").write_text("global_step9")
    assert newest_checkpoint(tmp_path) == tmp_path / "global_step2"  # it names no complete one: the most steps
    (tmp_path / "latest").unlink()
    assert newest_checkpoint(tmp_path) == tmp_path / "global_step2"
    engine.close()
    assert make_engine(resume_from=tmp_path).progress.optimizer_step == 2


def test_an_empty_or_absent_directory_starts_fresh(one_process, tmp_path, zerokit_log, monkeypatch) -> None:
    fresh = make_engine().full_state_dict()
    for directory in (tmp_path, tmp_path / "not-yet"):
        engine = make_engine(resume_from=directory)
        assert engine.progress.optimizer_step == 0
        assert all(torch.equal(value, fresh[name]) for name, value in engine.full_state_dict().items())
        engine.close()
    assert f"resume: no complete checkpoint in {tmp_path}; starting fresh" in zerokit_log.text
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = TinyGPT(TinyGPTConfig(n_layer=1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={"train_micro_batch_size_per_gpu": 2,
                                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert engine.load_checkpoint(tmp_path) == (None, None)  # as DeepSpeed, where there is no `latest`


def test_a_checkpoint_saved_before_data_positions_loads_and_says_so(one_process, tmp_path, zerokit_log) -> None:
    engine = make_engine()
    loader = engine.data_position.track(resumable_loader(Numbered(), 2, rank=0, world_size=1))
    train(engine, list(loader)[:2])
    engine.save_checkpoint(tmp_path)
    saved = engine.full_state_dict()
    engine.close()
    directory = tmp_path / "global_step1"
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest.pop("data_position") == "data_position.pt"  # as zerokit wrote it before: no such key or file
    (directory / "manifest.json").write_text(json.dumps(manifest))
    (directory / "data_position.pt").unlink()
    resumed = make_engine(resume_from=tmp_path)
    assert all(torch.equal(value, saved[name]) for name, value in resumed.full_state_dict().items())
    loader = resumed.data_position.track(resumable_loader(Numbered(), 2, rank=0, world_size=1))
    assert len([number for batch in loader for number in batch[:, 0].tolist()]) == 10  # where the script starts it
    assert "the data position was not in the checkpoint" in zerokit_log.text


# --- the sampler ----------------------------------------------------------------------------------------------------

def numbers(batches) -> list[int]:
    return [number for batch in batches for number in batch[:, 0].tolist()]


def test_a_loader_with_workers_counts_what_it_handed_out_not_what_they_prefetched() -> None:
    def loader() -> ResumableLoader:
        return resumable_loader(Numbered(), 2, rank=1, world_size=2, num_workers=2, prefetch_factor=2, seed=5)

    whole, first = numbers(loader()), loader()
    batches = iter(first)
    taken = numbers([next(batches), next(batches)])
    state = first.state_dict()
    assert state["taken"] == 4  # the workers had drawn more of this rank's 5 samples by then
    second = loader()
    second.load_state_dict(state)
    assert taken + numbers(second) == whole and numbers(second) == whole  # the pass after starts from the beginning


def test_the_sampler_keeps_its_order_and_position_across_epochs_and_rank_counts() -> None:
    plain = torch.utils.data.DistributedSampler(Numbered(), num_replicas=2, rank=0, seed=3)
    sampler = ResumableSampler(Numbered(), num_replicas=2, rank=0, seed=3)
    assert list(sampler) == list(plain)  # DeepSpeed's order
    sampler.set_epoch(1)
    order = iter(sampler)
    next(order), next(order)
    state = sampler.state_dict()
    assert (state["epoch"], state["taken"]) == (1, 2)
    again = ResumableSampler(Numbered(), num_replicas=2, rank=0, seed=3)
    again.load_state_dict(state)
    again.set_epoch(1)  # the epoch it stands in: the position stays
    plain.set_epoch(1)
    assert list(again) == list(plain)[2:] and list(again) == list(plain)
    ranks = [ResumableSampler(Numbered(), num_replicas=3, rank=rank, seed=3) for rank in range(3)]
    for resumed in ranks:
        resumed.load_state_dict(state)  # 2 ranks x 2 taken = 4 of the permutation consumed: each of 3 starts at 1
    permutation = torch.randperm(10, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    padded = permutation + permutation[:2]  # 3 ranks: 12 positions
    for rank, resumed in enumerate(ranks):  # from position 3 on: nothing skipped, one sample (position 3) again
        assert list(resumed) == padded[3 + rank::3]
    with pytest.raises(ValueError, match="saved with seed 3 \\(now 4\\)"):
        ResumableSampler(Numbered(), num_replicas=2, rank=0, seed=4).load_state_dict(state)
