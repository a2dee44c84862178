"""The observability keys, through the engine in one process: steps_per_print, wall_clock_breakdown,
comms_logger (per step, verbose, prof_ops), flops_profiler, csv_monitor (DeepSpeed's files), tensorboard and
wandb (a stand-in module: the package is optional), and the one-line errors."""

from __future__ import annotations

import csv
import importlib.machinery
import importlib.util
import re
import sys
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import zerokit
from zerokit.config.typed import load_config
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss

TOKENS = torch.randint(0, 67, (4, 17), generator=torch.Generator().manual_seed(3))


def engine_with(**keys) -> zerokit.Engine:
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, **keys}
    return zerokit.initialize(TinyGPT(TinyGPTConfig()), config=config)


def train(engine: zerokit.Engine, micro_steps: int) -> list[float]:
    losses = []
    for _ in range(micro_steps):
        loss = lm_loss(engine(TOKENS[:, :-1]), TOKENS)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def zerokit_lines(err: str) -> list[str]:
    return [line.removeprefix("[zerokit rank 0] ") for line in err.splitlines() if line.startswith("[zerokit rank 0]")]


def test_steps_per_print_logs_every_n_optimizer_steps(one_process, capsys) -> None:
    engine = engine_with(steps_per_print=2)
    capsys.readouterr()
    losses = train(engine, 8)
    lines = [line for line in zerokit_lines(capsys.readouterr().err) if " | loss " in line]
    assert [line.split(" |")[0] for line in lines] == ["step 2", "step 4"]
    pattern = (r"step 4 \| loss (\S+) \(rank 0\) \| lr 1\.0000e-02 \| grad norm \d+\.\d{4} \| loss scale 1 \| "
               r"skipped 0 \| \d+\.\d{3} s/step \(\d+\.\d samples/s\)")
    match = re.fullmatch(pattern, lines[1])
    assert match and float(match.group(1)) == pytest.approx((losses[6] + losses[7]) / 2, abs=1e-4)


def test_wall_clock_breakdown_times_each_phase(one_process, capsys) -> None:
    engine = engine_with(wall_clock_breakdown=True)
    train(engine, 4)
    lines = [line for line in zerokit_lines(capsys.readouterr().err) if "time (ms)" in line]
    assert [line.split(" time")[0] for line in lines] == ["step 1", "step 2"]
    phases = ("forward", "backward", "backward_inner", "backward_reduce", "step", "optimizer_gradients",
              "optimizer_step", "optimizer_allgather")
    assert all(f"| {phase}: " in lines[0] for phase in phases)
    times = engine.monitor.wall_clock_times
    assert set(times) == set(phases) and all(value > 0 for value in times.values())
    assert times["backward"] >= times["backward_inner"] + times["backward_reduce"]
    assert times["step"] >= times["optimizer_gradients"] + times["optimizer_step"] + times["optimizer_allgather"]


def test_comms_logger_reports_what_each_step_moved(one_process, capsys) -> None:
    engine = engine_with(comms_logger={"enabled": True})
    before = engine.comm_stats()
    train(engine, 2)
    after = engine.comm_stats()
    line = next(line for line in zerokit_lines(capsys.readouterr().err) if line.startswith("step 1 collectives"))
    moved = {kind: after[kind]["elements"] - before[kind]["elements"] for kind in after}
    assert f"all_reduce {after['all_reduce']['calls'] - before['all_reduce']['calls']} calls, " \
           f"{moved['all_reduce']:,} elements" in line
    assert "broadcast" not in line  # construction's broadcasts are not a step's


def test_comms_logger_verbose_logs_each_collective_of_the_kinds_asked(one_process, capsys) -> None:
    engine = engine_with(comms_logger={"enabled": True, "verbose": True, "debug": True, "prof_all": False,
                                       "prof_ops": ["all_gather_into_tensor"]})
    capsys.readouterr()
    train(engine, 2)
    lines = zerokit_lines(capsys.readouterr().err)
    ops = [line for line in lines if line.startswith("comm op:")]
    assert ops and all(line.startswith("comm op: all_gather |") for line in ops)
    caller = re.search(r"\| caller (zerokit/\S+\.py):\d+ \w+$", ops[0])  # the code that asked, not comm/'s
    assert caller and not caller.group(1).startswith(("zerokit/comm/", "zerokit/observe/"))
    step_line = next(line for line in lines if line.startswith("step 1 collectives"))
    assert "all_reduce" not in step_line and "all_gather 1 calls" in step_line


def test_comms_logger_names_an_unknown_operation(one_process) -> None:
    with pytest.raises(ValueError, match="comms_logger.prof_ops names 'allreduce', which is not a deepspeed.comm "
                                         "operation"):
        engine_with(comms_logger={"enabled": True, "prof_all": False, "prof_ops": ["allreduce"]})


def test_flops_profiler_counts_the_profiled_step(one_process, capsys, tmp_path) -> None:
    report = tmp_path / "flops.txt"
    engine = engine_with(flops_profiler={"enabled": True, "profile_step": 1, "top_modules": 2, "detailed": False,
                                         "output_file": str(report)})
    train(engine, 6)
    with FlopCounterMode(display=False) as counter:
        engine.module(TOKENS[:, :-1])
    text = report.read_text()
    assert text.startswith("flops profiler, step 1 (rank 0, 2 micro-steps,")
    forward = re.search(r"forward ([\d.]+) MFLOPs", text).group(1)
    assert float(forward) == pytest.approx(2 * counter.get_total_flops() / 1e6, abs=1e-3)
    assert "  top at depth 2: blocks.0 " in text
    assert sum("flops profiler" in line for line in zerokit_lines(capsys.readouterr().err)) == 1


def test_csv_monitor_writes_deepspeeds_files(one_process, tmp_path) -> None:
    engine = engine_with(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
                         wall_clock_breakdown=True)
    losses = train(engine, 4)
    directory = tmp_path / "run"
    with open(directory / "Train_Samples_lr.csv") as file:
        assert list(csv.reader(file)) == [["step", "lr"], ["8", "0.01"], ["16", "0.01"]]
    with open(directory / "Train_Samples_train_loss.csv") as file:
        rows = list(csv.reader(file))
    assert float(rows[2][1]) == pytest.approx((losses[2] + losses[3]) / 2, abs=1e-5)
    assert (directory / "Train_Samples_elapsed_time_ms_backward_allreduce.csv").is_file()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_writes_events(one_process, tmp_path) -> None:
    engine = engine_with(tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
    train(engine, 2)
    engine.monitor.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_a_missing_monitor_package_is_one_line(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError) as error:
        load_config({"tensorboard": {"enabled": True}})
    assert str(error.value) == ("tensorboard.enabled=true needs the tensorboard package, which is not installed; pip "
                                "install 'zerokit[tensorboard]' or set tensorboard.enabled to false")


def test_wandb_logs_deepspeeds_events(one_process, monkeypatch) -> None:
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: calls.append(("init", kwargs))
    fake.log = lambda values, step: calls.append(("log", values, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    engine = engine_with(wandb={"enabled": True, "project": "p", "team": "t"})
    train(engine, 2)
    engine.monitor.close()
    assert calls[0] == ("init", {"project": "p", "group": None, "entity": "t"})
    assert ("log", {"Train/Samples/lr": 0.01}, 8) in calls and calls[-1] == ("finish",)


def test_with_every_key_off_the_monitor_does_nothing(one_process, capsys) -> None:
    engine = engine_with()
    capsys.readouterr()
    train(engine, 4)
    assert zerokit_lines(capsys.readouterr().err) == []
    assert engine.monitor.losses == [] and engine.monitor.writers == []
