"""DeepSpeed training scripts (tests/scripts/ds_*.py, written against `import deepspeed`) run on zerokit with
only their import lines changed, on 2 gloo ranks under torchrun, and give exactly the losses of the same loop
written against zerokit's own API. Where DeepSpeed is installed, the unchanged scripts run under DeepSpeed too
and must resolve the same batch sizes, stage, precision and learning rate at every step (and, for the fp32
ZeRO-2 script, the same losses)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import zerokit
from zerokit.testing.jobs import Job, Outcomes, launch
from zerokit.testing.spawn import spawn

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from common import build_model, dataset  # noqa: E402

IMPORT = re.compile(r"^(import deepspeed(\.[\w.]+)?( as \w+)?|from deepspeed(\.[\w.]+)? import .+)$")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def switch_imports(source: str) -> str:
    """The script with `deepspeed` replaced by `zerokit.deepspeed` in its import lines, and nothing else."""
    lines = []
    for line in source.splitlines():
        if IMPORT.match(line):
            if line == "import deepspeed":
                line = "import zerokit.deepspeed as deepspeed"
            else:
                line = line.replace("deepspeed", "zerokit.deepspeed", 1)
        lines.append(line)
    return "\n".join(lines) + "\n"


def results(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(2)]


# --- the same loops against zerokit's own API (one spawn for all three) ----------------------------------

def script_config() -> dict:
    """ds_zero_init.py's CONFIG dict, read from its source (importing the script would import deepspeed)."""
    tree = ast.parse((SCRIPTS / "ds_zero_init.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CONFIG")
    return ast.literal_eval(node.value)


def _loader(engine: zerokit.Engine, rank: int, world_size: int) -> DataLoader:
    data = dataset()
    return DataLoader(data, batch_size=engine.config.train_micro_batch_size_per_gpu,
                      sampler=DistributedSampler(data, num_replicas=world_size, rank=rank))


def _train(engine: zerokit.Engine, rank: int, world_size: int, schedule=None) -> tuple[list[float], list[float]]:
    losses, lrs = [], []
    for (tokens,) in _loader(engine, rank, world_size):
        loss = engine(tokens)
        engine.backward(loss)
        if engine.step().stepped and schedule is not None:
            schedule.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    return losses, lrs


def reference_loops(rank: int, world_size: int) -> dict[str, dict]:
    out = {}
    model = build_model()
    engine = zerokit.initialize(model, config=str(SCRIPTS / "configs" / "ds_train.json"),
                                model_parameters=[p for p in model.parameters() if p.requires_grad])
    out["train"] = dict(zip(("losses", "lrs"), _train(engine, rank, world_size)))

    model = build_model()
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0),
                                str(SCRIPTS / "configs" / "ds_compile.json"))
    engine.module.compile(backend="inductor")
    schedule = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (1 + step))
    out["compile"] = dict(zip(("losses", "lrs"), _train(engine, rank, world_size, schedule)))

    with torch.device("meta"):
        model = build_model()
    engine = zerokit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), script_config())
    schedule = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5)
    losses, lrs = _train(engine, rank, world_size, schedule)
    bias = engine.module.head.bias
    with engine.unsharded([bias], write_back=True):
        head_bias_sum = bias.sum().item()
        with torch.no_grad():
            bias.zero_()
    with engine.unsharded([bias]):
        zeroed = bias.abs().sum().item()
    out["zero_init"] = {"losses": losses, "lrs": lrs, "head_bias_sum": head_bias_sum, "zeroed": zeroed}
    return out


# --- the runs ------------------------------------------------------------------------------------------

RUNS = {  # script -> its command-line arguments, given the output directory
    "train": ("ds_train.py", lambda out: ["--deepspeed", "--deepspeed_config", str(SCRIPTS / "configs" / "ds_train.json"),
                                          "--out", str(out), "--checkpoint", str(out / "checkpoint")]),
    "compile": ("ds_compile.py", lambda out: [str(SCRIPTS / "configs" / "ds_compile.json"), str(out)]),
    "zero_init": ("ds_zero_init.py", lambda out: [str(out)]),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, Outcomes]:
    """Each script with its import lines switched, then (where DeepSpeed is installed) the unchanged train and
    zero_init scripts under DeepSpeed: one torchrun launch (See [Note: jobs forked inside one torchrun launch])."""
    root = tmp_path_factory.mktemp("scripts")
    jobs = []
    for name, (script, arguments) in RUNS.items():
        switched = root / script
        switched.write_text(switch_imports((SCRIPTS / script).read_text()))
        jobs.append(Job(name, [str(switched), *arguments(root / name)], preload=("zerokit.deepspeed",)))
    for name in ("train", "zero_init") if HAS_DEEPSPEED else ():
        script, arguments = RUNS[name]
        jobs.append(Job(f"deepspeed_{name}", [str(SCRIPTS / script), *arguments(root / f"deepspeed_{name}")],
                        preload=("zerokit.testing.deepspeed_peer",)))  # See its Note: no shm op built
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return root, launch(jobs, root / "jobs", env=env)


@pytest.fixture(scope="module")
def zerokit_runs(launched) -> dict[str, list[dict]]:
    root, outcomes = launched
    runs = {}
    for name in RUNS:
        outcomes.check(name)
        runs[name] = results(root / name)
    runs["checkpoint"] = sorted(path.name for path in (root / "train" / "checkpoint").iterdir())
    return runs


@pytest.fixture(scope="module")
def references() -> list[dict[str, dict]]:
    return spawn(reference_loops, 2)


def test_only_import_lines_change() -> None:
    for script, _ in RUNS.values():
        original = (SCRIPTS / script).read_text().splitlines()
        switched = switch_imports((SCRIPTS / script).read_text()).splitlines()
        changed = [(a, b) for a, b in zip(original, switched, strict=True) if a != b]
        assert changed and all(IMPORT.match(a) and b.startswith(("import zerokit.deepspeed", "from zerokit.deepspeed"))
                               for a, b in changed)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_script_matches_the_zerokit_loop(zerokit_runs, references, name: str) -> None:
    for rank in range(2):
        ours, reference = zerokit_runs[name][rank], references[rank][name]
        assert ours["losses"] == reference["losses"]  # the same engine underneath: bit-identical
        assert ours["lrs"] == pytest.approx(reference["lrs"], rel=1e-12)
        for key in set(reference) - {"losses", "lrs"}:
            assert ours[key] == pytest.approx(reference[key], rel=1e-6), key


def test_what_the_scripts_asked_about(zerokit_runs) -> None:
    train, compiled, zero_init = (zerokit_runs[name] for name in ("train", "compile", "zero_init"))
    for rank in range(2):
        assert train[rank]["local_rank"] == train[rank]["args_local_rank"] == train[rank]["env_local_rank"] == rank
        assert train[rank]["boundaries"] == [False, True] * 3  # between the last backward and its step()
        assert train[rank]["batches"] == 6  # 48 samples, 2 ranks, micro-batch 4: the loader shards the data
        assert train[rank]["averaged"] == pytest.approx(
            [(a + b) / 2 for a, b in zip(train[0]["losses"], train[1]["losses"])], rel=1e-6)
        assert compiled[rank]["compiled"] and compiled[rank]["bf16"] and not compiled[rank]["fp16"]
        assert zero_init[rank]["zeroed"] == 0.0 and zero_init[rank]["global_steps"] == 4
    assert train[0]["losses"] != train[1]["losses"]  # each rank saw its own share
    assert "latest" in zerokit_runs["checkpoint"]


RESOLVED = ("train_batch_size", "micro_batch", "accumulation", "stage", "fp16", "bf16", "world_size", "global_steps")


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (the bench extra)")
@pytest.mark.parametrize("name", ["train", "zero_init"])
def test_deepspeed_runs_the_same_script_with_the_same_settings(zerokit_runs, launched, name: str) -> None:
    root, outcomes = launched
    outcomes.check(f"deepspeed_{name}")
    for ours, theirs in zip(zerokit_runs[name], results(root / f"deepspeed_{name}")):
        assert {key: ours[key] for key in RESOLVED if key in ours} == {key: theirs[key] for key in RESOLVED if key in theirs}
        assert ours["lrs"] == pytest.approx(theirs["lrs"], rel=1e-12, abs=1e-15)
        if name == "train":  # fp32 ZeRO-2, same data order, same clipping: DeepSpeed's losses too
            assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
            assert ours["boundaries"] == theirs["boundaries"] and ours["batches"] == theirs["batches"]
