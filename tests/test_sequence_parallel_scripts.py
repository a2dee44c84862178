"""A DeepSpeed ALST script (tests/scripts/ds_alst.py, written as DeepSpeed's tutorial writes one) runs on zerokit with
only its import lines changed, on 4 gloo ranks (2 sequence ranks x 2 replicas) under torchrun, at ZeRO 1 and 3
(DeepSpeed's native path refuses nothing here; its ZeRO 1-2 applies twice the true gradient: See
docs/sequence_parallel.md), and trains as one process does on the whole sequences. (ZeRO 2 with sequence ranks is
checked against one process in tests/test_sequence_parallel.py; its run of this script, and accelerate's sp loop at
ZeRO 2 beside its ZeRO 3, left the launch on 2026-11-29 for the suite's time: 2 of its 5 jobs.)

UlyssesSPDataLoaderAdapter gives each rank, at micro-step k, its shard of the sample that sequence rank k % 2 of its
replica read as its batch k // 2; the reference trains one process on those whole samples, every replica's loss
its mean over the targets, their mean the step's loss. Tolerances as tests/test_sequence_parallel.py's: losses rtol
1e-5, the pre-clip gradient norm rtol 1e-4.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from test_deepspeed_scripts import SCRIPTS, switch_imports
from zerokit.testing.jobs import Job, Outcomes, launch

sys.path.insert(0, str(SCRIPTS))
import alst_common  # noqa: E402

RANKS, STAGES = 4, (1, 3)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, Outcomes]:
    root = tmp_path_factory.mktemp("alst")
    switched = root / "ds_alst.py"
    switched.write_text(switch_imports((SCRIPTS / "ds_alst.py").read_text()))
    jobs = [Job(f"stage{stage}", [str(switched), "--stage", str(stage), "--out", str(root / f"stage{stage}")],
                preload=("zerokit.deepspeed", "transformers")) for stage in STAGES]
    jobs += [Job(f"accelerate{stage}", [str(SCRIPTS / "accelerate_sp.py"), "--stage", str(stage), "--out",
                                        str(root / f"accelerate{stage}")], install=True,
                 preload=("accelerate", "transformers")) for stage in (3,)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    return root, launch(jobs, root / "jobs", ranks=RANKS, env=env)


@functools.lru_cache(maxsize=None)
def one_process() -> dict[str, list[float]]:
    model = alst_common.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sequence, replicas = alst_common.SEQUENCE_PARALLEL, RANKS // alst_common.SEQUENCE_PARALLEL
    losses, norms = [], []
    for step in range(alst_common.SAMPLES_PER_RANK * sequence):
        replica_losses = []
        for replica in range(replicas):
            row = alst_common.rank_samples(replica * sequence + step % sequence)[step // sequence]
            batch = alst_common.collate([(row,)])
            logits = model(input_ids=batch["input_ids"]).logits
            targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
            replica_losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                    targets.reshape(-1), ignore_index=-100))
        torch.stack(replica_losses).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in replica_losses])
    return {"losses": losses, "norms": norms}


@pytest.fixture(scope="module")
def trainer_launched(tmp_path_factory) -> tuple[Path, Outcomes]:
    """The HF Trainer's sequence parallelism on 2 ranks (its loss's all_gather has a backward gloo runs only over a
    group that holds rank 0: See trainer_sp.py)."""
    root = tmp_path_factory.mktemp("trainer_sp")
    jobs = [Job(f"trainer{stage}", [str(SCRIPTS / "trainer_sp.py"), "--stage", str(stage), "--out",
                                    str(root / f"trainer{stage}")], install=True,
                preload=("accelerate", "transformers")) for stage in (1, 3)]
    jobs.append(Job("trainer_cp3", [str(SCRIPTS / "trainer_sp.py"), "--stage", "3", "--out", str(root / "trainer_cp3"),
                                    "--context-parallel"], install=True, preload=("accelerate", "transformers")))
    jobs.append(Job("accelerate_cp1", [str(SCRIPTS / "accelerate_cp.py"), "--stage", "1", "--out",
                                       str(root / "accelerate_cp1")], install=True,
                    preload=("accelerate", "transformers")))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    return root, launch(jobs, root / "jobs", ranks=alst_common.SEQUENCE_PARALLEL, env=env)


@functools.lru_cache(maxsize=None)
def one_process_on_rows(order: tuple[int, ...]) -> dict[str, list[float]]:
    """One process stepping on alst_common.accelerate_rows() in this order, one row a step."""
    model = alst_common.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, norms = [], []
    rows = alst_common.accelerate_rows()
    for row in rows[list(order)]:
        batch = alst_common.collate([(row,)])
        logits = model(input_ids=batch["input_ids"]).logits
        targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def test_only_import_lines_change() -> None:
    original = (SCRIPTS / "ds_alst.py").read_text().splitlines()
    switched = switch_imports((SCRIPTS / "ds_alst.py").read_text()).splitlines()
    changed = [(a, b) for a, b in zip(original, switched, strict=True) if a != b]
    assert len(changed) == 4 and all("zerokit.deepspeed" in b for _, b in changed)


@pytest.mark.parametrize("stage", STAGES)
def test_the_alst_script_trains_as_one_process(launched, stage: int) -> None:
    root, outcomes = launched
    outcomes.check(f"stage{stage}")
    expected = one_process()
    for rank in range(RANKS):
        got = json.loads((root / f"stage{stage}" / f"rank{rank}.json").read_text())
        replica = rank // alst_common.SEQUENCE_PARALLEL
        torch.testing.assert_close(torch.tensor(got["losses"]),
                                   torch.tensor([losses[replica] for losses in expected["losses"]]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(expected["norms"]), rtol=1e-4, atol=0)


@pytest.mark.parametrize("stage", (3,))
def test_accelerates_sequence_parallelism_trains_on_zerokit_as_one_process(launched, stage: int) -> None:
    """accelerate's ParallelismConfig(sp_size=2, sp_backend="deepspeed"), unchanged, under zerokit.deepspeed.install."""
    root, outcomes = launched
    outcomes.check(f"accelerate{stage}")
    # accelerate hands every rank the whole loader under DeepSpeed's sequence parallelism (measured: 8 batches of one
    # row a rank), and the adapter makes each batch 2 micro-steps of the same row: every row twice, in order
    expected = one_process_on_rows(tuple(row for row in range(8) for _ in range(alst_common.SEQUENCE_PARALLEL)))
    for rank in range(RANKS):
        got = json.loads((root / f"accelerate{stage}" / f"rank{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", (1, 3))
def test_the_hf_trainers_sequence_parallelism_trains_on_zerokit_as_one_process(trainer_launched, stage: int) -> None:
    """TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"), deepspeed=...),
    unchanged, under zerokit.deepspeed.install; its logged grad_norm is the true one at ZeRO-1 too."""
    root, outcomes = trainer_launched
    outcomes.check(f"trainer{stage}")
    for rank in range(alst_common.SEQUENCE_PARALLEL):
        got = json.loads((root / f"trainer{stage}" / f"rank{rank}.json").read_text())
        # the Trainer deals the rows to its 2 ranks in turn, and the adapter takes rank 0's, then rank 1's: in order
        expected = one_process_on_rows(tuple(range(6)))
        assert len(got["losses"]) == 6
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(expected["norms"]), rtol=1e-4, atol=0)


def test_the_hf_trainers_context_parallelism_trains_on_zerokit_as_one_process(trainer_launched) -> None:
    """TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2), deepspeed=...) under
    zerokit.deepspeed.install: Ulysses in place of torch's ring attention (See zerokit/integrations/accelerate_cp.py).
    The Trainer counts the step's targets before it cuts the rows, so the masked prompt (fewer targets in the first
    piece) still gives one process's token mean."""
    root, outcomes = trainer_launched
    outcomes.check("trainer_cp3")
    expected = one_process_on_rows(tuple(range(6)))  # both ranks read every row, each its half
    for rank in range(alst_common.SEQUENCE_PARALLEL):
        got = json.loads((root / "trainer_cp3" / f"rank{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(expected["norms"]), rtol=1e-4, atol=0)


def rows_read(root: Path, ranks: int) -> list[list[int]]:
    """Which of alst_common.accelerate_rows() each replica read at each step, from the pieces its 2 cp ranks held
    (each rank's piece must sit at its place: rank 2r + q holds tokens [8q, 8q + 8) of the row)."""
    rows = alst_common.accelerate_rows().tolist()
    got = [json.loads((root / f"rank{rank}.json").read_text())["pieces"] for rank in range(ranks)]
    read = []
    for replica in range(ranks // alst_common.SEQUENCE_PARALLEL):
        first, second = got[2 * replica], got[2 * replica + 1]
        for a, b in zip(first, second):
            assert a["positions"] + b["positions"] == list(range(alst_common.SEQ_LENGTH))
        read.append([rows.index(a["tokens"] + b["tokens"]) for a, b in zip(first, second)])
    return read


@functools.lru_cache(maxsize=None)
def one_process_on_pieces(read: tuple[tuple[int, ...], ...]) -> list[float]:
    """accelerate_cp.py's loss on one process: each replica's row whole through the model, its loss the mean of its two
    pieces' token means (the model's own loss on each rank), the step's the mean over replicas; clipping at 1.0."""
    model = alst_common.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rows, half, losses = alst_common.accelerate_rows(), alst_common.SEQ_LENGTH // 2, []
    for step in range(len(read[0])):
        replica_losses = []
        for replica_rows in read:
            batch = alst_common.whole_row_batch([(rows[replica_rows[step]],)])
            logits = model(input_ids=batch["input_ids"]).logits[0]
            targets = batch["shift_labels"][0]
            pieces = [torch.nn.functional.cross_entropy(logits[part], targets[part], ignore_index=-100)
                      for part in (slice(0, half), slice(half, None))]
            replica_losses.append(torch.stack(pieces).mean())
        loss = torch.stack(replica_losses).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_accelerates_context_parallelism_trains_on_zerokit_as_one_process(trainer_launched) -> None:
    """accelerate's own context-parallel loop (ParallelismConfig(cp_size=2), maybe_context_parallel, `outputs.loss`)
    with a DeepSpeed plugin, on 2 ranks under zerokit.deepspeed.install: both ranks of the cp group read the same row,
    each its contiguous half (accelerate's DeepSpeed loader alone deals each rank its own row: rank 0 rows 0, 2, ...,
    rank 1 rows 1, 3, ...), and the losses are one process's on the whole rows."""
    root, outcomes = trainer_launched
    outcomes.check("accelerate_cp1")
    ranks = alst_common.SEQUENCE_PARALLEL
    read = rows_read(root / "accelerate_cp1", ranks)
    assert read == [list(range(8))]
    expected = one_process_on_pieces(tuple(map(tuple, read)))
    for rank in range(ranks):
        got = json.loads((root / "accelerate_cp1" / f"rank{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
