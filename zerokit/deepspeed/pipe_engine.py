"""DeepSpeed's PipelineEngine on zerokit: what deepspeed.initialize(model=PipelineModule(...)) returns. It trains
the module with zerokit.pipeline (torch's 1F1B schedule; a zerokit engine over each stage's data group), so at
ZeRO-1 as DeepSpeed does and at ZeRO-2 and ZeRO-3, which DeepSpeed refuses.

train_batch(data_iter) pulls gradient_accumulation_steps (inputs, labels) micro-batches from the iterator on the
first stage (inputs) and the last (labels), as DeepSpeed's does, runs them through the schedule and steps; it
returns DeepSpeed's loss: the last stage's mean over the micro-batches, averaged over the replicas, on every rank.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from zerokit.config.typed import ZeroConfig
from zerokit.deepspeed.pipe import PipelineModule, PipelineParallelGrid
from zerokit.pipeline import initialize as initialize_pipeline


class PipelineEngine:
    def __init__(self, module: PipelineModule, optimizer: Any, config: ZeroConfig | dict, model_parameters: Any = None,
                 training_data: Any = None, collate_fn: Any = None) -> None:
        if model_parameters is not None and optimizer is not None:
            model_parameters = None  # the optimizer already holds them
        self.module = module
        loss_fn = module.loss_fn if module.loss_fn is not None else _output_is_the_loss
        # DeepSpeed's train_batch takes its micro-batches as the data iterator yields them, whatever the config's size
        self.pipe = initialize_pipeline(module, optimizer, config, module.layout, schedule="1F1B", loss_fn=loss_fn,
                                        tied=module.tied_weights, micro_batch_from="batch")
        self.engine = self.pipe.engine
        self.optimizer = self.engine.optimizer
        self.grid: PipelineParallelGrid = module.mpu()
        self.mpu = self.grid
        self.global_steps = 0
        self.micro_batches = self.pipe.micro_batches
        self.data_iterator: Iterator | None = None
        self.batch_fn = None
        self.last_result = None
        self.training_dataloader = None
        if training_data is not None:  # DeepSpeed's: the replica's share, in order, repeated for ever
            self.training_dataloader = _replica_loader(training_data, self.grid, self.train_micro_batch_size_per_gpu(),
                                                       collate_fn)
            self.data_iterator = iter(self.training_dataloader)

    # --- DeepSpeed's pipeline calls ------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.pipe.is_first_stage()

    def is_last_stage(self) -> bool:
        return self.pipe.is_last_stage()

    @property
    def stage_id(self) -> int:
        return self.pipe.stage_index

    @property
    def num_stages(self) -> int:
        return self.pipe.num_stages

    def set_dataiterator(self, iterator: Iterator) -> None:
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Any) -> None:
        self.batch_fn = fn

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches of `data_iter`; DeepSpeed's loss."""
        self.module.train()
        inputs, labels = self._load(data_iter)
        done = self.pipe.train_step(inputs, labels)
        self.last_result = done.result
        if done.result.stepped:
            self.global_steps += 1
        return done.loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None
                   ) -> torch.Tensor:
        """The mean loss over gradient_accumulation_steps micro-batches of `data_iter`, without gradients."""
        if return_logits or not compute_loss or reduce_output != "avg" or num_micro_batches not in (None,
                                                                                                  self.micro_batches):
            raise ValueError("eval_batch is offered with its defaults only (return_logits=False, compute_loss=True, "
                             "reduce_output='avg', num_micro_batches=gradient_accumulation_steps)")
        self.module.eval()
        inputs, labels = self._load(data_iter)
        loss = self.pipe.eval_step(inputs, labels)
        self.module.train()
        return loss

    def _load(self, data_iter: Iterator | None) -> tuple[Any, Any]:
        """The step's micro-batches, as DeepSpeed loads them (the first stage's inputs, the last stage's labels),
        concatenated along the batch dimension for torch's schedule to split again."""
        if data_iter is not None:
            self.data_iterator = data_iter
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        if self.data_iterator is None:
            raise ValueError("train_batch needs a data iterator: train_batch(data_iter=iter(loader)) or "
                             "deepspeed.initialize(training_data=...)")
        batches = [next(self.data_iterator) for _ in range(self.micro_batches)]
        if self.batch_fn is not None:
            batches = [self.batch_fn(batch) for batch in batches]
        inputs = _concatenated([b[0] for b in batches]) if self.is_first_stage() else None
        labels = _concatenated([b[1] for b in batches]) if self.is_last_stage() else None
        return inputs, labels

    # --- what the engine reports -----------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.engine.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.engine.config.gradient_accumulation_steps

    def get_global_grad_norm(self) -> float | None:
        return None if self.last_result is None else self.last_result.grad_norm

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def comm_stats(self) -> dict[str, Any]:
        """zerokit's: this rank's collectives and the activations it sent (See
        zerokit.pipeline.PipelineEngine.comm_stats)."""
        return self.pipe.comm_stats()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters, whole, on CPU."""
        return self.engine.full_state_dict()

    def save_checkpoint(self, save_dir: Any, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> bool:
        """Each stage's zerokit checkpoint under save_dir/stage<s> (zerokit.pipeline's save_checkpoint); not
        DeepSpeed's layer files."""
        return self.pipe.save_checkpoint(save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: Any, tag: str | None = None, **ignored: Any) -> tuple[str, dict | None]:
        return self.pipe.load_checkpoint(load_dir, tag)

    def destroy(self) -> None:
        self.pipe.close()


def _replica_loader(data: Any, grid: PipelineParallelGrid, micro_batch: int, collate_fn: Any) -> Any:
    """As DeepSpeed's PipelineEngine builds it from training_data: a DistributedSampler over the data-parallel
    replicas (shuffle=False), micro-batches, a RepeatingLoader."""
    from torch.utils.data import DataLoader, DistributedSampler

    from zerokit.deepspeed.utils import RepeatingLoader
    sampler = DistributedSampler(data, num_replicas=grid.get_data_parallel_world_size(),
                                 rank=grid.get_data_parallel_id(), shuffle=False)
    return RepeatingLoader(DataLoader(data, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn))


def _output_is_the_loss(output: torch.Tensor, labels: Any) -> torch.Tensor:
    """Without a loss_fn DeepSpeed takes the last stage's output as the loss."""
    return output


def _concatenated(parts: list[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
