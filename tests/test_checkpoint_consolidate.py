"""Consolidation streams (See [Note: consolidation streams] in zerokit/checkpoint/consolidate.py): its peak
memory, measured in a fresh process, stays within twice the largest tensor for a checkpoint six times
larger than that, which no consolidator that loads the model could do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn

import zerokit

LARGEST_BYTES = 32 * 2**20  # each of six 2048 x 4096 fp32 matrices


MEASURE = """
import json, sys, gc
from pathlib import Path
import torch, zerokit.checkpoint as checkpoint
gc.collect()
Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark after the imports
status = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
baseline = status("VmRSS")
result = checkpoint.consolidate(sys.argv[1], sys.argv[2])
print(json.dumps({"growth": status("VmHWM") - baseline, "bytes": result.bytes}))
"""


def test_consolidation_peak_memory_stays_near_the_largest_tensor(one_process, tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 2048, bias=False) for _ in range(6)])
    engine = zerokit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_optimization": {"stage": 1}})
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    del engine, model
    out = tmp_path / "model.safetensors"
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    run = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "ckpt"), str(out)], capture_output=True,
                         text=True, check=True)
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["bytes"] == 6 * LARGEST_BYTES
    assert measured["growth"] < 2 * LARGEST_BYTES, f"peak grew by {measured['growth'] / 2**20:.1f} MiB"
    with safe_open(out, framework="pt") as file:
        for name, value in expected.items():
            assert torch.equal(file.get_tensor(name), value), name
