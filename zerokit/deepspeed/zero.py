"""`deepspeed.zero` for zerokit: `zero.Init` (build a model without holding it) and `zero.GatheredParameters`
(full parameters for a while).

[Note: zero.Init is meta construction]
DeepSpeed's zero.Init runs each module's constructor for real and partitions its parameters as soon as the
module is built, broadcasting rank 0's values. zerokit builds the model on the meta device instead (shapes
only, no memory), and initialize() at stage 3 materialises it one unit at a time (See [Note: sharded
construction] in zerokit/stages/construction.py): each module's parameters come from its reset_parameters(),
or from `param_init=` given to initialize(), run with the same seed on every rank (zerokit checks that the
ranks agree). So a constructor's own initialisation (`self.apply(self._init_weights)`) does not run under
zero.Init: pass it as param_init, or load weights with zerokit.safetensors_init. A config given to zero.Init
whose stage is not 3 turns it off (the model is built as usual), since only stage 3 never holds the whole model.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from zerokit.config import load_config

logger = logging.getLogger("zerokit")


class Init:
    """Context manager: modules built inside have their parameters on the meta device until initialize()
    materialises them at stage 3. See [Note: zero.Init is meta construction]."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        _refuse_unoffered(remote_device, mpu, zero_param_parallel_group, sequence_data_parallel_group,
                          zero_quantized_weights or zero_quantized_nontrainable_weights, param_swapper)
        source = config_dict_or_path if config_dict_or_path is not None else config
        stage = load_config(source).stage if source is not None else 3
        if enabled and stage != 3:
            logger.info(f"zero.Init: zero_optimization.stage={stage} holds whole parameters, so the model is built "
                        "as usual")
        # An already built `module` needs nothing here: initialize() shards it.
        self.enabled = enabled and stage == 3 and module is None
        self._device: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> "Init":
        if self.enabled:
            self._device = torch.device("meta")
            self._device.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None


def _refuse_unoffered(remote_device: str | None, mpu: Any, param_group: Any, sequence_group: Any, quantized: bool,
                      swapper: Any) -> None:
    if remote_device not in (None, "none"):
        raise ValueError(f"zero.Init(remote_device={remote_device!r}) is not offered: set "
                         "zero_optimization.offload_param.device in the config instead")
    if any(item is not None for item in (mpu, param_group, sequence_group)):
        raise ValueError("zero.Init(mpu=/zero_param_parallel_group=/sequence_data_parallel_group=) asks for model "
                         "or sequence parallelism, which zerokit does not offer (it shards over all ranks)")
    if quantized:
        raise ValueError("zero.Init(zero_quantized_weights=True) asks for ZeRO++ quantized weights, which zerokit "
                         "does not offer")
    if swapper is not None:
        raise ValueError("zero.Init(param_swapper=...) asks for DeepSpeed's NVMe swapper; zerokit's offload is set "
                         "in the config")


@contextlib.contextmanager
def GatheredParameters(params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,  # noqa: N802
                       fwd_module: nn.Module | None = None, enabled: bool = True) -> Iterator[None]:
    """Inside, `params` hold their full values (zerokit's engine.unsharded). With `modifier_rank`, what that
    rank changed in place is broadcast to every rank on exit and kept, fp32 masters included, as in DeepSpeed.
    Parameters no engine manages (before initialize(), or of another model) are left as they are."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    engine = _engine_of(params) if enabled and params else None
    if engine is None:
        yield
        return
    with engine.unsharded(params, write_back=modifier_rank is not None):
        try:
            yield
        finally:
            if modifier_rank is not None:
                with torch.no_grad():
                    for param in params:
                        engine.comm.broadcast(param.data, src=modifier_rank)


def _engine_of(params: list[torch.Tensor]) -> Any:
    from zerokit.deepspeed.engine import live_engines

    wanted = {id(param) for param in params}
    for engine in live_engines():
        if wanted & {id(param) for param in engine.module.parameters()}:
            return engine
    return None


OUT_OF_SCOPE = {
    "register_external_parameter": "stage 3 finds parameters used outside their module through its units",
    "unregister_external_parameter": "stage 3 finds parameters used outside their module through its units",
    "MiCS_Init": "MiCS hierarchical sharding",
    "TiledLinear": "DeepSpeed's tiled linear layer",
    "TiledLinearReturnBias": "DeepSpeed's tiled linear layer",
}


def __getattr__(name: str) -> Any:
    if name in OUT_OF_SCOPE:
        raise ImportError(f"deepspeed.zero.{name} is not offered by zerokit: {OUT_OF_SCOPE[name]}")
    raise AttributeError(f"module 'zerokit.deepspeed.zero' has no attribute {name!r}; it offers Init and "
                         "GatheredParameters")


__all__ = ["Init", "GatheredParameters"]
