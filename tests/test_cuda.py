"""On a GPU: the code that CI runs on CPU ranks, run on CUDA. Skipped where torch sees no GPU (CI has none); on a GPU
machine: `python -m pytest -q tests/test_cuda.py`.

- The world-size-1 parity matrix of tests/test_parity.py (every stage, fp32/bf16/fp16, offload to host memory and
  NVMe, activation checkpointing, Hugging Face models, ...) with the model and the batches on the GPU, in the
  group that a plain `python train.py` gets there (zerokit makes a 1-rank NCCL group), against one process
  training on the same GPU with the same torch optimizer, under test_parity's tolerances.
- Offloading really leaves the GPU: torch's own count of allocated CUDA memory, not zerokit's counters.
- A checkpoint saved on the GPU consolidates and resumes in a process that has no GPU, to the bit.
- The planner against Llama runs recorded on the GPU: model states and collectives exact, the calibrated
  activations and allocator peak within 10%.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerokit
from conftest import cases_for
from test_parity import assert_matches_reference
from zerokit.comm.process import ensure_process_group, open_engines
from zerokit.testing.parity import Case, run_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (this runs on a GPU machine)")

# Muon orthogonalises each update with Newton-Schulz iterations in bf16 matrix products. Offloaded, zerokit runs them
# on the host and the reference on the GPU, whose products round differently (measured on an H200: update error
# 4.7e-2 against test_parity's 1e-2 in bf16, parameters 4.6e-5 apart against 2e-5 in fp32): tests/test_parity.py
# checks those cases where both run on the host.
CASES = [replace(case, device="cuda") for case in cases_for(1)
         if not (case.offload_optimizer != "none" and "muon" in case.optimizer)]


@pytest.fixture(scope="module")
def plain_process_on_a_gpu():
    """The group a script started with `python train.py` gets on a GPU machine: one rank, NCCL."""
    if dist.is_initialized():
        dist.destroy_process_group()
    ensure_process_group()
    assert dist.get_backend() == "nccl"
    yield
    for engine in open_engines():  # a failed test's engine: its NCCL groups go before the default one
        engine.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_matches_single_process_on_the_gpu(plain_process_on_a_gpu, case: Case) -> None:
    assert_matches_reference([run_engine(0, 1, case)], case, world_size=1)


# --- offload frees what it claims to free, read from torch's CUDA allocator ---------------------------------

def _wide_model() -> nn.Module:
    """8 linear layers of 2048 x 2048 (33.6M parameters, 134 MB in fp32): each a stage-3 unit."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.GELU()) for _ in range(8)])


def _allocated_after_a_step(offload: str) -> dict[str, int]:
    """CUDA bytes allocated (torch's count) once a stage-3 engine has taken a step, beside what the engine says it
    holds on the device, with everything offloaded to `offload` or nothing."""
    gc.collect()  # an engine closed before (the other call's) holds its tensors in reference cycles until collected
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zero.update(offload_param={"device": offload}, offload_optimizer={"device": offload})
    model = _wide_model()
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                {"train_micro_batch_size_per_gpu": 8, "zero_optimization": zero})
    batch = torch.randn(8, 2048, device="cuda")
    engine.backward(engine(batch).square().mean())
    engine.step()
    torch.cuda.synchronize()
    at_once = torch.cuda.memory_allocated() - before
    torch.cuda.empty_cache()  # blocks freed while a collective's event was pending are let go of only here
    figures = {"allocated": torch.cuda.memory_allocated() - before, "allocated_at_once": at_once,
               "counted_on_device": sum(engine.memory_by_tier()["device"].values())}
    engine.close()
    return figures


def test_offloaded_states_leave_the_gpu(plain_process_on_a_gpu) -> None:
    resident, offloaded = _allocated_after_a_step("none"), _allocated_after_a_step("cpu")
    print(f"\nstage 3, 33.6M fp32 parameters, CUDA bytes after a step: on the GPU {resident}, "
          f"parameters and optimizer offloaded to host memory {offloaded}")
    numel = 33_570_816
    model_states = numel * (4 + 8)  # parameters and Adam's two moments, fp32 (gradients go at the step)
    assert resident["counted_on_device"] >= model_states
    for figures in (resident, offloaded):  # what the engine counts on the device is really there ...
        assert figures["allocated"] >= figures["counted_on_device"]
        # ... and little else: a batch's activations and the allocator's rounding (under 1% of the model states)
        assert figures["allocated"] - figures["counted_on_device"] < model_states // 100
    # the parameters and Adam's moments left the GPU
    assert resident["allocated"] - offloaded["allocated"] >= numel * (4 + 8) * 0.99


def _resident_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS"))


def test_pinned_host_buffers_hold_the_size_asked_for(plain_process_on_a_gpu) -> None:
    """1.5 GiB page-locked by zerokit grows the process's RSS by 1.5 GiB, where torch's pinned allocator takes 2 GiB
    (See [Note: pinned memory of the size asked for]); the buffer is pinned, and copies through it both ways."""
    from zerokit.tiers.pinned import host_buffer
    size = 3 * 2**29  # bytes
    before = _resident_bytes()
    buffer = host_buffer(size // 4, pin=True)
    grown = _resident_bytes() - before
    assert buffer.is_pinned() and buffer.numel() == size // 4
    assert size * 0.99 <= grown <= size * 1.01, f"RSS grew by {grown} bytes for a {size}-byte buffer"
    on_gpu = torch.arange(buffer.numel(), dtype=torch.float32, device="cuda")
    buffer.copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffer[-5:], torch.arange(buffer.numel() - 5, buffer.numel(), dtype=torch.float32))
    del buffer, on_gpu
    gc.collect()
    before = _resident_bytes()
    rounded = torch.empty(size // 4, pin_memory=True)
    print(f"\n1.5 GiB pinned: RSS +{grown / 2**30:.2f} GiB by zerokit, +{(_resident_bytes() - before) / 2**30:.2f} GiB "
          "by torch's allocator")
    del rounded


# --- a checkpoint saved on the GPU, read where there is none -------------------------------------------------

CPU_SIDE = """
import json, sys
import torch
from safetensors.torch import save_file
import zerokit
from zerokit.checkpoint import consolidate
sys.path.insert(0, {tests!r})
from test_cuda import _wide_model
checkpoint, out = sys.argv[1], sys.argv[2]
consolidate(checkpoint, out + "/consolidated.safetensors")
model = _wide_model()
engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), {{"zero_optimization": {{"stage": 2}}}})
engine.load_checkpoint(checkpoint)
save_file(engine.full_state_dict(), out + "/resumed.safetensors")
print(json.dumps({{"cuda": torch.cuda.is_available(), "backend": torch.distributed.get_backend()}}))
"""


def test_a_checkpoint_saved_on_the_gpu_consolidates_and_resumes_without_one(plain_process_on_a_gpu, tmp_path) -> None:
    from safetensors.torch import load_file

    model = _wide_model()
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
                                 "zero_optimization": {"stage": 3}})
    for _ in range(2):
        engine.backward(engine(torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)).float().square().mean())
        engine.step()
    engine.save_checkpoint(tmp_path / "checkpoint")
    computed = engine.full_state_dict()  # bf16 parameters, as fp32 values
    engine.close()
    done = subprocess.run([sys.executable, "-c", CPU_SIDE.format(tests=str(Path(__file__).parent)),
                           str(tmp_path / "checkpoint"), str(tmp_path)],
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"cuda": False, "backend": "gloo"}
    consolidated, resumed = load_file(tmp_path / "consolidated.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert consolidated.keys() == resumed.keys() == dict(model.named_parameters()).keys()
    for name in consolidated:
        assert consolidated[name].dtype == resumed[name].dtype == torch.float32
        assert torch.equal(consolidated[name], resumed[name]), name  # the fp32 masters, to the bit
        assert torch.equal(consolidated[name].bfloat16().float(), computed[name]), name  # the GPU run's bf16 copy


# --- the planner against a run recorded on the GPU -----------------------------------------------------------

LLAMA = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024)


@pytest.mark.parametrize("stage", (2, 3))
def test_the_plan_meets_a_run_recorded_on_the_gpu(plain_process_on_a_gpu, stage: int) -> None:
    """As tests/planner/test_planner_engine_exact.py's recorded Llama on gloo, here with CUDA's allocator: model
    states and collectives exact, the calibrated activations and allocator peak within 10%."""
    transformers = pytest.importorskip("transformers")
    from zerokit.profiling.calibrate import calibrate
    from zerokit.profiling.record import record_run
    from zerokit.profiling.report import plan_report
    from zerokit.testing.models import param_groups

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    optimizer = torch.optim.AdamW(param_groups(model))
    engine = zerokit.initialize(model, optimizer, {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    generator = torch.Generator().manual_seed(0)
    batches = iter(lambda: torch.randint(0, LLAMA["vocab_size"], (4, 512), generator=generator).cuda(), None)
    try:
        record = record_run(engine, batches, lambda e, tokens: e(input_ids=tokens, labels=tokens).loss,
                            optimizer=optimizer, micro_batch=4, seq_len=512, warmup=1, steps=2)
    finally:
        engine.close()
    calibration = calibrate(transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        **{**LLAMA, "num_hidden_layers": 2})), precision="bf16", seqs=(256, 512), device=torch.device("cuda"))
    rows = {row["category"]: row for row in plan_report(record=record, calibration=calibration)}
    print()
    for row in rows.values():
        print({k: v for k, v in row.items() if v is not None})
    for name in ("parameters", "gradients", "optimizer_state", "parameters_after_step", "gradients_after_step",
                 "optimizer_state_after_step"):
        assert rows[name]["error"] == 0, name
    for name, row in rows.items():
        if name.split(".")[-1] in ("calls", "elements", "bytes") and "." in name:
            assert row["error"] == 0, name
    assert abs(rows["activations"]["error"]) < 0.10
    assert abs(rows["peak_allocated"]["error"]) < 0.10
