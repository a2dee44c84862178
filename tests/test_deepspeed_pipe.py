"""A DeepSpeed pipeline script (tests/scripts/ds_pipe.py: LayerSpecs, a TiedLayerSpec embedding/head pair,
PipelineModule, train_batch, eval_batch) under real DeepSpeed at ZeRO-1 and, with its import lines switched, under
zerokit at ZeRO-1, 2 and 3, on 4 ranks (2 stages x 2 replicas): the same losses."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerokit.testing.spawn import spawn

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(Path(__file__).parent))
from test_deepspeed_scripts import switch_imports  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEPS = 3


EXIT_ABORT = "terminate called without an active exception"


def _launch(script: Path, args: list[str], ranks: int, out: Path, timeout: int = 400) -> None:
    """torchrun on this machine, as a user would start the script (through zerokit.testing.deepspeed_peer, which runs
    it unchanged without building DeepSpeed's shared-memory op: See its Note). The peer's run may abort at exit after
    every rank wrote its result: torch's race between gloo's worker and the interpreter's finalization (See [Note:
    leaving at exit] in zerokit/comm/process.py), which zerokit's own exit avoids and DeepSpeed's does not (once in the
    suite's runs here); its results stand, any other failure fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "zerokit.testing.deepspeed_peer", str(script), *args, "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    finished = len(list(out.glob("rank*.json"))) == ranks
    aborted_at_exit = EXIT_ABORT in done.stderr + done.stdout and finished
    assert done.returncode == 0 or aborted_at_exit, done.stdout[-3000:] + done.stderr[-6000:]


def _config(directory: Path, stage: int, accumulation: int = 4) -> Path:
    """fp32, clipping small enough to clip every step, AdamW from the config block. "torch_adam": DeepSpeed steps
    torch's AdamW, the optimizer zerokit steps, rather than its FusedAdam, a C++ op that a CPU build compiles at
    first use (45 s of this machine's two cores, paid by every fresh run of the suite)."""
    path = directory / f"zero{stage}-gas{accumulation}.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation, "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-5,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 1000}))
    return path


def _script_runs(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> dict[str, str]:
    """The switched script's main() once per run, on these ranks (torchrun's variables set as it sets them); each
    run's outcome: "ok", or the error it raised."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    sys.path.insert(0, str(SCRIPTS))
    namespace = {"__name__": "ds_pipe_on_zerokit"}
    exec(compile(switch_imports((SCRIPTS / "ds_pipe.py").read_text()), "ds_pipe.py", "exec"), namespace)
    outcomes = {}
    for name, argv in runs:
        sys.argv = ["ds_pipe.py", *argv]
        try:
            namespace["main"]()
            outcomes[name] = "ok"
        except ValueError as error:
            outcomes[name] = str(error)
    return outcomes


def _losses(directory: Path) -> list[list[float]]:
    return [json.loads(path.read_text())["losses"] + [json.loads(path.read_text())["eval"]]
            for path in sorted(directory.glob("rank*.json"))]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed to compare with")
def test_a_deepspeed_pipeline_script_trains_on_zerokit_at_every_stage_as_deepspeed_at_zero1(tmp_path) -> None:
    common = ["--steps", str(STEPS), "--partition", "uniform", "--seed_layers"]
    _launch(SCRIPTS / "ds_pipe.py", ["--deepspeed_config", str(_config(tmp_path, 1)), "--tied", *common], ranks=4,
            out=tmp_path / "deepspeed")
    runs = [(f"zero{stage}{'-tied' if tied else ''}",
             ["--deepspeed_config", str(_config(tmp_path, stage)), *(["--tied"] if tied else []), *common,
              "--out", str(tmp_path / f"zero{stage}{'-tied' if tied else ''}")])
            for stage, tied in ((1, True), (2, True), (3, True), (3, False))]
    outcomes = spawn(_script_runs, 4, runs, timeout=400)
    alone = spawn(_script_runs, 1, [("alone", ["--deepspeed_config", str(_config(tmp_path, 0, accumulation=8)),
                                              "--stages", "1", *common, "--out", str(tmp_path / "alone")])],
                  timeout=200)
    assert alone == [{"alone": "ok"}]
    expected = _losses(tmp_path / "deepspeed")
    assert len(expected) == 4 and all(losses == expected[0] for losses in expected)  # every stage reports it
    for name in ("zero1-tied", "zero2-tied"):
        assert all(outcome[name] == "ok" for outcome in outcomes)
        for losses in _losses(tmp_path / name):
            assert losses == pytest.approx(expected[0], rel=1e-5), name
    # ZeRO-3 with the tied pair on two stages: refused on every rank in one line; untied, it equals one process
    refused = {outcome["zero3-tied"] for outcome in outcomes}
    assert len(refused) == 1 and refused.pop().startswith("weights tied across pipeline stages (embed) are not "
                                                          "supported at ZeRO-3")
    reference = _losses(tmp_path / "alone")[0]
    for losses in _losses(tmp_path / "zero3"):
        assert losses == pytest.approx(reference, rel=1e-5)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed to compare with")
def test_layers_are_cut_into_stages_as_deepspeed_cuts_them() -> None:
    """partition_method 'parameters' and 'type:' (partition_balanced) and 'uniform': DeepSpeed's own arithmetic."""
    import random

    from deepspeed.runtime import utils as ds_utils

    from zerokit.deepspeed.pipe import partition_balanced, partition_uniform
    generator = random.Random(0)
    for _ in range(200):
        weights = [generator.choice([0, 1, 5, 100, 1000, generator.randint(0, 10**6)])
                   for _ in range(generator.randint(1, 12))]
        parts = generator.randint(1, 6)
        assert partition_balanced(weights, parts) == [int(p) for p in ds_utils.partition_balanced(weights, parts)]
        assert partition_uniform(len(weights), parts) == [int(p) for p in ds_utils.partition_uniform(len(weights),
                                                                                                      parts)]


def test_move_to_device_moves_nested_batches_as_deepspeeds_does() -> None:
    """deepspeed.runtime.utils.move_to_device, which DeepSpeed's ALST tutorial calls on each batch: containers keep
    their kind; with criterion_func an accepted tensor is moved in place and returned."""
    from zerokit.deepspeed.runtime.utils import move_to_device

    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "pair": (torch.zeros(1), [torch.ones(2)])}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["input_ids"].device.type == "meta" and moved["input_ids"].dtype == torch.long
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert moved["pair"][1][0].device.type == "meta" and batch["input_ids"].device.type == "cpu"
    tensor = torch.ones(2, dtype=torch.float64)
    assert move_to_device(tensor, "cpu", criterion_func=lambda item: torch.is_tensor(item)) is tensor
