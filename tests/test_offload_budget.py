"""NVMe offload bounds host memory by its buffers, not by the model (issue 10), and bad offload settings are
refused at initialize in one line."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerokit
import zerokit.tiers.preflight as preflight
from zerokit.tiers.swap import SWAP_FOLDER, remove_leftovers
from zerokit.testing.spawn import spawn

WIDTH, DEPTH = 512, 32  # 8.4M parameters: AdamW's state alone is 8 bytes each, 67 MiB


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def train_and_measure(rank: int, world_size: int, offload: dict | None, nvme_path: str) -> dict:
    """Peak resident growth of the training loop itself (after initialize), in a fresh process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    config = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 2**18}}
    if offload is not None:
        config["zero_optimization"]["offload_optimizer"] = {**offload, "nvme_path": nvme_path}
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    batch = torch.randn(4, WIDTH)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    baseline = _status("VmRSS")
    for _ in range(3):
        engine.backward(engine(batch).square().mean())
        engine.step()
    return {"growth": _status("VmHWM") - baseline, "tiers": engine.memory_by_tier(),
            "state_bytes": 8 * sum(p.numel() for p in model.parameters())}


def test_nvme_offload_keeps_the_training_loop_within_its_buffers(tmp_path) -> None:
    """The optimizer state (masters and AdamW's moments, 12 bytes a parameter: 96 MiB on NVMe) is six times the
    pool of 4 swap buffers it pages through (16 MiB); the loop's peak resident growth stays within the pool, the
    flat fp32 gradient (32 MiB, made at each window's first backward: See [Note: gradients live from a window's
    first backward to its step] in zerokit/stages/base.py) and a margin of 24 MiB (the I/O threads, the first
    step's state before its first write, allocator slack: measured 15-19 MiB here), while the same loop without
    offload grows by AdamW's whole state (measured 76-79 MiB for its 64 MiB)."""
    offloaded = spawn(train_and_measure, 1, {"device": "nvme", "buffer_count": 4}, str(tmp_path), fresh=True)[0]
    plain = spawn(train_and_measure, 1, None, str(tmp_path), fresh=True)[0]
    pool = offloaded["tiers"]["host"]["optimizer_state"]
    on_nvme = offloaded["tiers"]["nvme"]["optimizer_state"]
    assert on_nvme >= 3 * pool  # the state really is several times the budget
    gradients = offloaded["state_bytes"] // 2  # 4 bytes a parameter, fp32
    assert offloaded["growth"] <= pool + gradients + 24 * 2**20, (offloaded["growth"], pool)
    assert plain["growth"] >= plain["state_bytes"]  # the test can fail: without offload the state is resident
    assert not list((tmp_path / "zerokit-swap").iterdir())  # swap files removed at exit


def initialize(offload: dict, stage: int = 3):
    model = torch.nn.Linear(64, 64)
    return zerokit.initialize(model, torch.optim.AdamW(model.parameters()),
                              {"zero_optimization": {"stage": stage, **offload}})


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_a_missing_or_read_only_nvme_path_is_refused(one_process, key, tmp_path) -> None:
    with pytest.raises(ValueError, match=f"zero_optimization.{key}.nvme_path='{tmp_path}/missing' does not exist"):
        initialize({key: {"device": "nvme", "nvme_path": str(tmp_path / "missing")}})
    with pytest.raises(ValueError, match=f"zero_optimization.{key}.nvme_path='/proc' is not writable"):
        initialize({key: {"device": "nvme", "nvme_path": "/proc"}})


def test_a_full_disk_is_refused(one_process, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(preflight, "free_disk_bytes", lambda path: 1024)
    with pytest.raises(ValueError, match=r"offload_optimizer.nvme_path='.*' needs .* GiB free for 1 rank\(s\) but has"):
        initialize({"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}})


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_not_enough_host_memory_is_refused(one_process, key, monkeypatch) -> None:
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 1024)
    with pytest.raises(ValueError, match=f"zero_optimization.{key} needs .* GiB of host memory on this node"):
        initialize({key: {"device": "cpu"}})


def test_parameter_offload_below_stage_3_is_not_used_as_in_deepspeed(one_process) -> None:
    """DeepSpeed reads offload_param at stage 3 only (Megatron-DeepSpeed's examples/ds_config.json sets it at stage
    1); zerokit trains without it too, and says so (tests/test_dsconfig_public.py)."""
    engine = initialize({"offload_param": {"device": "cpu"}}, stage=2)
    assert not engine.config.offload_param.enabled
    assert any(line.startswith("zero_optimization.offload_param.device=cpu: not used at stage 2")
               for line in engine.config.startup_log_lines())


EXIT_CLEANLY = """
import sys
from pathlib import Path
import torch, zerokit
model = torch.nn.Linear(64, 64)
engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_optimization": {
    "stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]}}})
engine.backward(engine(torch.randn(2, 64)).square().mean())
engine.step()
print(len(list((Path(sys.argv[1]) / "zerokit-swap").iterdir())))
"""


def test_swap_files_are_removed_at_exit_and_a_crashed_runs_at_the_next_start(tmp_path) -> None:
    """A run's swap folder exists while it trains and is gone after it exits; a folder left by a process of this
    host that is no longer alive (a crashed run) is removed when the next run starts; a live one's is kept."""
    run = subprocess.run([sys.executable, "-c", EXIT_CLEANLY, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    assert run.stdout.strip().splitlines()[-1] == "1"  # its own folder, while it ran
    root = tmp_path / SWAP_FOLDER
    assert list(root.iterdir()) == []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a pid that has exited
    crashed = root / f"{socket.gethostname()}-{dead}-rank0-optimizer"
    alive = root / f"{socket.gethostname()}-{os.getpid()}-rank0-optimizer"
    for folder in (crashed, alive):
        folder.mkdir()
        (folder / "master0.swap").write_bytes(b"\0" * 4096)
    assert remove_leftovers(root) == [crashed]
    assert not crashed.exists() and alive.exists()
