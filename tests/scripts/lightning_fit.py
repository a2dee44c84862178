"""A Lightning fit of the token model of common.py, as a user writes one (issue 23). Launched by
tests/test_lightning.py under torchrun on 2 gloo ranks:

    torchrun --nproc_per_node 2 lightning_fit.py --out DIR --strategy ddp            # Lightning's DDP
    torchrun --nproc_per_node 2 lightning_fit.py --out DIR --strategy object:2       # ZerokitStrategy(config=...)
    torchrun --nproc_per_node 2 lightning_fit.py --out DIR --strategy zerokit_stage_3  # the registered name

Training: 2 epochs of 12 micro-batches of 2 per rank in windows of 5, 5 and 2 (Lightning steps at an epoch's
last batch), gradient_clip_val=0.5 (it bites: the first norms are above 1), AdamW under a LinearLR warm-up stepped
by Lightning (a chainable schedule: it reads the optimizer's learning rate back), a validation pass per epoch.
Each rank writes DIR/rank{r}.json: the loss of every micro-batch, the grad norm and learning rate of every
optimizer step, the validation losses, what trained (strategy, engine class, stage, collectives), and with
--resume the same from a second Trainer resumed (fit(ckpt_path=...)) from the end of the first epoch. Rank 0
saves the final weights with trainer.save_checkpoint(DIR/weights.ckpt, weights_only=True).

--extra NAME[,NAME...] adds fits of their own after those, each a new Trainer: `configured` builds the model in
configure_model() (under ZerokitStrategy at stage 3: on the meta device, initialised by the engine with the
same name-seeded init the plain build applies), `bf16` and `fp16` train with precision="bf16-mixed" and
"16-mixed", and `cut` trains 3 epochs in windows of 4 (12 batches: a whole number of windows) whose second epoch
on_train_batch_start ends after 6 batches, inside a window that no step ends; it saves each epoch's end and a
second fit, "cut_resumed", resumes from the cut epoch's checkpoint (issue 31). Each writes what it trained beside
"run", under its own name.
"""

from __future__ import annotations

import argparse
import zlib

import torch
from torch import nn
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import grad_norm

from common import TokenModel, build_model, dataset, write_result

ACCUMULATION, MICRO_BATCH, CLIP, LR, EPOCHS = 5, 2, 0.5, 3e-3, 2
CUT = {"accumulation": 4, "epochs": 3, "epoch": 1, "after": 6}  # the `cut` fit: See the module docstring


class TokenLM(LightningModule):
    def __init__(self, cut_epoch_after: int | None = None) -> None:
        super().__init__()
        self.net = build_model()
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.cut_epoch_after = cut_epoch_after  # the `cut` fit: its second epoch ends after this many batches

    def on_train_batch_start(self, batch: list[torch.Tensor], index: int) -> int | None:
        if self.cut_epoch_after is not None and self.current_epoch == CUT["epoch"] and index == self.cut_epoch_after:
            return -1  # Lightning's way to end an epoch here
        return None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        loss = self(batch[0])
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        self.val_losses.append(self(batch[0]).item())

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=3)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(dataset(), batch_size=MICRO_BATCH, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        held_out = torch.utils.data.Subset(dataset(seed=7), range(8))
        return torch.utils.data.DataLoader(held_out, batch_size=MICRO_BATCH)


class NameSeededInit:
    """Each module's parameters drawn from a generator seeded by the module's name: the same values whichever order
    modules are initialised in (the plain build initialises them in construction order, stage 3 unit by unit)."""

    def __init__(self) -> None:
        self.names: dict[nn.Module, str] = {}

    def __call__(self, module: nn.Module) -> None:
        generator = torch.Generator().manual_seed(zlib.crc32(self.names[module].encode()))
        with torch.no_grad():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, nn.LayerNorm):
                    param.fill_(1.0 if name == "weight" else 0.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


INIT = NameSeededInit()


class ConfiguredTokenLM(TokenLM):
    """TokenLM whose model is built in configure_model(), as a model no rank may hold whole is."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        self.net: TokenModel | None = None
        self.losses, self.val_losses = [], []
        self.built_on_meta: bool | None = None
        self.cut_epoch_after = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = TokenModel()
        INIT.names = {module: f"net.{name}" for name, module in self.net.named_modules()}
        self.built_on_meta = all(param.is_meta for param in self.net.parameters())
        if not self.built_on_meta:  # the plain build: initialised here; at stage 3 the engine calls INIT
            for module in self.net.modules():
                INIT(module)


class StepRecorder(Callback):
    """Per optimizer step: the global grad norm before clipping (DDP: of the reduced gradients Lightning is about to
    clip; zerokit: the engine's, from its last step) and the learning rate it stepped with."""

    def __init__(self) -> None:
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: Trainer, module: LightningModule, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])
        if getattr(trainer.strategy, "engine", None) is None:
            self.grad_norms.append(grad_norm(module, norm_type=2)["grad_2.0_norm_total"].item())

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs, batch, index: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and engine.last_step is not None and engine.last_step.micro_step == \
                engine.progress.micro_step and engine.last_step.boundary:
            self.grad_norms.append(engine.last_step.grad_norm)


def strategy_of(spec: str):
    if spec.startswith("object:"):  # ZerokitStrategy(config=a DeepSpeed-style dict)
        from zerokit.integrations.lightning import ZerokitStrategy

        return ZerokitStrategy(config={"zero_optimization": {"stage": int(spec.split(":")[1])},
                                       "train_micro_batch_size_per_gpu": MICRO_BATCH}, param_init=INIT)
    if spec.startswith("zerokit_"):
        import zerokit.integrations.lightning  # noqa: F401  (registers the names)
    return spec


def precision_arguments(precision: str) -> dict:
    """Trainer(precision=...), but fp16 as a plugin: on a CPU, Lightning turns precision="16-mixed" into
    "bf16-mixed" before any strategy sees it, and zerokit runs fp16 there."""
    if precision != "16-mixed":
        return {"precision": precision}
    from zerokit.integrations.lightning import ZerokitPrecision

    return {"plugins": [ZerokitPrecision(precision)]}


def fit(args: argparse.Namespace, resume: str | None = None, extra: str | None = None) -> dict:
    torch.manual_seed(0)  # the shuffle's seed: every fit, extra or not, sees the batches in the same order
    cut = extra == "cut"
    module = ConfiguredTokenLM() if extra == "configured" else TokenLM(CUT["after"] if cut else None)
    recorder = StepRecorder()
    checkpoints = ModelCheckpoint(dirpath=f"{args.out}/checkpoints{'_cut' if cut else ''}", filename="epoch{epoch}",
                                  save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True,
                                  auto_insert_metric_name=False)
    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(extra or "", "32-true")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy_of(args.strategy),
                      max_epochs=CUT["epochs"] if cut else EPOCHS,
                      accumulate_grad_batches=CUT["accumulation"] if cut else ACCUMULATION, gradient_clip_val=CLIP,
                      callbacks=[recorder] + ([checkpoints] if extra in (None, "cut") else []),
                      **precision_arguments(precision),
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      deterministic=True, default_root_dir=args.out)  # Lightning's own checkpoints go there too
    trainer.fit(module, ckpt_path=resume)
    if resume is None and extra is None:
        trainer.save_checkpoint(f"{args.out}/weights.ckpt", weights_only=True)
    result = {"losses": module.losses, "grad_norms": recorder.grad_norms, "lrs": recorder.lrs,
              "val_losses": module.val_losses, "precision": precision, **facts(trainer)}
    if extra == "configured":
        result["built_on_meta"] = module.built_on_meta
    return result


def facts(trainer: Trainer) -> dict:
    """What trained: a silent fallback to DDP must be seen."""
    strategy = trainer.strategy
    result = {"strategy": type(strategy).__name__, "precision_plugin": type(strategy.precision_plugin).__name__}
    engine = getattr(strategy, "engine", None)
    if engine is not None:
        result.update(engine=f"{type(engine).__module__}.{type(engine).__qualname__}", stage=engine.config.stage,
                      param_dtype=str(engine.config.precision.param_dtype),
                      gradient_clipping=engine.config.gradient_clipping,
                      comm_calls={kind: counts["calls"] for kind, counts in engine.comm_stats().items()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--resume", action="store_true", help="then resume a second fit from the first epoch's end")
    parser.add_argument("--extra", default="", help="then these fits: configured, bf16, fp16, cut (comma-separated)")
    args = parser.parse_args()
    result = {"run": fit(args)}
    if args.resume:
        result["resumed"] = fit(args, resume=f"{args.out}/checkpoints/epoch0.ckpt")
    for extra in filter(None, args.extra.split(",")):
        result[extra] = fit(args, extra=extra)
        if extra == "cut":
            result["cut_resumed"] = fit(args, resume=f"{args.out}/checkpoints_cut/epoch{CUT['epoch']}.ckpt",
                                        extra="cut")
    write_result(args.out, torch.distributed.get_rank(), result)


if __name__ == "__main__":
    main()
