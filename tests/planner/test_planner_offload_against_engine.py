"""The planner's offload predictions against real engines: the bytes each tier boundary carries per optimizer
step (comm_stats()'s device_to_host, host_to_device, nvme_read, nvme_write), to the byte, from the exact engine
model (engine_offload.engine_transfers), in one process and on 2 gloo ranks (one spawn serves every case); the
architecture-level formula (compute.offload_estimate) on the same model where it is exact (one rank: no
padding) or bounded (NVMe record rounding); and the CPU step's price: linear in the shard, at the bytes per
element the host's AdamW really keeps (its state tensors counted), never at a wall-clock time. On a machine
without a GPU the "device" is the CPU, and the engine still makes and counts every copy."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

import zerokit  # noqa: E402
from zerokit.planner import Architecture, estimate, make_scenario  # noqa: E402
from zerokit.planner.compute import ComputeEstimate, cpu_update_bytes, offload_estimate  # noqa: E402
from zerokit.config.defaults import CPU_OPTIMIZER_PIECE_NUMEL  # noqa: E402
from zerokit.planner.engine_model import EngineSetup  # noqa: E402
from zerokit.planner.engine_offload import NVME_BLOCK, TRANSFERS, engine_transfers  # noqa: E402
from zerokit.planner.memory import RankParams  # noqa: E402
from zerokit.planner.models import from_architecture  # noqa: E402
from zerokit.planner.spec import Offload, Training  # noqa: E402
from zerokit.profiling.inventory import param_inventory  # noqa: E402
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

WORLD = 2
BUCKET_BYTES = 40_000  # several buckets per param group at stages 1-2
MODEL = TinyGPTConfig(with_test_features=False)  # a plain GPT-2 block stack: 2 blocks, 24 wide
# The same model in the planner's terms (as in test_planner_against_engine.py).
ARCH = Architecture(n_layers=MODEL.n_layer, hidden=MODEL.n_embd, n_heads=MODEL.n_head, n_kv_heads=MODEL.n_head,
                    ffn=4 * MODEL.n_embd, vocab=MODEL.vocab_size, max_positions=MODEL.block_size,
                    tied_embeddings=True, gated_mlp=False, layernorm=True, qkv_bias=True, out_bias=True,
                    mlp_bias=True)


@dataclass(frozen=True)
class OffloadCase:
    stage: int
    precision: str = "bf16"
    optimizer: str = "cpu"
    params: str = "none"
    grad_accum: int = 1
    max_in_cpu: int = 1_000_000_000
    persistence_threshold: int = 0
    """Stage 3: 0 gathers every block before its forward and backward; the default keeps one root gathered."""
    frozen_attention: bool = False
    """Freeze the blocks' attention: stage 3 then fetches a frozen buffer per block too."""
    sub_group_size: int | None = None
    buffer_size: int = 100_000_000


CASES = {
    "optimizer-cpu-stage1": OffloadCase(1),
    "optimizer-cpu-stage2-accumulating": OffloadCase(2, grad_accum=2),  # the gradient goes down once per step
    "optimizer-cpu-stage3-fp32": OffloadCase(3, precision="fp32"),
    "optimizer-nvme-stage2": OffloadCase(2, optimizer="nvme"),
    "optimizer-nvme-stage3-fp32": OffloadCase(3, precision="fp32", optimizer="nvme"),  # a separate fp32 master
    "params-cpu-stage3": OffloadCase(3, params="cpu", frozen_attention=True),
    # part of the shards in the host cache, the rest read (and read ahead) from NVMe, a frozen buffer per block
    "params-nvme-stage3": OffloadCase(3, params="nvme", max_in_cpu=3000, frozen_attention=True, grad_accum=2),
    # one persistent root, gathered again only after the step: the read-ahead reads one record for nothing
    "params-nvme-stage3-persistent": OffloadCase(3, params="nvme", max_in_cpu=0, persistence_threshold=100_000),
    "infinity-stage3": OffloadCase(3, optimizer="nvme", params="nvme", max_in_cpu=0),
    # records smaller than a master and than a shard: several sub-groups per master (pieces of several small
    # parameters in one), several chunks per shard, each filled by the sub-groups' publishes
    "optimizer-nvme-stage2-sub-groups": OffloadCase(2, optimizer="nvme", sub_group_size=700),
    "infinity-stage3-small-records": OffloadCase(3, precision="fp32", optimizer="nvme", params="nvme", max_in_cpu=0,
                                                 sub_group_size=700, buffer_size=1000, grad_accum=2),
}


def _config(case: OffloadCase, nvme_path: str) -> dict:
    zero: dict = {"stage": case.stage, "reduce_bucket_bytes": BUCKET_BYTES,
                  "offload_optimizer": {"device": case.optimizer, "nvme_path": nvme_path}}
    if case.stage == 3:
        zero.update(stage3_unit_classes=["Block"], stage3_param_persistence_threshold=case.persistence_threshold)
    if case.sub_group_size is not None:
        zero["sub_group_size"] = case.sub_group_size
    if case.params != "none":
        zero["offload_param"] = {"device": case.params, "nvme_path": nvme_path, "max_in_cpu": case.max_in_cpu,
                                 "buffer_size": case.buffer_size}
    return {"zero_optimization": zero, "bf16": {"enabled": case.precision == "bf16"},
            "gradient_accumulation_steps": case.grad_accum}


def _engine(case: OffloadCase, nvme_path: str) -> tuple:
    """(engine, the user's optimizer, the model) on the 2-block GPT."""
    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    if case.frozen_attention:
        for name, param in model.named_parameters():
            if ".attn." in name:
                param.requires_grad_(False)
    optimizer = torch.optim.AdamW(param_groups(model))
    return zerokit.initialize(model, optimizer, _config(case, nvme_path)), optimizer, model


def _step(engine, case: OffloadCase, generator: torch.Generator) -> None:
    for _ in range(case.grad_accum):
        tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.block_size + 1), generator=generator)
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
    engine.step()


def measure(case: OffloadCase, nvme_path: str, rank: int = 0) -> dict:
    """comm_stats()'s transfer kinds grown over the second optimizer step (the first creates the optimizer's
    state, which NVMe records then grow by), and the model's parameter inventory."""
    engine, optimizer, model = _engine(case, nvme_path)
    generator = torch.Generator().manual_seed(rank)
    _step(engine, case, generator)  # warm-up
    before = engine.comm_stats()
    _step(engine, case, generator)
    after = engine.comm_stats()
    grown = {kind: {key: after[kind][key] - before[kind][key] for key in after[kind]} for kind in TRANSFERS}
    return {"transfers": {kind: entry for kind, entry in grown.items() if entry["calls"]},
            "inventory": param_inventory(model, optimizer, engine.config.stage3)}


def exact_setup(case: OffloadCase, world: int) -> EngineSetup:
    return EngineSetup(stage=case.stage, world=world, precision=case.precision, bucket_bytes=BUCKET_BYTES,
                       grad_accum=case.grad_accum, persistence_threshold=case.persistence_threshold,
                       offload_optimizer=case.optimizer, offload_param=case.params, max_in_cpu=case.max_in_cpu,
                       sub_group_size=case.sub_group_size, buffer_size=case.buffer_size)


# --- exact, one process -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_transfers_per_step_are_exact_in_one_process(one_process, tmp_path, name):
    case = CASES[name]
    run = measure(case, str(tmp_path))
    nvme = {"nvme_read", "nvme_write"} if "nvme" in (case.optimizer, case.params) else set()
    assert set(run["transfers"]) == {"device_to_host", "host_to_device"} | nvme  # the case moves what it says
    assert engine_transfers(run["inventory"], exact_setup(case, 1)) == run["transfers"]


# --- exact, 2 gloo ranks ------------------------------------------------------------------------------------
def _all_cases(rank: int, world: int, nvme_path: str) -> dict:
    return {name: measure(case, nvme_path, rank) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return spawn(_all_cases, WORLD, str(tmp_path_factory.mktemp("nvme")), timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_transfers_per_step_are_exact_on_two_gloo_ranks(two_ranks, name):
    """Each rank's own prediction: an NVMe optimizer record holds that rank's parameter parts."""
    for rank, runs in enumerate(two_ranks):
        run = runs[name]
        assert engine_transfers(run["inventory"], exact_setup(CASES[name], WORLD), rank) == run["transfers"], rank


def test_the_nvme_read_ahead_the_publish_overtakes_is_counted(two_ranks):
    """A persistent unit is fetched only after the publish wrote it: the read-ahead of the step's last fetch
    (the first record again) is read for nothing, one record per step beyond the records themselves."""
    run = two_ranks[0]["params-nvme-stage3-persistent"]["transfers"]
    assert run["nvme_read"]["calls"] == run["nvme_write"]["calls"] + 1


# --- the architecture-level formula against the same engines ---------------------------------------------------
def _planned(case: OffloadCase):
    scenario = make_scenario(from_architecture(ARCH), gpus_per_node=1, seq_len=MODEL.block_size,
                             precision=case.precision, grad_accum=case.grad_accum)
    return estimate(scenario.with_training(persistence_threshold=case.persistence_threshold), case.stage,
                    Offload(optimizer=case.optimizer, params=case.params)).offload_time


# every parameter trainable, as the architecture counts them
FORMULA_CASES = {"optimizer-cpu-stage2-accumulating": CASES["optimizer-cpu-stage2-accumulating"],
                 "optimizer-cpu-stage3-fp32": CASES["optimizer-cpu-stage3-fp32"],
                 "params-cpu-stage3": OffloadCase(3, params="cpu", grad_accum=2),
                 "optimizer-nvme-stage2": CASES["optimizer-nvme-stage2"],
                 "optimizer-nvme-stage3-fp32": CASES["optimizer-nvme-stage3-fp32"]}


@pytest.mark.parametrize("name", list(FORMULA_CASES))
def test_formula_matches_the_engine_on_one_rank(one_process, tmp_path, name):
    """One rank pads nothing, so PCIe bytes are exact; an NVMe record exceeds K (+ 4 in fp32) bytes per
    element by its alignment: under 4 KiB a record, and per piece its 4-byte step count and under 64 bytes
    of alignment behind each of its 3 state tensors."""
    case = FORMULA_CASES[name]
    run = measure(case, str(tmp_path))
    planned, measured = _planned(case), run["transfers"]
    assert run["inventory"].total_numel == ARCH.total_params()
    assert planned.pcie_down == measured["device_to_host"]["bytes"]
    assert planned.pcie_up == measured["host_to_device"]["bytes"]
    if case.optimizer == "nvme":
        parts = sum(1 for e in run["inventory"].entries if e.trainable)
        pieces = parts + run["inventory"].trainable_numel // CPU_OPTIMIZER_PIECE_NUMEL
        slack = measured["nvme_read"]["calls"] * NVME_BLOCK + 4 * 64 * pieces
        for kind, planned_bytes in (("nvme_read", planned.nvme_read), ("nvme_write", planned.nvme_write)):
            assert 0 <= measured[kind]["bytes"] - planned_bytes <= slack, kind


# --- the CPU optimizer step, priced without a clock -------------------------------------------------------------
def test_cpu_optimizer_seconds_are_linear_in_the_shard():
    scenario = make_scenario(13e9)
    compute = ComputeEstimate(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def seconds(trainable: int, precision: str = "bf16") -> float:
        rank = RankParams(total=trainable, trainable=trainable, unit=0, root=0, shard=8)
        return offload_estimate(rank, Training(precision=precision), 2, Offload(optimizer="cpu"), scenario.cluster,
                                0.8, compute).cpu_optimizer_seconds

    base = seconds(8 * 10**9)
    assert base > 0
    assert seconds(16 * 10**9) == pytest.approx(2 * base)
    assert seconds(8 * 10**9, "fp32") == pytest.approx(base * 32 / 30)  # bytes touched per element, 32 vs 30


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cpu_update_bytes_are_what_the_host_adamw_touches(one_process, tmp_path, precision):
    """Per element the host's update reads and writes the fp32 master and AdamW's state tensors (counted from
    the optimizer itself), reads the fp32 gradient and writes the compute-dtype shard. Adam's 0-d step count
    is per piece, not per element, and left out."""
    engine, _, _ = _engine(OffloadCase(2, precision=precision), str(tmp_path))
    _step(engine, OffloadCase(2), torch.Generator().manual_seed(0))
    masters = engine.stage.masters
    state_of = {piece: state for optimizer in masters.optimizers for piece, state in optimizer.state.items()}
    for home, pieces in zip(masters.homes, masters.pieces):
        assert home.tier == "host"
        for piece in pieces:
            tensors = [t for t in state_of[piece.param].values() if isinstance(t, torch.Tensor)]
            per_element = [t for t in tensors if t.numel() == piece.param.numel()]
            assert all(t.dim() == 0 for t in tensors if t.numel() != piece.param.numel())  # the step count
            state = sum(t.element_size() for t in per_element)
            touched = (2 * (home.master.element_size() + state) + home.grad.element_size()
                       + home.compute.element_size())
            assert touched == cpu_update_bytes(Training(precision=precision, optimizer="adamw"))

