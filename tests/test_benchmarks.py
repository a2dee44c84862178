"""The benchmark keeps working: a tiny run of it, end to end, and its counting parts. (Its timings are
not tested; see benchmarks/README.md.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_stages  # noqa: E402
from benchmarks.accounting import formula_bytes, storage_bytes  # noqa: E402

TINY = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
        "--block-size", "8", "--vocab-size", "16", "--batch-size", "2", "--bucket-mb", "0.01"]


def test_tiny_benchmark_runs_every_torch_contender_and_they_agree(tmp_path) -> None:
    out = tmp_path / "bench.json"
    code = bench_stages.main(["--world-size", "2", "--only", "zerokit-0,zerokit-1,zerokit-3,torch-ddp,fsdp2",
                              "--out", str(out), *TINY])
    result = json.loads(out.read_text())
    assert code == 0 and not result["failed"]
    assert all(row["ok"] and row["ranks_agree"] for row in result["loss_check"]["contenders"].values())
    contenders = result["contenders"]
    psi = contenders["zerokit-0"]["trainable_numel"]
    # Padding is at most a few elements. (zerokit-3 is left out: this model is smaller than
    # stage3_param_persistence_threshold, so it rightly stays gathered.)
    for name in ("zerokit-0", "zerokit-1", "fsdp2"):
        assert abs(contenders[name]["formula_deviation_percent"]) < 2.0, name
    # Counted at torch's c10d operators, for every contender alike. DDP all-reduces each gradient once.
    # On gloo, zerokit reduces each gradient once by all-reduce (+ the norm) and gathers parameters as
    # broadcasts of each owner's slice (See [Note: all-gather on gloo]): once at stage 1, at least once
    # at stage 3 (this tiny model is all root unit).
    counted = {name: contenders[name]["comm_per_step"]["by_collective"] for name in contenders}
    assert counted["torch-ddp"]["all_reduce"]["elements"] == psi and counted["torch-ddp"]["all_gather"]["calls"] == 0
    padding = 64  # at most N-1 elements per bucket
    assert psi < counted["zerokit-1"]["all_reduce"]["elements"] <= psi + padding
    assert psi <= counted["zerokit-1"]["broadcast"]["elements"] <= psi + padding
    assert psi < counted["zerokit-3"]["all_reduce"]["elements"] <= psi + padding
    assert psi <= counted["zerokit-3"]["broadcast"]["elements"]
    assert counted["zerokit-1"]["all_gather"]["calls"] == counted["zerokit-3"]["all_gather"]["calls"] == 0


def test_storages_are_counted_once_in_the_first_category_that_reaches_them() -> None:
    flat = torch.zeros(10)
    views = [flat[:4], flat[4:]]
    other = torch.zeros(3, dtype=torch.float64)
    counted = storage_bytes(parameters=[views], gradients=[flat, other], optimizer_state=[{"m": other}])
    assert counted == {"parameters": 40, "gradients": 24, "optimizer_state": 0}


def test_formula_is_the_zero_papers() -> None:
    # bf16 Adam: 2 + 2 + 12 bytes per parameter; stage 3 shards all three over N
    assert formula_bytes(1000, "bf16", 0, 4) == {"parameters": 2000, "gradients": 2000, "optimizer_state": 12000}
    assert formula_bytes(1000, "bf16", 3, 4) == {"parameters": 500, "gradients": 500, "optimizer_state": 3000}
    assert formula_bytes(1000, "fp32", 2, 2) == {"parameters": 4000, "gradients": 2000, "optimizer_state": 4000}


def test_the_frameworks_benchmark_refuses_a_row_another_engine_trained(tmp_path) -> None:
    """accelerate trains an FSDP job on CPU with DDP without a word: bench_frameworks must not print it as FSDP2."""
    from benchmarks import bench_frameworks

    def ranks(engine: str) -> None:
        for rank in range(2):
            (tmp_path / f"rank{rank}.json").write_text(json.dumps(
                {"durations": [3.0, 1.0 + rank, 2.0, 4.0], "losses": [7.7, 7.6], "vmhwm_kib": 2048 * (rank + 1),
                 "before_kib": 1024, "engine": engine, "parameters": None}))

    ranks("torch.nn.parallel.distributed.DistributedDataParallel")
    row = bench_frameworks.summarise("ddp", tmp_path, warmup=1)
    assert (row["seconds_per_step"], row["vmhwm_mib"], row["growth_mib"]) == (2.0, 4.0, 3.0)  # slower rank's
    try:
        bench_frameworks.summarise("fsdp2", tmp_path, warmup=1)
    except bench_frameworks.SilentFallback as error:
        assert "asked for fsdp2, trained with torch.nn.parallel.distributed.DistributedDataParallel" in str(error)
    else:
        raise AssertionError("a DDP row passed as FSDP2's")


def test_the_frameworks_benchmarks_torch_fsdp2_row_must_be_sharded(tmp_path) -> None:
    """fsdp2 (torch loop): an FSDP module whose ranks each hold half the parameters is a row; one that held them all
    is refused."""
    from benchmarks import bench_frameworks

    for held, refused in ((0.5, False), (1.0, True)):
        for rank in range(2):
            (tmp_path / f"rank{rank}.json").write_text(json.dumps(
                {"durations": [3.0, 1.0, 2.0], "losses": [7.7, 7.6], "vmhwm_kib": 2048, "before_kib": 1024,
                 "engine": "torch.distributed.fsdp.FSDPLlamaForCausalLM", "parameters": None, "held_fraction": held}))
        try:
            bench_frameworks.summarise("fsdp2-torch", tmp_path, warmup=1)
        except bench_frameworks.SilentFallback as error:
            assert refused and "a rank held 100% of the parameters" in str(error)
        else:
            assert not refused


def test_the_gpu_benchmark_runs_where_there_is_none(one_process, tmp_path) -> None:
    """benchmarks/bench_gpu.py is for a GPU (its figures: docs/benchmarks.md); on the CPU it must still run, so that
    it works when a GPU is at hand. zerokit's stages train the same steps, and as FSDP2 does with bf16 parameters."""
    from benchmarks import bench_gpu

    out = tmp_path / "gpu.json"
    bench_gpu.main(["--steps", "2", "--warmup", "1", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
                    "--block-size", "8", "--vocab-size", "16", "--batch-size", "2", "--out", str(out)])
    results = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    assert list(results) == list(bench_gpu.DEFAULT_CONTENDERS)
    losses = {name: row["losses"] for name, row in results.items()}
    for stage in (1, 2, 3):
        assert losses[f"zerokit-{stage}"] == losses["zerokit-0"]
    torch.testing.assert_close(losses["zerokit-0"], losses["fsdp2"], rtol=1e-3, atol=0)
    assert all(row["peak_bytes"] is None and len(row["step_seconds"]) == 2 for row in results.values())


def test_the_gpu_check_runs_where_there_is_none(one_process, tmp_path) -> None:
    """benchmarks/gpu_check.py (make gpu-check) is for a GPU; on the CPU its contenders and teardown parts run on a
    tiny model and write the results file, so that it works when a GPU is at hand (issue 34)."""
    from benchmarks import gpu_check

    out = tmp_path / "gpu.json"
    # not DeepSpeed: its engine patches torch functions for the rest of the process (F.linear at stage 3)
    ours = [name for name in gpu_check.CONTENDERS if not name.startswith("deepspeed")]
    gpu_check.main(["--parts", "contenders,throughput", "--only", ",".join(ours), "--n-layer", "2", "--n-embd", "32",
                    "--n-head", "2", "--block-size", "8", "--vocab-size", "16", "--batch-size", "2", "--steps", "2",
                    "--warmup", "1", "--throughput-model", "tiny", "--throughput-seq", "8", "--throughput-batch", "2",
                    "--throughput-steps", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["card"] == "CPU" and set(report["contenders"]) == set(ours)
    assert isinstance(report["parts"]["contenders"], float) and isinstance(report["parts"]["throughput"], float)
    llama = report["throughput"]["contenders"]
    assert {"fsdp2", "zerokit-3"} <= set(llama) and all(row["tokens_per_s"] > 0 for row in llama.values()), llama
    first = {row["losses"][0] for row in llama.values()}  # the same weights and batch: the same first loss
    assert max(first) - min(first) < 1e-3 * max(first), llama
    losses = {name: row["last_loss"] for name, row in report["contenders"].items()}
    assert len({losses[f"zerokit-{stage}"] for stage in range(4)}) == 1  # the stages train alike
    torn = gpu_check.teardown(timeout=120, engine_counts=(1,))["zerokit-3"]
    assert torn["backend"] == "gloo" and len(torn["close_s"]) == 1 and torn["destroy_s"] >= 0


def test_what_is_live_at_the_peak_is_read_from_an_allocator_trace() -> None:
    """gpu_check.live_at_peak replays torch's allocator trace: the live bytes at the high-water mark, by the first
    frame that is not torch's own (a free of a block made before the trace began is not counted)."""
    from benchmarks.gpu_check import live_at_peak

    def alloc(addr: int, size: int, filename: str) -> dict:
        return {"action": "alloc", "addr": addr, "size": size,
                "frames": [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "softmax"},
                           {"filename": filename, "line": 7, "name": "forward"}]}

    trace = [alloc(1, 2 ** 20, "/w/model.py"), alloc(2, 3 * 2 ** 20, "/w/engine.py"),
             {"action": "free_completed", "addr": 2}, alloc(3, 2 ** 20, "/w/model.py"),
             {"action": "free_completed", "addr": 99}, alloc(4, 2 ** 20, "/w/model.py")]
    result = live_at_peak(trace, baseline=5 * 2 ** 20)
    assert result["peak_over_baseline_mib"] == 4.0 and result["baseline_mib"] == 5.0
    assert result["sites_mib"] == {"engine.py:7 forward": 3.0, "model.py:7 forward": 1.0}


def test_the_offload_benchmark_runs_where_there_is_no_gpu(tmp_path) -> None:
    """benchmarks/bench_offload_gpu.py is for a GPU (its figures: docs/benchmarks.md); on the CPU a tiny Llama at stage 3
    with everything offloaded, and without, must still train there, each in its own process, the same losses."""
    from benchmarks import bench_offload_gpu

    out = tmp_path / "offload.json"
    bench_offload_gpu.main(["largest", "--hidden", "128", "--n-layer", "1", "--mlp-hidden", "256", "--seq", "16",
                            "--steps", "1", "--only", "zerokit-3,zerokit-3-offload", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"zerokit-3", "zerokit-3-offload"} and all(row["trains"] for row in rows.values()), rows
    assert rows["zerokit-3"]["losses"] == rows["zerokit-3-offload"]["losses"]
    # embedding and head, the final norm; a block: two norms, q k v o (one key-value head of 128), the MLP
    assert rows["zerokit-3"]["parameters"] == 128 * 32_000 * 2 + 128 + (2 * 128 + 4 * 128 * 128 + 3 * 128 * 256)


def test_the_sequence_benchmark_runs_ulysses_beside_deepspeeds_alst(tmp_path, monkeypatch) -> None:
    """benchmarks/bench_sequence.py --quick: zerokit's Ulysses at ZeRO-3 and DeepSpeed's ALST (where DeepSpeed is
    installed), each on 2 fresh ranks, a fixed-length run and the search capped at its length (one launch a
    contender: the suite's time); from the same weights and sequence both take the same first step. (Its lengths and timings are not tested; its figures: docs/sequence_parallel.md.)
    DeepSpeed's ranks start through zerokit.testing.deepspeed_peer: no shared-memory op built (See its Note)."""
    from importlib.util import find_spec

    from benchmarks import bench_sequence

    monkeypatch.setattr(bench_sequence, "DEEPSPEED_RANK_PREFIX", ["-m", "zerokit.testing.deepspeed_peer"])

    out = tmp_path / "sequence.json"
    assert bench_sequence.main(["--quick", "--only", "zerokit-sp,deepspeed-alst", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["contenders"]
    assert set(rows) == ({"zerokit-sp", "deepspeed-alst"} if find_spec("deepspeed") else {"zerokit-sp"}), report
    for row in rows.values():
        assert [run["length"] for run in row["search"]] == [256] and row["longest"] == 256, row
        assert row["fixed"]["median_step_s"] > 0 and row["fixed"]["peak_rss_mib"] > row["fixed"]["step_growth_mib"] > 0
    if "deepspeed-alst" in rows:
        assert report["first_loss_difference"]["zerokit-sp vs deepspeed-alst"] < 1e-6, report["first_loss_difference"]
