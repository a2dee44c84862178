"""ALST's memory tools (issue 47, item 6): the tiled MLP and the tiled loss train as the untiled model does, and the
tiled loss holds one slice of the logits at a time.

One spawn of 2 gloo ranks trains the small Llama of tests/test_sequence_parallel.py for 3 AdamW steps (clipping on)
at ZeRO stages 1 and 3, with the two ranks splitting one replica's sequences (sequence_parallel_size 2: 8 tokens a
rank) and without the split (2 replicas of 16 tokens), untiled and with every MLP and the loss tiled 2 and 3 ways
(3 divides neither 8 nor 16: uneven slices). Stage 3 runs with real units, the decoder layers and every Linear in
them and the head (persistence threshold 0), so the head is gathered for each slice of the loss after the model's
forward and the MLP's projections are gathered again to recompute their slices in backward.

Tolerances: a tiled run computes the same terms as the untiled one, added in another order (each slice's loss sum,
then the slices'; a weight's gradient as a sum of the slices' partial sums; a matrix product over fewer rows may
take another kernel), a few fp32 ulps: losses rtol 1e-6 (measured: 1.1e-7), parameters atol 5e-6 after 3 steps
(measured: 8.2e-7; tests/test_sequence_parallel.py allows 2e-5 for the same model against one process).
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerokit
from zerokit.deepspeed.runtime.sequence_parallel.ulysses_sp import (SequenceTiledCompute, TiledFusedLogitsLoss,
                                                                   TiledMLP, sequence_tiled_compute)
from zerokit.parallel.sequence.batch import IGNORE_INDEX, shard_batch
from zerokit.parallel.sequence.tiling import TiledForward, final_hidden_states, tile_mlp, tiled_loss
from zerokit.testing.spawn import spawn

from test_sequence_parallel import CLIP, ROWS, STEPS, llama, replica_batch

WORLD = 2
LOSS_RTOL, WEIGHT_ATOL = 1e-6, 5e-6  # See the module's docstring
STAGE3 = {"stage3_param_persistence_threshold": 0, "stage3_unit_classes": ["LlamaDecoderLayer", "Linear"]}


@dataclass(frozen=True)
class Run:
    stage: int
    sequence: int  # sequence_parallel_size: 2, the ranks split one replica's sequences; 1, each rank a replica
    tiles: int  # of the MLPs and the loss; 0: untiled

    @property
    def untiled(self) -> "Run":
        return Run(self.stage, self.sequence, 0)

    @property
    def name(self) -> str:
        return f"s{self.stage}-sp{self.sequence}-tiles{self.tiles}"


RUNS = [Run(stage, sequence, tiles) for stage in (1, 3) for sequence in (2, 1) for tiles in (0, 2, 3)]
TILED = [run for run in RUNS if run.tiles]


def train(run: Run) -> dict:
    model = llama()
    zero = {"stage": run.stage, **(STAGE3 if run.stage == 3 else {})}
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                {"zero_optimization": zero, "sequence_parallel_size": run.sequence,
                                 "gradient_clipping": CLIP, "train_micro_batch_size_per_gpu": ROWS})
    mlps = tile_mlp(engine.module, run.tiles) if run.tiles else 0
    losses = []
    for step in range(STEPS):
        loss = step_loss(engine, run, step)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"losses": losses, "weights": engine.full_state_dict(), "mlps": mlps}
    engine.close()
    return out


def step_loss(engine: zerokit.Engine, run: Run, step: int) -> torch.Tensor:
    """The replica's loss: from the logits untiled, else from the final hidden states, tiled."""
    if engine.sequence is not None:
        shard = engine.sequence.shard(replica_batch(step, 0))
    else:
        shard = shard_batch(replica_batch(step, dist.get_rank()), 0, 1)  # whole sequences, labels shifted
    inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
    labels, head = shard["shift_labels"], engine.module.lm_head
    if not run.tiles:
        logits = engine(**inputs).logits.float()
        if engine.sequence is not None:
            return engine.sequence.loss(logits, labels)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    if engine.sequence is not None:
        return engine.sequence.tiled_loss(engine.sequence.hidden_states(engine, **inputs), head, labels, run.tiles)
    return tiled_loss(final_hidden_states(engine, **inputs), head, labels, run.tiles, None)


def train_all(rank: int, world_size: int) -> dict:
    return {run.name: train(run) for run in RUNS}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(train_all, WORLD, timeout=300)


@pytest.mark.parametrize("run", TILED, ids=lambda run: run.name)
def test_tiled_mlp_and_loss_train_as_untiled(ranks: list[dict], run: Run) -> None:
    for out in ranks:
        got, expected = out[run.name], out[run.untiled.name]
        assert got["mlps"] == 2  # one per decoder layer
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=LOSS_RTOL,
                                   atol=0)
        for name, value in expected["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)


# --- in one process ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def one_thread() -> None:
    """Tiny products on a busy 2-core machine: torch's thread pool waits on its threads (a 3 ms forward took 220 ms
    under a load of 3), so the in-process tests compute on one, as the spawned ranks do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def shifted(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in model.named_parameters()}


def test_tile_mlp_patches_the_instances_and_tiling_again_replaces_it() -> None:
    model, other = llama(), llama()
    assert tile_mlp(model, 3) == 2 and tile_mlp(model, 2) == 2
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.forward, TiledForward) and mlp.forward.tiles == 2
    assert not isinstance(mlp.forward.forward, TiledForward)  # the original, not a tiling of a tiling
    assert not isinstance(other.model.layers[0].mlp.forward, TiledForward)  # the class is untouched
    tile_mlp(model, 1)
    assert "forward" not in vars(mlp)  # the class's forward again


def test_without_mlps_or_with_bad_tiles_it_refuses_in_one_line() -> None:
    with pytest.raises(ValueError, match="Linear has no MLP module to tile"):
        tile_mlp(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="tiles=0"):
        tile_mlp(llama(), 0)


def test_tiled_loss_of_one_rank_is_the_mean_over_targets_with_the_same_gradients() -> None:
    """In one process, group None: the mean over the targets, as cross_entropy takes it; rows longer than the
    tiles (5 tiles of 32 tokens)."""
    model, tiled = llama(), llama()
    tile_mlp(tiled, 5)
    batch = replica_batch(0, 0)
    logits = model(input_ids=batch["input_ids"]).logits.float()
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted(batch).reshape(-1))
    expected.backward()
    loss = tiled_loss(final_hidden_states(tiled, input_ids=batch["input_ids"]), tiled.lm_head, shifted(batch), 5, None)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=LOSS_RTOL, atol=0)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grads(tiled)[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_deepspeeds_tiled_mlp_and_fused_logits_loss_give_the_untiled_loss_and_gradients() -> None:
    """DeepSpeed's call forms, as its docstrings write them: TiledMLP in the MLP's forward, TiledFusedLogitsLoss
    ("sum" of per-part sums, and "mean" of per-part means over parts of equal size) and sequence_tiled_compute."""
    model = llama()
    batch = replica_batch(0, 0)
    labels = shifted(batch)
    logits = model(input_ids=batch["input_ids"]).logits.float()
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    expected.backward()
    for form in ("TiledMLP", "sum", "mean", "sequence_tiled_compute", "SequenceTiledCompute"):
        tiled = deepspeed_form(form, batch, labels)
        torch.testing.assert_close(tiled["loss"], expected, rtol=LOSS_RTOL, atol=0, msg=form)
        for name, grad in grads(model).items():
            torch.testing.assert_close(tiled["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=f"{form} {name}")


def deepspeed_form(form: str, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> dict:
    """The summed loss and the gradients of the small Llama with DeepSpeed's tiled compute in `form`."""
    model = llama()
    if form == "TiledMLP":
        for layer in model.model.layers:
            layer.mlp.forward = functools.partial(TiledMLP.apply, mlp_forward, layer.mlp, shards=3,
                                                  compute_params=list(layer.mlp.parameters()))
    hidden = final_hidden_states(model, input_ids=batch["input_ids"])
    targets = (labels != IGNORE_INDEX).sum()
    if form == "sum":
        loss = TiledFusedLogitsLoss.apply(summed_loss, model, hidden, labels, None, 3, [model.lm_head.weight], "sum")
    elif form in ("mean", "TiledMLP"):  # 2 parts of 16 rows each; the mask leaves each part 13 of them
        loss = TiledFusedLogitsLoss.apply(mean_loss, model, hidden, labels, None, 2, [], "mean") * targets
    elif form == "sequence_tiled_compute":
        loss = sequence_tiled_compute(summed_loss_of, labels.shape[1], 3, {"x": hidden, "y": labels},
                                      {"self": model}, "x", None, 0, "sum")
    else:
        loss = SequenceTiledCompute.apply(summed_loss_of, labels.shape[1], 3, ["x", "y"], ["self"], "x", None, 0,
                                          "sum", hidden, labels, model)
    loss.backward()
    return {"loss": loss, "grads": grads(model)}


def mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def summed_loss(self: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = self.lm_head(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")


def summed_loss_of(self: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return summed_loss(self, x, y)


def mean_loss(self: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return summed_loss(self, x, y) / (y != IGNORE_INDEX).sum()


# --- memory ------------------------------------------------------------------------------------------
# [Note: measuring a CPU forward's peak]
# torch has no peak counter for its CPU allocator, and tracemalloc does not see its tensors. The process's peak
# resident size (VmHWM in /proc/self/status) does, once glibc hands each freed large block back at once
# (MALLOC_MMAP_THRESHOLD_, as tests/test_forward_only.py sets it: otherwise freed blocks stay in the heap and the next
# run reuses them unseen); writing 5 to /proc/self/clear_refs starts a new peak. Each configuration is measured in a
# fresh interpreter, on one thread, after a warm-up run that pays the one-time allocations.
MEMORY_SHAPE = (16384, 1024, 64, 128)  # vocabulary, tokens, hidden, intermediate: logits of 64 MiB in fp32
LOSS_TILES = 8  # 8 MiB of logits a slice


def peak_growths_mib(vocab: int, tokens: int, hidden: int, intermediate: int,
                     tilings: list[tuple[int, int]]) -> list[float]:
    """The peak resident growth of one forward and backward of a one-layer Llama, for each (loss tiles, MLP tiles)
    in `tilings` (See [Note: measuring a CPU forward's peak]); loss tiles 0: the loss from the whole logits."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=tokens, attn_implementation="sdpa"))
    input_ids = torch.randint(0, vocab, (1, tokens))
    labels = F.pad(input_ids, (0, 1), value=IGNORE_INDEX)[:, 1:]

    def forward_backward(loss_tiles: int, mlp_tiles: int) -> None:
        tile_mlp(model, mlp_tiles)
        if loss_tiles:
            hidden_states = final_hidden_states(model, input_ids=input_ids)
            loss = tiled_loss(hidden_states, model.lm_head, labels, loss_tiles, None)
        else:
            logits = model(input_ids=input_ids).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)

    forward_backward(*tilings[0])  # the warm-up
    growths = []
    for tiling in tilings:
        Path("/proc/self/clear_refs").write_text("5")
        before = resident_kib("VmHWM")
        forward_backward(*tiling)
        growths.append((resident_kib("VmHWM") - before) / 1024)
    return growths


def resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured(shape: tuple[int, ...], tilings: list[tuple[int, int]]) -> list[float]:
    """peak_growths_mib in a fresh interpreter (See [Note: measuring a CPU forward's peak])."""
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "PYTHONDONTWRITEBYTECODE": "1"}
    arguments = [*map(str, shape), *(f"{loss}x{mlp}" for loss, mlp in tilings)]
    result = subprocess.run([sys.executable, __file__, *arguments], capture_output=True, text=True, env=environment,
                            timeout=120, check=True)
    return [float(line.split()[-1]) for line in result.stdout.splitlines()]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_the_tiled_loss_holds_a_slice_of_the_logits_not_the_whole() -> None:
    """The whole logits (64 MiB) are held three times over untiled (the logits, their log-softmax, their gradient):
    measured 261 MiB of peak growth; tiled 8 ways, 33-42 MiB. Asserted: untiled at least 2 x 64 MiB, tiled under a
    third of it."""
    untiled, tiled = measured(MEMORY_SHAPE, [(0, 1), (LOSS_TILES, 1)])
    assert untiled >= 128, untiled
    assert tiled < untiled / 3, (tiled, untiled)


if __name__ == "__main__":  # VOCAB TOKENS HIDDEN INTERMEDIATE LOSSxMLP... (tiles; loss 0: untiled), one line each
    tilings = [tuple(map(int, tiling.split("x"))) for tiling in sys.argv[5:]]
    for tiling, growth in zip(tilings, peak_growths_mib(*map(int, sys.argv[1:5]), tilings)):
        print(f"loss tiles {tiling[0]}, MLP tiles {tiling[1]}: peak growth (MiB) {growth:.1f}")
