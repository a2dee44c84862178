"""Ulysses attention for Hugging Face models: each rank holds a shard of the sequence; around the attention core, an
all-to-all gives each rank the whole sequence for a share of the heads, and another gives back its shard of the
sequence for every head. Everything outside attention works on the rank's shard alone.

[Note: Ulysses under transformers' attention interface]
transformers calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` with the query, key and value of the
rank's tokens, shaped (batch, heads, tokens, head_dim), and takes back (batch, tokens, heads, head_dim). `attach`
registers one function under ULYSSES, points the model's config at it and gives every attention module of the model
the state it runs with (its sequence group and the core it wraps: the model's own `sdpa`, `eager`, or a flash
implementation where installed). A name of its own, rather than replacing `sdpa` for the whole process as
DeepSpeed's register_with_transformers does, leaves every other model as it was; and transformers builds no mask
for a name without a mask function, which is right: the mask of the rank's tokens is not the mask of the whole
sequence. The core sees the whole sequence and is causal over it: sdpa by `is_causal`, eager by a causal mask made
here (eager adds whatever mask it gets and knows no other way). Packed sequences (positions that restart inside a
row) need a core that reads position ids; sdpa and eager attend across them, so they are for unpacked rows.

Heads: the query's are split evenly (a degree that does not divide them is refused); key and value heads too, and
where there are fewer of them than sequence ranks (grouped-query attention) each is repeated so that every rank has
the ones its query heads read, which needs the degree to be a multiple of their number. The core is handed the
module with the number of query heads per key head as this rank sees it.

[Note: position ids where a model makes them]
A shard's tokens sit at their places in the whole sequence, and a Hugging Face model called without position_ids
numbers the tokens it is given from 0: on a shard, the wrong positions, trained on without a word. So each Hugging
Face model (transformers' PreTrainedModel) holding the split attention, the model itself or the outermost ones inside a
module of the user's, refuses a forward without position_ids as a keyword. A pipeline stage that holds some of a
model's layers in a module of the user's gets no such check, and needs none: torch's schedule calls a stage with
positional arguments only, so a check of the keyword would refuse every call, and the layers make no positions of
their own (a Llama layer's attention cannot run without the rotary embeddings the stage computes from position ids
it makes itself: zerokit.parallel.sequence.shard_position_ids makes them from the layout's sequence index). A stage
that holds a whole Hugging Face model, pruned to its layers, keeps the check: that model would number from 0.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from zerokit.parallel.sequence.exchange import all_to_all

ULYSSES = "zerokit_ulysses"
STATE = "_zerokit_ulysses"
HEADS, TOKENS = 1, 2  # of the (batch, heads, tokens, head_dim) tensors transformers hands the core
OUT_TOKENS, OUT_HEADS = 1, 2  # of the (batch, tokens, heads, head_dim) tensor the core returns


@dataclass(frozen=True)
class UlyssesState:
    group: Any
    ranks: int
    core: Callable[..., tuple[torch.Tensor, Any]]
    causal_mask: bool  # the core is eager: it gets a causal mask over the whole sequence
    key_repeats: int  # each key/value head repeated this many times before the exchange (1: none)
    in_eval: bool = True  # False: in eval mode each rank attends over its whole sequences alone (keep_whole_in_eval)


class _LocalHeads:
    """The attention module as the core sees it on one rank: its query heads per key head as they are here."""

    def __init__(self, module: nn.Module, key_value_groups: int) -> None:
        self._module, self.num_key_value_groups = module, key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The function registered under ULYSSES (See [Note: Ulysses under transformers' attention interface])."""
    state: UlyssesState | None = getattr(module, STATE, None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} runs attention {ULYSSES!r} but was not attached to a sequence "
                           "group: build the model's engine with a sequence degree (zerokit/parallel/sequence)")
    if not module.training and not state.in_eval:
        return state.core(module, query, key, value, _causal_mask(query, key) if state.causal_mask else None, *args,
                          **kwargs)
    if state.key_repeats > 1:
        key, value = (t.repeat_interleave(state.key_repeats, dim=HEADS) for t in (key, value))
    query, key, value = (all_to_all(t, state.group, scatter_dim=HEADS, gather_dim=TOKENS) for t in (query, key, value))
    mask = _causal_mask(query, key) if state.causal_mask else None
    if kwargs.get("position_ids") is not None:  # the whole sequence's, as the core sees it (flash reads packing)
        kwargs["position_ids"] = _gathered(kwargs["position_ids"], state)
    local = _LocalHeads(module, query.shape[HEADS] // key.shape[HEADS])
    out, weights = state.core(local, query, key, value, mask, *args, **kwargs)
    return all_to_all(out, state.group, scatter_dim=OUT_TOKENS, gather_dim=OUT_HEADS), weights


def _gathered(position_ids: torch.Tensor, state: UlyssesState) -> torch.Tensor:
    parts = [torch.empty_like(position_ids) for _ in range(state.ranks)]
    dist.all_gather(parts, position_ids.contiguous(), group=state.group)
    return torch.cat(parts, dim=-1)


def _causal_mask(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """An additive mask over the whole sequence that hides later tokens, as eager attention adds masks."""
    tokens, keys = query.shape[TOKENS], key.shape[TOKENS]
    hidden = torch.ones(tokens, keys, dtype=torch.bool, device=query.device).triu(1 + keys - tokens)
    return torch.zeros(tokens, keys, dtype=query.dtype, device=query.device).masked_fill(
        hidden, torch.finfo(query.dtype).min)[None, None]


class _Plan(NamedTuple):
    """What attaching a model changes, found (and checked) before anything is changed."""
    attention: list[nn.Module]  # the modules transformers hands to the attention function
    core: Callable[..., tuple[torch.Tensor, Any]]
    causal_mask: bool
    key_repeats: int


def attach(model: nn.Module, group: Any, ranks: int, tensor: int = 1) -> None:
    """Run the model's attention as Ulysses over `group` (`ranks` sequence ranks); refused in one line where its
    heads or its attention implementation cannot be split. `model`: a Hugging Face model, or a module of the user's
    holding some of one's layers (a pipeline stage). `tensor`: the tensor degree the model's heads were split over
    first (a rank's attention holds 1 / tensor of them: See zerokit/parallel/tensor/autotp.py)."""
    from transformers import AttentionInterface
    plan = _plan(model, ranks, tensor)
    state = UlyssesState(group, ranks, plan.core, plan.causal_mask, key_repeats=plan.key_repeats)
    AttentionInterface.register(ULYSSES, ulysses_attention)
    for module in plan.attention:
        setattr(module, STATE, state)
    for each in _configs(model):
        each._attn_implementation = ULYSSES
    # See [Note: position ids where a model makes them]
    for hf_model in _outermost_hf_models(model, plan.attention):
        hf_model.register_forward_pre_hook(_require_position_ids, with_kwargs=True)


def check_attachable(model: nn.Module, ranks: int, tensor: int = 1) -> None:
    """Raise the ValueError `attach` would, changing nothing (a pipeline checks every stage before any is built)."""
    _plan(model, ranks, tensor)


def _plan(model: nn.Module, ranks: int, tensor: int) -> _Plan:
    attention = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    if not attention:
        raise ValueError(f"{type(model).__name__} has no Hugging Face attention module (one with "
                         "num_key_value_groups) for sequence parallelism to split; accepted: a Hugging Face model, "
                         "or a module holding some of its decoder layers (a pipeline stage: at least one)")
    config = _hf_config(model, attention)
    core, causal_mask = _core(model, config._attn_implementation)
    heads, key_heads = (count // tensor for count in _heads(config))
    _check_heads(heads, key_heads, ranks)
    return _Plan(attention, core, causal_mask, key_repeats=ranks // key_heads if key_heads < ranks else 1)


def keep_whole_in_eval(model: nn.Module) -> None:
    """In eval mode, each rank attends over the whole sequences it holds, with no exchange: for evaluation loops
    that give every rank whole sequences (DeepSpeed's disable_in_eval, which accelerate sets)."""
    for module in model.modules():
        state = getattr(module, STATE, None)
        if state is not None:
            setattr(module, STATE, replace(state, in_eval=False))


def _require_position_ids(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """A shard's tokens sit at their places in the whole sequence: without its position ids, the model would number
    them from 0 on every rank and train on wrong positions without a word (See [Note: position ids where a model
    makes them])."""
    states = (getattr(m, STATE) for m in module.modules() if hasattr(m, STATE))
    if not module.training and not next(states).in_eval:
        return
    if kwargs.get("position_ids") is None:
        raise ValueError(f"{type(module).__name__} is split over sequence ranks: pass each shard's position_ids (its "
                         "tokens' positions in the whole sequence), as engine.sequence.shard(batch) makes them")


def _hf_config(model: nn.Module, attention: list[nn.Module]) -> Any:
    """The model's transformers config: its own, or, for a module of the user's holding some of a model's layers (a
    pipeline stage), the one its attention modules were built with."""
    for holder in (model, *attention):
        config = getattr(holder, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config
    raise ValueError(f"sequence parallelism splits the attention of Hugging Face models; {type(model).__name__} "
                     "has no transformers config, nor do its attention modules")


def _outermost_hf_models(model: nn.Module, attention: list[nn.Module]) -> list[nn.Module]:
    """The Hugging Face models (transformers' PreTrainedModel) in `model` that hold some of `attention`, itself
    included, none inside another."""
    from transformers import PreTrainedModel
    attached = {id(module) for module in attention}
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(outer == "" or name.startswith(f"{outer}.") for outer, _ in found)
        if inside or not isinstance(module, PreTrainedModel):
            continue
        if any(id(sub) in attached for sub in module.modules()):
            found.append((name, module))
    return [module for _, module in found]


def _configs(model: nn.Module) -> list[Any]:
    """The model's config and its sub-models' (a text config inside a multimodal one), each once."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            found[id(config)] = config
    return list(found.values())


def _core(model: nn.Module, implementation: str) -> tuple[Callable[..., Any], bool]:
    """The attention function Ulysses wraps, and whether it needs the causal mask made for it."""
    from transformers import AttentionInterface
    if implementation == ULYSSES:
        raise ValueError(f"{type(model).__name__} is attached to a sequence group already")
    if implementation == "eager":
        eager = _eager_of(model)
        if eager is None:
            raise ValueError(f"{type(model).__name__}'s eager attention cannot be wrapped (its modeling module has no "
                             "eager_attention_forward): load it with attn_implementation='sdpa'")
        return eager, True
    interface = AttentionInterface()
    if implementation not in interface or implementation.startswith("flex"):
        raise ValueError(f"attention implementation {implementation!r} cannot be wrapped for sequence parallelism; "
                         "accepted: sdpa, eager, and flash_attention_2/3 where installed")
    return interface[implementation], False


def _eager_of(model: nn.Module) -> Callable[..., Any] | None:
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):
            return getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    return None


def _heads(config: Any) -> tuple[int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads


def _check_heads(heads: int, key_heads: int, ranks: int) -> None:
    if heads % ranks:
        raise ValueError(f"{heads} attention heads do not split over {ranks} sequence ranks: the sequence degree must "
                         f"divide the number of heads")
    if key_heads % ranks and ranks % key_heads:
        raise ValueError(f"{key_heads} key/value heads do not split over {ranks} sequence ranks, nor repeat evenly "
                         f"onto them: the sequence degree must divide {key_heads} or be a multiple of it")
