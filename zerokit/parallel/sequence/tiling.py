"""ALST's memory tools: a Hugging Face model's MLPs and its loss computed over slices of the sequence, so that at a
long sequence the tensors that grow with tokens x intermediate size (the MLP's) and tokens x vocabulary (the logits,
in fp32) are alive one slice at a time.

[Note: tiling along the sequence]
An MLP works on each token alone, and a next-token loss is a sum over tokens: both give the same result computed
slice by slice along the tokens. Each slice runs under torch.utils.checkpoint (non-reentrant), which keeps only the
slice's input, a view of a tensor that is alive anyway, and recomputes the slice's forward when backward reaches it.
Backward reaches the slices one at a time: autograd runs the most recently made node first, and every node of a
later slice was made after every node of an earlier one, so a slice's recomputed intermediates are used and freed
before the next slice is recomputed. What stays alive is one slice's intermediates (tokens / tiles x intermediate
size, or x vocabulary in fp32), against the whole sequence's untiled, and between forward and backward an MLP keeps
its input alone where an untiled one keeps its intermediates in every layer; the price is each slice's forward run
twice.

The weights a slice uses get one gradient: under non-reentrant checkpointing the slices are parts of one autograd
graph, and autograd adds a leaf's gradient over its uses before it calls the leaf's gradient hooks, which zerokit's
reducer (stages 1-3) counts on; reentrant checkpointing would run one backward per slice and is refused there. So
the weights need no marking, unlike DeepSpeed's compute_params (See the DeepSpeed names in
zerokit/deepspeed/runtime/sequence_parallel/ulysses_sp.py).

[Note: the final hidden states under ZeRO-3]
The tiled loss needs the model's last hidden states, not its logits. Calling the base model (`model.model`) would
skip the root module's forward, and at stage 3 the root's pre-forward hook is what gathers the parameters that stay
with the root (norms, tied and small weights) and opens the step (See [Note: the stage-3 step] in
stages/hooks.py): the base model would compute with unallocated placeholders. So the whole model runs, through the
engine, with `logits_to_keep` an empty index, and a forward hook on its base model catches the hidden states on
their way to the head. The head then computes logits for no token (a (batch, 0, vocabulary) tensor). Its weight is
used there and in the tiled loss; the first use does not reach the loss, so autograd does not wait for it (a
gradient hook fires once the paths from the loss are done) and zerokit's reducer, which walks the loss's graph to
find the parameters that get a gradient, finds the head's weight through the second use. Where the head is a
stage-3 unit of its own (named in stage3_unit_classes; auto-wrap leaves it with the root, gathered for the whole
step), it is gathered for the empty call and for each slice in forward, and once in backward.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerokit.parallel.sequence.batch import IGNORE_INDEX
from zerokit.parallel.sequence.exchange import summed

TOKENS = -2  # of the (batch, tokens, hidden) or (tokens, hidden) tensor an MLP takes
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ModelRunner(Protocol):
    """What runs a model for final_hidden_states: an Engine (its forward runs the model under ZeRO's hooks)."""

    module: nn.Module

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` under non-reentrant checkpointing where backward will follow. The keyword
    arguments are bound first, so that none is taken for one of checkpoint's own; tensors among them are recomputed
    from and get gradients all the same (non-reentrant checkpointing records the forward's graph as it is)."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    return checkpoint(functools.partial(function, **kwargs) if kwargs else function, *args, use_reentrant=False)


def token_slices(x: torch.Tensor, tiles: int, dim: int = TOKENS) -> list[torch.Tensor]:
    """`x` cut into `tiles` views along `dim`, as even as they come (sizes differ by at most one); none empty."""
    return [part for part in torch.tensor_split(x, tiles, dim=dim) if part.shape[dim]]


def check_tiles(tiles: int) -> None:
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"tiles={tiles!r}: give the number of slices of the sequence, an int of at least 1")


# --- the MLP --------------------------------------------------------------------------------------
class TiledForward:
    """An MLP instance's forward over slices of its tokens, each checkpointed (See [Note: tiling along the
    sequence]); `forward` is the one it replaced, which tile_mlp puts back for tiles=1."""

    def __init__(self, forward: Callable[..., Any], tiles: int, owner: str) -> None:
        self.forward, self.tiles, self.owner = forward, tiles, owner

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.dim() < 2:
            return self.forward(x, *args, **kwargs)
        outputs = [checkpointed(self.forward, part, *args, **kwargs) for part in token_slices(x, self.tiles)]
        if not all(isinstance(out, torch.Tensor) for out in outputs):
            raise TypeError(f"{self.owner}'s forward returns {type(outputs[0]).__name__}, not one tensor: tile_mlp "
                            "tiles MLPs that map hidden states to hidden states; leave this model's MLPs untiled")
        return torch.cat(outputs, dim=TOKENS)


def tile_mlp(model: nn.Module, tiles: int) -> int:
    """Every Hugging Face MLP of `model` (a module with gate_proj, up_proj and down_proj, or whose class name ends
    in "MLP"; an MLP inside one is tiled with it) computes its forward over `tiles` slices of its tokens, one slice's
    intermediate activations alive at a time (See [Note: tiling along the sequence]). The instances' forward is
    replaced, never their class's; tiling again changes the count, tiles=1 puts the forward back. A length that
    `tiles` does not divide is cut unevenly. Returns how many MLPs it set; refused where there are none."""
    check_tiles(tiles)
    mlps = find_mlps(model)
    if not mlps:
        raise ValueError(f"{type(model).__name__} has no MLP module to tile (one with {', '.join(MLP_PROJECTIONS)}, "
                         "or a class named ...MLP)")
    for mlp in mlps:
        untile(mlp)
        if tiles > 1:
            mlp.forward = TiledForward(mlp.forward, tiles, type(mlp).__name__)
    return len(mlps)


def untile(mlp: nn.Module) -> None:
    """The forward the module had before tile_mlp: its class's again, where it had no forward of its own."""
    tiled = mlp.forward
    if not isinstance(tiled, TiledForward):
        return
    if getattr(tiled.forward, "__self__", None) is mlp and tiled.forward.__func__ is type(mlp).forward:
        del mlp.forward
    else:
        mlp.forward = tiled.forward


def find_mlps(model: nn.Module) -> list[nn.Module]:
    """The outermost MLP modules of `model`, each once, in registration order."""
    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if is_mlp(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def is_mlp(module: nn.Module) -> bool:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return False
    return all(hasattr(module, name) for name in MLP_PROJECTIONS) or type(module).__name__.upper().endswith("MLP")


# --- the loss -------------------------------------------------------------------------------------
def tiled_loss(hidden: torch.Tensor, lm_head: nn.Module, shift_labels: torch.Tensor, tiles: int,
               group: Any) -> torch.Tensor:
    """sequence_loss(lm_head(hidden), shift_labels, group), the replica's mean next-token loss, without the whole
    logits: each of `tiles` slices of the tokens has its logits computed and its cross-entropy summed (fp32) under
    checkpointing, so that forward and backward hold one slice's logits at a time (See [Note: tiling along the
    sequence]). `group` None: this rank's tokens are the whole sequence, no combination."""
    check_tiles(tiles)
    rows = hidden.reshape(-1, hidden.shape[-1])  # (batch * tokens, hidden); a view of the contiguous hidden states
    targets = shift_labels.reshape(-1)  # (batch * tokens,)
    if rows.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden states of shape {tuple(hidden.shape)} and shift_labels of shape "
                         f"{tuple(shift_labels.shape)} do not hold the same tokens")
    parts = zip(token_slices(rows, tiles, dim=0), token_slices(targets, tiles, dim=0))
    losses = sum(checkpointed(summed_cross_entropy, lm_head, part, target) for part, target in parts)
    count = (targets != IGNORE_INDEX).sum().to(losses.dtype)
    if group is None:
        return losses / count
    return summed(losses, group) / summed(count, group).detach()


def summed_cross_entropy(lm_head: nn.Module, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss of some rows, their logits in fp32 as sequence_loss computes them."""
    logits = lm_head(rows).float()  # (rows, vocabulary)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


# --- the hidden states ----------------------------------------------------------------------------
def final_hidden_states(runner: ModelRunner | nn.Module, **inputs: Any) -> torch.Tensor:
    """The last hidden states of a Hugging Face causal LM (what its head would turn into logits), run by `runner`
    (an Engine, or the model itself) on `inputs`, with no logits computed (See [Note: the final hidden states
    under ZeRO-3])."""
    model = runner if isinstance(runner, nn.Module) else runner.module
    base = model.base_model if hasattr(model, "base_model") else None
    if base is None or base is model:
        raise ValueError(f"{type(model).__name__} is not a Hugging Face model with a head over a base model "
                         "(base_model): its last hidden states cannot be taken apart from its logits")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{type(model).__name__}.forward takes no logits_to_keep: it would compute the whole logits "
                         "that the tiled loss is there to avoid; compute the loss from its logits instead")
    caught: list[torch.Tensor] = []

    def catch(module: nn.Module, args: Any, output: Any) -> None:
        caught.append(_last_hidden(output))

    handle = base.register_forward_hook(catch)
    try:
        runner(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=_device_of(inputs)))
    finally:
        handle.remove()
    if not caught:
        raise RuntimeError(f"{type(model).__name__}'s forward did not run its base model {type(base).__name__}")
    return caught[-1]


def _last_hidden(output: Any) -> torch.Tensor:
    last = getattr(output, "last_hidden_state", None)
    return last if last is not None else output[0]


def _device_of(inputs: dict[str, Any]) -> torch.device | None:
    tensors = [value for value in inputs.values() if isinstance(value, torch.Tensor)]
    return tensors[0].device if tensors else None
