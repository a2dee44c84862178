"""The Hugging Face Trainer's save_model on a zerokit ZeRO-3 engine, streamed to disk as engine.save_pretrained writes.

[Note: the Trainer's save_model streams]
Under a ZeRO-3 config, transformers' Trainer.save_model builds the whole model's state dict on every rank
(accelerator.get_state_dict, which calls the engine's _zero3_consolidated_16bit_state_dict), then only the saving rank
goes on to model.save_pretrained(state_dict=...), which needs every tensor in memory: rank 0 holds the model once at
the compute precision (See [Note: the whole state dict at the compute precision] in
zerokit/deepspeed/module_view.py). A streamed write needs every rank inside the write, gathering unit after unit
while rank 0 appends their bytes, and the Trainer sends every rank but the saving one away before it. So, when
deepspeed.initialize is called with transformers' Trainer loaded, Trainer.save_model is wrapped once: for a model
trained on a zerokit engine at stage 3 (not a PEFT model, whose adapter alone the Trainer saves), it does what the
Trainer itself does when DeepSpeed cannot gather the weights (stage3_gather_16bit_weights_on_model_save false):
Trainer._save with an empty state dict writes the config, the tokenizer and the training arguments on the saving
rank, and remove_dummy_checkpoint takes away the empty weights file it leaves. Then, instead of DeepSpeed's
checkpoint, every rank calls engine.save_pretrained(output_dir), which writes the weights in the files and names
transformers' save_pretrained would (max_shard_size as its default), the same values, streamed one unit at a time.
The Trainer's own checkpoints (_save_checkpoint calls save_model) are written the same way. Any other model,
engine or stage goes through the Trainer's save_model unchanged.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

TRANSFORMERS_DEFAULT_SHARD = "50GB"  # PreTrainedModel.save_pretrained's max_shard_size in transformers 5


def stream_trainer_saves() -> None:
    """Wrap transformers' Trainer.save_model once, if the Trainer is loaded (See [Note: the Trainer's save_model
    streams]); nothing otherwise."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None or getattr(trainer_module.Trainer.save_model, "zerokit_streams", False):
        return
    original = trainer_module.Trainer.save_model

    @functools.wraps(original)
    def save_model(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not _streams(self, trainer_module):
            return original(self, output_dir, _internal_call)
        _save_streamed(self, trainer_module, output_dir if output_dir is not None else self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    save_model.zerokit_streams = True
    trainer_module.Trainer.save_model = save_model


def _streams(trainer: Any, trainer_module: Any) -> bool:
    """Whether this Trainer's model trains on a zerokit engine at stage 3, or with its experts split over ranks at any
    stage (the model's own state dict then holds this rank's experts only: See [Note: split experts gathered whole] in
    zerokit/parallel/experts/names.py), and is not a PEFT model."""
    from zerokit.deepspeed.engine import DeepSpeedEngine

    engine = getattr(trainer, "model_wrapped", None)
    return (getattr(trainer, "is_deepspeed_enabled", False) and isinstance(engine, DeepSpeedEngine)
            and (engine.zero_optimization_stage() == 3 or engine.expert_stage is not None)
            and not trainer_module._is_peft_model(trainer.model))


def _save_streamed(trainer: Any, trainer_module: Any, output_dir: str) -> None:
    """The Trainer's files but the weights, as it writes them without a state dict; then the weights, streamed."""
    trainer._save(output_dir, state_dict={})
    trainer_module.remove_dummy_checkpoint(trainer.args.should_save, output_dir,
                                           [trainer_module.WEIGHTS_NAME, trainer_module.SAFE_WEIGHTS_NAME])
    trainer.model_wrapped.save_pretrained(output_dir, max_shard_size=TRANSFORMERS_DEFAULT_SHARD)


__all__ = ["stream_trainer_saves"]
