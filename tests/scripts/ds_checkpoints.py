"""Real DeepSpeed writes ZeRO checkpoints for tests/test_deepspeed_import.py: a tiny model with a frozen
parameter, a buffer, two param groups and a tied weight, trained a few steps at each (stage, precision) of a
sweep inside one launch (a launch costs seconds on 2 cores), saved, then trained on so that a resumed run can
be compared with DeepSpeed's own continuation.

    zerokit.testing.spawn.spawn(ds_checkpoints.write_all, 2, root, [(2, "fp32"), (3, "bf16")])

Per case, under root/stage{S}_{precision}_w{N}/: the checkpoint (save_dir with `latest`), `reference.pt` (rank 0:
DeepSpeed's get_fp32_state_dict_from_zero_checkpoint of it), `moments.pt` (each parameter's Adam state as
safe_get_full_optimizer_state gathers it from the live engine) and `continued.pt` (each rank's losses of the
steps after the save, and the consolidated fp32 weights they end at).
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQUENCE, BATCH = 37, 11, 9, 3  # odd sizes: DeepSpeed pads
STEPS_BEFORE, STEPS_AFTER = 3, 2


class TiedModel(nn.Module):
    """Embedding tied to the head, a frozen projection, a trainable block, a LayerNorm and a buffer; odd sizes
    so that DeepSpeed pads its flat groups and partitions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(3 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embed(tokens[:, :-1]))
        x = x * self.scale.to(x.dtype)  # DeepSpeed casts parameters to bf16, not buffers
        x = x + self.out(F.gelu(self.body(x)))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def build_model(seed: int = 7) -> TiedModel:
    torch.manual_seed(seed)
    return TiedModel()


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups with their own hyperparameters: matrices decay, vectors do not."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in trainable if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for _, p in trainable if p.dim() <= 1], "weight_decay": 0.0, "lr": 3e-3}]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1), generator=generator)


def ds_config(stage: int, precision: str) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 2**30,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 4, "warmup_type": "linear"}}}


def _deepspeed_comm() -> None:
    import deepspeed

    import zerokit.testing.deepspeed_peer  # noqa: F401  (no shared-memory op built: See its Note)

    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))  # its engine reads these
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo")


def train(engine, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        loss = engine(batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_optimizer_state(engine) -> dict[str, dict[str, torch.Tensor]] | None:
    """Each trainable parameter's whole Adam state, as DeepSpeed's own API gathers it from the live engine; None
    at stages 1-2, where on 0.19.8 that API raises "exp_avg not found in optimizer state fragment" on the ranks
    without a fragment of the parameter, leaving the others in its collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    if engine.zero_optimization_stage() < 3:
        return None
    return {name: {key: safe_get_full_optimizer_state(p, key).clone() for key in ("exp_avg", "exp_avg_sq")}
            for name, p in engine.module.named_parameters() if p.requires_grad}


def write_case(root: Path, stage: int, precision: str, rank: int, world_size: int) -> None:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    case = root / f"stage{stage}_{precision}_w{world_size}"
    model = build_model()
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model),
                                          config=ds_config(stage, precision))
        train(engine, range(STEPS_BEFORE), rank)
        engine.save_checkpoint(str(case / "ckpt"), client_state={"epoch": 4, "note": "from deepspeed"})
        dist.barrier()
        moments = full_optimizer_state(engine)  # a collective at stage 3: every rank calls it
        if rank == 0:
            torch.save(get_fp32_state_dict_from_zero_checkpoint(str(case / "ckpt")), case / "reference.pt")
            torch.save(moments, case / "moments.pt")
        losses = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank)
        engine.save_checkpoint(str(case / "after"))
        dist.barrier()
        if rank == 0:
            torch.save(get_fp32_state_dict_from_zero_checkpoint(str(case / "after")), case / "continued.pt")
    torch.save(losses, case / f"continued_losses_rank{rank}.pt")
    dist.barrier()


def write_all(rank: int, world_size: int, root: str, cases: list[tuple[int, str]]) -> None:
    """Each (stage, precision) of `cases`, one DeepSpeed engine after another in this launch."""
    _deepspeed_comm()
    for stage, precision in cases:
        write_case(Path(root), stage, precision, rank, world_size)
