"""`deepspeed.zero` for zerokit: `zero.Init` (build a model without holding it) and `zero.GatheredParameters`
(full parameters for a while).

[Note: zero.Init is meta construction]
DeepSpeed's zero.Init runs each module's constructor for real and partitions its parameters as soon as the
module is built, broadcasting rank 0's values. zerokit moves each parameter to the meta device as its module
registers it (shapes only; one layer's parameters exist for a moment), and initialize() at stage 3
materialises them one unit at a time (See [Note: sharded construction] in zerokit/stages/construction.py):
each module's parameters come from its reset_parameters(), or from `param_init=` given to initialize(), run
with the same seed on every rank (zerokit checks that the ranks agree). Buffers stay as the constructor made
them: a rotary embedding's inv_freq is computed there and is in no checkpoint. So a constructor's own
initialisation of parameters (`self.apply(self._init_weights)`) does not run under zero.Init: pass it as
param_init, or load weights with zerokit.safetensors_init, or write them through GatheredParameters (below).
A config given to zero.Init whose stage is not 3 turns it off (the model is built as usual), since only stage
3 never holds the whole model.

[Note: writing through GatheredParameters before initialize]
Hugging Face's from_pretrained (and its weight initialisation) under a stage-3 config builds the model inside
zero.Init, then, module by module, enters GatheredParameters(params, modifier_rank=0) and has rank 0 copy the
pretrained tensors in. Parameters still on the meta device cannot hold what is written, so entering with a
modifier_rank gives them real storage in place (torch.utils.swap_tensors: the same Parameter objects, so
ties and optimizer groups hold), filled with NaN so that a parameter nobody writes shows in the first loss
instead of training from garbage; on exit the modifier's values are broadcast to every rank. initialize()
then shards these parameters as those of a model built normally, and materialises only those still on meta.
Until initialize(), each rank holds the written parameters whole (host memory: the model's size); to load a
checkpoint one unit at a time instead, pass param_init=zerokit.safetensors_init(model, path) to initialize().

[Note: pairing written parameters across ranks]
On exit from GatheredParameters(params, modifier_rank=...) before initialize(), each written parameter is one
broadcast, and broadcasts pair by the order each rank issues them; the order callers list `params` in is not
the same on every rank (transformers builds such a list from a set, which orders by id()). So they are
broadcast in the order zero.Init registered them: every rank runs the same constructors, so the n-th parameter
registered is the same one everywhere. That order is kept in a table beside the parameters, keyed by id() and
checked on use against the module that registered the parameter under its name (an id reused by another
object after a model is gone is then not mistaken for it), never as an attribute on the Parameter, and not by
weak reference to it, which torch.utils.swap_tensors refuses. Two or more written parameters that zero.Init
did not build cannot be paired, and are refused.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from zerokit.comm import Communicator
from zerokit.config.typed import ZeroConfig, load_config
from zerokit.deepspeed.config_view import config_dict
from zerokit.deepspeed.zero3_params import is_whole
from zerokit._support.log import logger


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
        stage = stage_of(source) if source is not None else 3
        if enabled and stage != 3:
            logger.info(f"zero.Init: zero_optimization.stage={stage} holds whole parameters, so the model is built "
                        "as usual")
        # An already built `module` needs nothing here: initialize() shards it.
        self.enabled = enabled and stage == 3 and module is None
        self._device: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> "Init":
        if self.enabled:
            self._device = ParametersOnMeta()
            self._device.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None


class ParametersOnMeta(contextlib.AbstractContextManager):
    """While entered, a parameter registered on a module is moved to the meta device; buffers and other tensors
    stay where they are made. See [Note: zero.Init is meta construction]."""

    def __enter__(self) -> "ParametersOnMeta":
        self.original = nn.Module.register_parameter
        original = self.original

        def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta:
                param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            original(module, name, param)
            if param is not None:
                BUILD_ORDER.register(module, name, param)

        nn.Module.register_parameter = register_parameter
        return self

    def __exit__(self, *exc: Any) -> None:
        nn.Module.register_parameter = self.original


class Registration(NamedTuple):
    module: "weakref.ReferenceType[nn.Module]"
    name: str  # the parameter's name in `module`
    position: int  # how many parameters zero.Init registered before it, in this process


class BuildOrder:
    """The order in which zero.Init registered each parameter: the same on every rank, whatever order a caller
    lists parameters in. See [Note: pairing written parameters across ranks]."""

    def __init__(self) -> None:
        self._registrations: dict[int, Registration] = {}  # by id(parameter)
        self._registered_in: dict[int, list[int]] = {}  # id(module) -> id(parameter)s, forgotten when it goes
        self._counter = itertools.count()

    def register(self, module: nn.Module, name: str, param: nn.Parameter) -> None:
        if self.position(param) is not None:  # a tied parameter registered again keeps its first place
            return
        if id(module) not in self._registered_in:
            self._registered_in[id(module)] = []
            weakref.finalize(module, self._forget, id(module)).atexit = False  # nothing to tidy at exit
        self._registered_in[id(module)].append(id(param))
        self._registrations[id(param)] = Registration(weakref.ref(module), name, next(self._counter))

    def position(self, param: torch.Tensor) -> int | None:
        """Where `param` was registered, or None if zero.Init did not register it."""
        registration = self._registrations.get(id(param))
        if registration is None:
            return None
        module = registration.module()
        if module is None or module._parameters.get(registration.name) is not param:
            return None  # another object now has the id of a parameter that is gone, or it was replaced
        return registration.position

    def sorted(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """`params` in the order they were registered; at most one not registered, put last."""
        unregistered = [param for param in params if self.position(param) is None]
        if len(unregistered) > 1:
            raise ValueError(f"GatheredParameters(modifier_rank=...) before initialize() was given "
                             f"{len(unregistered)} meta parameters not built under deepspeed.zero.Init, which cannot "
                             "be paired across ranks; build the model inside zero.Init")
        registered = sorted((param for param in params if self.position(param) is not None), key=self.position)
        return registered + unregistered

    def _forget(self, module_id: int) -> None:
        """A module is gone (its weak references are cleared by now): drop what it registered."""
        for param_id in self._registered_in.pop(module_id, []):
            registration = self._registrations.get(param_id)
            if registration is not None and registration.module() is None:
                del self._registrations[param_id]


BUILD_ORDER = BuildOrder()


def stage_of(source: Any) -> int:
    """The config's ZeRO stage, and nothing else of it: Hugging Face's from_pretrained hands zero.Init the config
    before its Trainer fills the "auto" values in, some of which zerokit cannot fill alone (a schedule's
    total_num_steps), and initialize() reads the whole config later anyway."""
    if isinstance(source, ZeroConfig):
        return source.stage
    zero = config_dict(source).get("zero_optimization") or {}
    return load_config({"zero_optimization": {"stage": zero.get("stage", 0)}}).stage


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
    if enabled and modifier_rank is None and params and all(is_whole(param) for param in params):
        yield  # already whole (in their unit's forward or backward, say): nothing to gather, nothing to write back
        return
    engine = _engine_of(params) if enabled and params else None
    if engine is None:
        with _written_before_initialize(params if enabled else [], modifier_rank):
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


# Parameters given storage by _written_before_initialize: a later write (from_pretrained after the weight
# initialisation) is broadcast from its modifier too. Weak: the set ends with the model.
_HELD: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()  # by id


@contextlib.contextmanager
def _written_before_initialize(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    """Meta parameters get NaN-filled storage to be written into, and the modifier's values reach every rank on
    exit. See [Note: writing through GatheredParameters before initialize]."""
    if modifier_rank is None:
        yield
        return
    written = BUILD_ORDER.sorted(list({id(param): param for param in params
                                       if param.is_meta or _HELD.get(id(param)) is param}.values()))
    for param in written:
        if param.is_meta:
            held = nn.Parameter(torch.full(param.shape, float("nan"), dtype=param.dtype),
                                requires_grad=param.requires_grad)
            held.__dict__.update(param.__dict__)  # swapped too: keep what callers set (_is_hf_initialized)
            torch.utils.swap_tensors(param, held)
            _HELD[id(param)] = param
    yield
    if written and dist.is_initialized() and dist.get_world_size() > 1:
        comm = Communicator(None, name="before initialize")  # the default group: no engine has one of its own yet
        with torch.no_grad():
            for param in written:  # See [Note: pairing written parameters across ranks]
                comm.broadcast(param.data, src=modifier_rank, purpose="a parameter written before initialize()")


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
