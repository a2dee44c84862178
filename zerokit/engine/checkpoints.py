"""The engine's state and checkpoint calls (a mixin of Engine): its state dicts, where this rank's stage and tensor
rank save under the directory the caller names, and loading from any layout. See zerokit/checkpoint and [Note: a
checkpoint per stage and tensor rank, read as one] in zerokit/checkpoint/relayout.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from zerokit.checkpoint.locate import layout_directory
from zerokit.engine.state import engine_state_dict, load_engine_state
from zerokit.masters.optimizer import ELEMENTWISE, WHOLE_TENSOR
from zerokit.parallel.experts.names import unsplit_model, whole_places, without_experts
from zerokit.parallel.experts.share import expert_layers, split_experts_error
from zerokit.stages.view import ParameterView, Place, PlacedView, SplitView


class SplitCheckpointed:
    """The engine as checkpoints save and load it when its experts are split over ranks: the model's names and shapes
    without expert parallelism (`module`) and the SplitView of both stages (See [Note: split experts saved as the
    unsplit model's parameters] in zerokit/parallel/experts/names.py); everything else is the engine's, the progress
    a load sets included."""

    def __init__(self, engine: Any) -> None:
        kinds = [WHOLE_TENSOR if whole else ELEMENTWISE for whole in engine.view.whole_tensor]
        split = [(name, p) for name, p in engine.module.named_parameters() if id(p) in engine.experts.params]
        frozen = [name for name, p in split if not p.requires_grad]
        if frozen:
            raise ValueError(f"{frozen[0]} is a frozen expert split over ranks: a checkpoint saves split experts that "
                             "train; freeze them after loading, or train without expert parallelism")
        where = whole_places(engine.module)
        places = {name: Place(*where[id(p)]) for name, p in split}
        dense = ParameterView(engine.stage, without_experts(engine.module), kinds)
        experts = PlacedView(ParameterView(engine.expert_stage, engine.module, kinds), places)
        module, group = unsplit_model(engine.module), expert_layers(engine.module)[0].group
        self.__dict__.update(engine=engine, module=module, view=SplitView(dense, experts, module, group))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.engine, name, value)  # a load sets the engine's progress


class Checkpoints:
    """The state dicts, save_checkpoint and load_checkpoint of Engine (it uses the engine's stages, layout and
    _refuse_if_closed)."""

    tied_names: frozenset[str] = frozenset()  # parameters tied to copies on other pipeline stages (zerokit.pipeline)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU in fp32 (parameters at their compute precision), gathered
        one unit at a time at stage 3 so the extra peak is the largest unit, not the model."""
        if self.expert_stage is not None:  # See [Note: split experts gathered whole] in parallel/experts/names.py
            return self.checkpointed().view.full_state_dict()
        state = self.view.full_state_dict()
        return state if self.tensor is None else self.tensor.consolidate(state, self.module)  # whole tensors

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank holds that a resumed run needs: its shard of the model states (masters,
        optimizer, and at stage 3 the frozen shards), the loss scaler, the step counters, and the LR
        schedules the engine steps (when the config has a `scheduler` block)."""
        self._refuse_with_split_experts("state_dict")
        return engine_state_dict(self.stage, self.loss_scaler, self.progress, self.lr_schedules)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The inverse of state_dict(), on the same world size, stage and layout."""
        self._refuse_with_split_experts("load_state_dict")
        self.progress = load_engine_state(state, self.stage, self.loss_scaler, self.lr_schedules)

    def _refuse_with_split_experts(self, call: str) -> None:
        if self.expert_stage is not None:
            raise split_experts_error(f"engine.{call}()")

    def loaded_by(self, load_dir: str | Path, tag: str | None) -> Any:
        """What load_checkpoint loads into (checkpointed()): with split experts, only a checkpoint of zerokit's
        format, which holds the unsplit model's names."""
        from zerokit.checkpoint.load import foreign_format
        kind = foreign_format(load_dir, tag) if self.expert_stage is not None else None
        if kind:
            raise split_experts_error(f"engine.load_checkpoint() of a {kind} checkpoint")
        return self.checkpointed()

    def checkpointed(self, made: bool = True) -> Any:
        """What checkpoints save and load: the engine, or with experts split over ranks the engine seen as the unsplit
        model (SplitCheckpointed, made once; made=False: only if it was)."""
        if self.expert_stage is None:
            return self
        if "_split_checkpointed" not in self.__dict__ and made:
            self.__dict__["_split_checkpointed"] = SplitCheckpointed(self)
        return self.__dict__.get("_split_checkpointed", self)


    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, async_save: bool = False, within_window: bool = False,
                        format: str = "zerokit", asynchronous: bool | None = None) -> bool:
        """Save the whole training state under save_dir/tag (default global_step<N>), atomically, every rank its
        own shards; loadable at any world size and stage, and, from a pipeline or tensor-parallel layout (whose
        stages and tensor ranks save under save_dir/stage<s>/tensor<j>-of-<t>), into any other layout.
        async_save (or asynchronous; default: the config's checkpoint.async_save): return once a host copy is
        taken. within_window: save inside an accumulation window too, without its gradients, as DDP does (refused
        otherwise). format: "zerokit", or "dcp" (torch.distributed.checkpoint, which FSDP2 and torchtitan load).
        See zerokit/checkpoint and docs/checkpoints.md."""
        from zerokit.checkpoint import save_checkpoint
        self._refuse_if_closed("save_checkpoint")
        if self.expert_stage is not None and format != "zerokit":
            raise split_experts_error(f"engine.save_checkpoint(format={format!r})")
        background = async_save or (self.parts.checkpoint.async_save if asynchronous is None else asynchronous)
        return save_checkpoint(self.checkpointed(), layout_directory(save_dir, self.layout), tag, client_state,
                               save_latest=save_latest, async_save=background, within_window=within_window,
                               format=format)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, load_optimizer_states: bool = True,
                        load_module_only: bool = False, load_lr_scheduler_states: bool = True
                        ) -> tuple[str, dict[str, Any] | None]:
        """Resume from load_dir/tag (default: the tag in load_dir/latest), saved at any world size, stage and
        layout, by zerokit or DeepSpeed; returns (load_path, client_state). See zerokit/checkpoint."""
        from zerokit.checkpoint import load_checkpoint
        self._refuse_if_closed("load_checkpoint")
        return load_checkpoint(self.loaded_by(load_dir, tag), load_dir, tag,
                               load_optimizer_states=load_optimizer_states, load_module_only=load_module_only,
                               load_lr_scheduler_states=load_lr_scheduler_states)

    def save_pretrained(self, save_directory: str | Path, max_shard_size: int | str = "5GB",
                        safe_serialization: bool = True, dtype: Any = None) -> list[Path]:
        """Write what transformers' from_pretrained loads (every rank calls it; rank 0 writes): config.json when the
        model has a Hugging Face config, model.safetensors or shards of at most max_shard_size with their index,
        tied weights once, floating tensors as the engine computes with them (or in `dtype`). Streamed: at stage 3
        each unit is gathered in turn and its tensors written at once, so rank 0 never holds the model. Returns
        the files written (on rank 0). See [Note: save_pretrained streams] in zerokit/checkpoint/pretrained.py."""
        from zerokit.checkpoint.hf_layout import parse_size
        from zerokit.checkpoint.pretrained import output_dtype, save_pretrained
        self._refuse_if_closed("save_pretrained")
        if not safe_serialization:
            raise ValueError("save_pretrained(safe_serialization=False) is not offered: zerokit writes safetensors "
                             "files, which transformers loads by default (and 5.x writes only)")
        return save_pretrained(self.checkpointed(), save_directory, parse_size(max_shard_size, "max_shard_size"),
                               output_dtype(dtype))

    def load_pretrained(self, directory: str | Path) -> None:
        """Load a Hugging Face model directory (model.safetensors, or shards with their index) into the engine's
        parameters at any stage and world size (every rank calls it): each rank reads only the element ranges it
        holds, file by file; the optimizer state is left as it is. Keys missing or unexpected: a ValueError naming
        the first of each, and nothing loaded. See zerokit/checkpoint/pretrained.py."""
        from zerokit.checkpoint.pretrained import load_pretrained
        self._refuse_if_closed("load_pretrained")
        load_pretrained(self.checkpointed(), directory)
