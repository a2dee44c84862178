"""NVMe offload frees the host memory it offloads (issue 22): with the optimizer on NVMe host memory holds a
pool of `buffer_count` buffers of one sub-group each, with parameters on NVMe a pool of `buffer_count` chunks of
at most `buffer_size` elements, never the whole state; memory_by_tier() says what the process really holds; and
records smaller than a master or a shard train exactly as the same run without offload."""

from __future__ import annotations

import ctypes
import gc
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import zerokit
from zerokit.config.defaults import NVME_SUB_GROUP_NUMEL
from zerokit.masters.state import masters_state_dict
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups, rank_batch, small_zero_config
from zerokit.testing.spawn import spawn

MIB = 2**20
# 8 blocks of 2.1M parameters (16.8M): AdamW's state is 128 MiB in fp32, and a block, one stage-3 unit (its
# master and its shard), is far larger than a sub-group: a pool of whole masters (34 MiB each with AdamW's state
# and gradient) would hold most of what offload moves out.
WIDTH, BLOCKS, STEPS = 512, 8, 3


class MemoryRun(NamedTuple):
    stage: int
    dtype: str
    optimizer: str = "none"  # offload_optimizer.device
    params: str = "none"  # offload_param.device (max_in_cpu 0: DeepSpeed's default 1e9 would cache them all)

    @property
    def baseline(self) -> "MemoryRun":
        return MemoryRun(self.stage, self.dtype)


OFFLOADED = [MemoryRun(2, "fp32", "nvme"), MemoryRun(3, "fp32", "nvme", "nvme"), MemoryRun(3, "bf16", "nvme", "nvme")]
# glibc raises its mmap threshold to the size of the last large block freed (up to 32 MiB), and then keeps
# freed memory in its heap: RSS that nothing holds, 40-100 MiB here, different in every run (stage 3 with
# the optimizer on NVMe saved 54-69% of the offloaded bytes in three runs, the same runs without offload
# peaked 673-694 MiB). A fixed threshold returns large blocks when freed, so RSS is what the process holds:
# the runs then repeat to 0.2 MiB (that run saves 89%).
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072"}
RUNS = sorted({run.baseline for run in OFFLOADED}) + OFFLOADED


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _return_freed_memory() -> bool:
    """glibc keeps freed heap memory for reuse (activations, the first step's transient state), and RSS with
    it; malloc_trim gives it back, so that RSS is what live allocations hold. False where there is no glibc."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim(0) >= 0
    except (OSError, AttributeError):
        return False


def train_and_measure(rank: int, world_size: int, run: MemoryRun, nvme_path: str) -> dict:
    """In a fresh process: the training loop's peak RSS (VmHWM, reset after initialize), then RSS with freed
    heap memory given back, and memory_by_tier() beside it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                                      torch.nn.Linear(4 * WIDTH, WIDTH)) for _ in range(BLOCKS)])
    zero: dict = {"stage": run.stage}
    if run.optimizer != "none":
        zero["offload_optimizer"] = {"device": run.optimizer, "nvme_path": nvme_path}
    if run.params != "none":
        zero["offload_param"] = {"device": run.params, "nvme_path": nvme_path, "max_in_cpu": 0}
    config = {"zero_optimization": zero, "bf16": {"enabled": run.dtype == "bf16"}}
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    batch = torch.randn(8, WIDTH, dtype=torch.bfloat16 if run.dtype == "bf16" else torch.float32)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    for _ in range(STEPS):
        engine.backward(engine(batch).float().square().mean())
        engine.step()
    peak = _status("VmHWM")
    gc.collect()
    trimmed = _return_freed_memory()
    return {"peak": peak, "rss": _status("VmRSS"), "trimmed": trimmed, "tiers": engine.memory_by_tier()}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[MemoryRun, dict]:
    """Every run in a process of its own, two at a time (a process's RSS is its own; the machine has 2 cores)."""
    nvme_path = str(tmp_path_factory.mktemp("nvme"))  # on disk, not tmpfs: tmp_path is under /tmp here
    saved = {name: os.environ.get(name) for name in ALLOCATOR}
    os.environ.update(ALLOCATOR)  # read by each new process's allocator at its start
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = pool.map(lambda run: spawn(train_and_measure, 1, run, nvme_path, timeout=300, fresh=True)[0],
                               RUNS)
            return dict(zip(RUNS, results))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _total(tiers: dict) -> int:
    """Bytes held in this process's memory: on this machine the "device" is the CPU, so both tiers."""
    return sum(count for tier in ("device", "host") for count in tiers[tier].values())


def _offloaded(run: MemoryRun, measured: dict) -> int:
    """What the run without offload holds that this one moves to NVMe: AdamW's state (and fp32 masters, when
    separate from the parameters), and with parameters on NVMe their shards too: 12 bytes a parameter in fp32."""
    plain = measured[run.baseline]["tiers"]
    moved = sum(plain[tier]["optimizer_state"] for tier in ("device", "host"))
    if run.params == "nvme":
        moved += measured[run]["tiers"]["nvme"]["parameters"]
    return moved


@pytest.mark.parametrize("run", OFFLOADED, ids=[f"stage{r.stage}-{r.dtype}-{r.optimizer}-{r.params}" for r in OFFLOADED])
def test_nvme_offload_lowers_the_loops_peak_by_most_of_what_it_offloads(measured, run) -> None:
    """The loop's peak RSS falls by at least 60% of the offloaded bytes against the same run without offload:
    what stays is the pools (16 MiB for the optimizer's 4 sub-groups; for the parameters up to 5 chunks of a
    2.1M-parameter unit, 3 of them used here, 24 MiB in fp32), the same for any larger model. Measured here:
    91% (stage 2), 80% (stage 3, fp32), 88% (bf16)."""
    saved = measured[run.baseline]["peak"] - measured[run]["peak"]
    offloaded = _offloaded(run, measured)
    assert offloaded >= 96 * MIB  # the test can fail: there is something to save
    assert saved >= 0.6 * offloaded, (saved / MIB, offloaded / MIB)


@pytest.mark.parametrize("run", OFFLOADED, ids=[f"stage{r.stage}-{r.dtype}-{r.optimizer}-{r.params}" for r in OFFLOADED])
def test_memory_by_tier_says_what_the_process_holds(measured, run) -> None:
    """After the loop, with freed heap memory given back, the RSS the offload saves equals the saving
    memory_by_tier() predicts (device and host: both this process's memory here) within 8 MiB: what is in
    neither count, the NVMe tiers' I/O threads and Python objects per record, measured at 1.2-1.6 MiB."""
    plain, offloaded = measured[run.baseline], measured[run]
    if not (plain["trimmed"] and offloaded["trimmed"]):
        pytest.skip("no glibc malloc_trim: RSS keeps freed heap memory")
    predicted = _total(plain["tiers"]) - _total(offloaded["tiers"])
    assert abs((plain["rss"] - offloaded["rss"]) - predicted) <= 8 * MIB, ((plain["rss"] - offloaded["rss"]) / MIB,
                                                                           predicted / MIB)


@pytest.mark.parametrize("run", OFFLOADED, ids=[f"stage{r.stage}-{r.dtype}-{r.optimizer}-{r.params}" for r in OFFLOADED])
def test_host_memory_is_the_pools(measured, run) -> None:
    """Host memory holds 4 buffers of one sub-group each (its record, AdamW's 12 bytes an element, and an fp32
    gradient area) and, with parameters on NVMe, 5 of one unit's shard (under buffer_size); NVMe holds the rest."""
    tiers = measured[run]["tiers"]
    slack = 3 * 4096  # a record rounded to 4 KiB, allocated 4 KiB larger to be aligned, and 64-byte tensor starts
    assert 0 < tiers["host"]["optimizer_state"] <= 4 * (16 * NVME_SUB_GROUP_NUMEL + slack)
    assert tiers["nvme"]["optimizer_state"] >= 12 * BLOCKS * 2 * 4 * WIDTH * WIDTH  # masters and AdamW's state
    unit = (2 * 4 * WIDTH * WIDTH + 5 * WIDTH) * (4 if run.dtype == "fp32" else 2)
    assert tiers["host"]["parameters"] <= (5 * (unit + slack) if run.params == "nvme" else 0)
    assert tiers["device"]["optimizer_state"] == 0


# --- records smaller than a master and than a shard train as the run without offload --------------------------------
SMALL_RECORDS = {"sub_group_size": 500}  # several sub-groups per master; parameter pieces share them
SHARD_CHUNK = 700  # several chunks per shard, filled sub-group by sub-group


def train_pair(rank: int, world_size: int, nvme_path: str) -> dict:
    """Each stage and precision twice, with everything offloaded to small NVMe records and without offload (the
    same pieces: sub_group_size cuts both), on the same data; losses, parameters and masters of both."""
    out = {}
    for stage in (1, 2, 3):
        for dtype in ("fp32", "bf16"):
            for offload in (False, True):
                config = small_zero_config(stage, bf16={"enabled": dtype == "bf16"})
                config["zero_optimization"].update(SMALL_RECORDS)
                if offload:
                    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path,
                                                                        "buffer_count": 2}
                    if stage == 3:
                        config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_path,
                                                                        "max_in_cpu": 0, "buffer_size": SHARD_CHUNK}
                torch.manual_seed(0)
                model = TinyGPT(TinyGPTConfig())
                engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2), config)
                losses = []
                for step in range(4):
                    if step == 2:  # an edit kept in the shard and in the master (its records, read and rewritten)
                        with engine.unsharded([model.blocks[0].mlp[0].weight], write_back=True), torch.no_grad():
                            model.blocks[0].mlp[0].weight.mul_(0.5)
                    tokens = rank_batch(rank, step)
                    loss = lm_loss(engine(tokens[:, :-1]), tokens)
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                masters = engine.stage.masters
                out[(stage, dtype, offload)] = {
                    "losses": losses, "params": engine.full_state_dict(),
                    "masters": [m.clone() for m in masters_state_dict(masters)["masters"]],  # every sub-group at once
                    "records": sum(len(getattr(home, "sub_groups", ())) for home in masters.homes),
                    "pool": (masters.homes[0].pool.held_bytes(), masters.homes[0].pool.count) if offload else None}
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> list[dict]:
    return spawn(train_pair, 2, str(tmp_path_factory.mktemp("nvme")), timeout=600, fresh=True)


def test_small_records_train_bit_for_bit_as_without_offload(pairs) -> None:
    """Sub-groups, chunks filled part by part and a pool of 2 buffers change nothing in the numbers, at every
    stage and precision, on 2 ranks, an in-place edit kept between steps included; a state dict's read of a whole
    master (more sub-groups than buffers) borrows buffers and gives them back."""
    for rank, runs in enumerate(pairs):
        for stage in (1, 2, 3):
            for dtype in ("fp32", "bf16"):
                plain, offloaded = runs[(stage, dtype, False)], runs[(stage, dtype, True)]
                assert offloaded["records"] > len(offloaded["masters"]), (rank, stage, dtype)  # several a master
                assert offloaded["losses"] == plain["losses"], (rank, stage, dtype)
                assert all(torch.equal(offloaded["params"][k], plain["params"][k]) for k in plain["params"])
                assert all(torch.equal(a, b) for a, b in zip(offloaded["masters"], plain["masters"])), (rank, stage)
                held, count = offloaded["pool"]
                assert held <= count * (16 * 500 + 3 * 4096 + 64 * 12), (rank, stage, dtype)  # back to its bound
