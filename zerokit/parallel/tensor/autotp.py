"""AutoTP training as DeepSpeed 0.19.8 applies it to a Hugging Face model: the model's own tensor-parallel plan
(`config.base_model_tp_plan` beside the class's `_tp_plan`, as transformers declares them and DeepSpeed reads them
first), each linear it names replaced by its split (layers.py).

[Note: the plan is checked before any group is made]
Every rank holds the same model, so the same plan fails the same way on every rank: `planned_splits` reads and
checks it without a collective, and the engine makes the tensor group only after it passed. A degree that does not
divide the heads, or a layer's split dimension, is refused in one line, on every rank, before anything is trained;
DeepSpeed would split unevenly there (and leave ranks without attention heads), which ZeRO's shards of equal shape
across the data group do not need but which the exactness of the heads' split does.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from torch import nn

from zerokit.comm import Communicator
from zerokit.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

COLUMN, ROW = "column", "row"
STYLES = {"colwise": (COLUMN, False), "colwise_rep": (COLUMN, True), "colwise_gather_output": (COLUMN, True),
          "rowwise": (ROW, False)}
"""The Hugging Face plan styles zerokit splits: (how, whether the column split's output is gathered). transformers
renamed colwise_rep to colwise_gather_output; DeepSpeed reads both."""
KEPT_WHOLE = {"embedding_rowwise"}
"""Styles DeepSpeed 0.19.8 leaves whole (TPPlanConverter's SKIP): the embedding, whose vocabulary it splits only with
a vocabulary-parallel head, which zerokit does not offer (tensor_parallel.vocab_parallel_lm_head)."""


class Split(NamedTuple):
    name: str  # the module's qualified name
    how: str  # COLUMN or ROW
    gather_output: bool


def hf_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan, pattern -> style, merged as DeepSpeed 0.19.8 merges it
    (runtime/tensor_parallel/config.py `_get_hf_tp_plan`): the config's base-model plan, then the class's, then the
    instance's."""
    config = getattr(model, "config", None)
    plan: dict[str, str] = {}
    for part in (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
                 vars(model).get("_tp_plan")):
        if isinstance(part, dict):
            plan.update({pattern.removeprefix("model."): style for pattern, style in part.items()})
    return plan


def planned_splits(model: nn.Module, degree: int) -> list[Split]:
    """The linears `model`'s plan splits over `degree` tensor ranks, checked (See [Note: the plan is checked before
    any group is made]); raises ValueError in one line naming what does not fit and what would."""
    plan = hf_plan(model)
    if not plan:
        raise ValueError(f"tensor_parallel.autotp_size={degree}: {type(model).__name__} has no tensor-parallel plan "
                         "(a Hugging Face model's config.base_model_tp_plan); zerokit splits a model by its plan, or "
                         "pass a model you parallelized yourself")
    _check_heads(model, degree)
    splits, tied = [], _tied_to_embeddings(model)
    for name, module in model.named_modules():
        style = _style_of(name, plan)
        if style is None or style.lower() in KEPT_WHOLE:
            continue
        if style.lower() not in STYLES:
            raise ValueError(f"the tensor-parallel plan gives {name} the style {style!r}, which zerokit does not split "
                             f"(accepted: {', '.join(sorted(STYLES))})")
        if not isinstance(module, nn.Linear):
            raise ValueError(f"the tensor-parallel plan splits {name}, a {type(module).__name__}; zerokit splits "
                             "nn.Linear layers only")
        if id(module.weight) in tied:  # DeepSpeed keeps a tied head whole too (vocab_parallel_lm_head off)
            continue
        how, gather = STYLES[style.lower()]
        _check_divides(name, module, how, degree)
        splits.append(Split(name, how, gather))
    return splits


def split_model(model: nn.Module, splits: list[Split], comm: Communicator) -> dict[int, nn.Parameter]:
    """Replace each planned linear by this tensor rank's split of it (See [Note: split linears hold plain
    parameters] in layers.py); the others stay whole. Returns id(whole parameter) -> the piece that replaced it, for
    an optimizer built over the whole model (See setup.remap_parameters)."""
    replaced: dict[int, nn.Parameter] = {}
    for split in splits:
        parent_name, _, child = split.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        replacement = (ColumnParallelLinear.split(linear, comm, split.gather_output) if split.how == COLUMN
                       else RowParallelLinear.split(linear, comm))
        setattr(parent, child, replacement)
        for name in ("weight", "bias"):
            whole, piece = getattr(linear, name), getattr(replacement, name)
            if whole is not None and piece is not whole:
                replaced[id(whole)] = piece
    return replaced


def _style_of(name: str, plan: dict[str, str]) -> str | None:
    """The style of the plan's pattern that matches module `name` ("layers.*.mlp.up_proj" matches
    "model.layers.3.mlp.up_proj"); None where none does."""
    for pattern, style in plan.items():
        regex = r"(?:^|.*\.)" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$"
        if re.match(regex, name):
            return style
    return None


def _check_heads(model: nn.Module, degree: int) -> None:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % degree:
            raise ValueError(f"a tensor degree of {degree} does not divide the model's {heads} {key} (accepted: "
                             f"{_divisors(heads)})")


def _check_divides(name: str, linear: nn.Linear, how: str, degree: int) -> None:
    size, what = (linear.out_features, "outputs") if how == COLUMN else (linear.in_features, "inputs")
    if size % degree:
        raise ValueError(f"a tensor degree of {degree} does not divide the {size} {what} of {name}, which the plan "
                         f"splits {how}-wise (accepted: {_divisors(size)})")


def _tied_to_embeddings(model: nn.Module) -> set[int]:
    return {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
