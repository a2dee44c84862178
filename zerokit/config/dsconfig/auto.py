""""auto" means zerokit decides: fill each AUTO in, and say what was chosen.

[Note: resolving "auto"]
Hugging Face's DeepSpeed templates write "auto" where its Trainer fills in a value. zerokit fills them in
itself, once the world size and the model's hidden size are known:
- batch sizes by DeepSpeed's identity train_batch_size = micro-batch x accumulation x world size, deriving the
  unknown ones from the known ones exactly as DeepSpeed's _set_batch_related_parameters does (an absent key
  counts as unknown too); all unknown: micro-batch 1, accumulation 1;
- reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 hidden^2, stage3_param_persistence_threshold
  = 10 hidden, as Hugging Face's integration sets them (transformers/integrations/deepspeed.py), where the
  model says its hidden size; where it does not (a plain nn.Module, no host framework to fill them in),
  zerokit's own defaults: a 25 MiB bucket, DeepSpeed's 5e7 prefetch and 1e5 persistence threshold. These three
  only tune speed and memory, so "choose for me" is always answerable (Hugging Face raises instead);
- gradient_clipping 1.0 (DeepSpeed 0.19.8's default and the Trainer's max_grad_norm); bf16/fp16.enabled off;
- optimizer and scheduler parameters: DeepSpeed's defaults for that type (schema_optim.py);
- anything else: the key's default.
scheduler.params.total_num_steps cannot be guessed, so "auto" there is an error. Most of this needs no
context, so zerokit/config/typed.py resolves it at once; what needs the world size or the model is `pending()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerokit.config.defaults import DEFAULT_BUCKET_BYTES
from zerokit.config.dsconfig.elastic import ElasticPolicy, elastic_batch
from zerokit.config.dsconfig.reader import DeepSpeedConfig
from zerokit.config.dsconfig.schema import SCHEMA
from zerokit.config.dsconfig.schema_optim import params_table
from zerokit.config.dsconfig.values import AUTO, show

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
Z = "zero_optimization."
HIDDEN_KEYS = (Z + "reduce_bucket_size", Z + "stage3_prefetch_bucket_size", Z + "stage3_param_persistence_threshold")
ELASTIC_SWITCH = "elasticity.enabled"
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Choice:
    """One value zerokit chose: for a key given as "auto", or a batch size derived from the others."""

    path: str
    value: Any
    why: str
    derived: bool = False
    """True: the key was absent and derived (batch sizes); False: it was "auto"."""

    def line(self) -> str:
        how = "derived" if self.derived else '"auto"'
        return f"{self.path}: {how} -> {show(self.value)} ({self.why})"


@dataclass(frozen=True)
class Resolution:
    config: DeepSpeedConfig
    """The config with every AUTO it could fill in replaced (or dropped where the default applies)."""
    choices: tuple[Choice, ...]


@dataclass(frozen=True)
class Unknowns:
    """What a read config leaves to the world size and the model (See [Note: resolving "auto"]), in values: recorded
    once where the dict is read, so that filling it in (`fill`) never reads the dict again. The typed config keeps
    one until it is resolved, with its own fields' values put in (an edit made with replace() since reading counts)."""

    batch: tuple[tuple[str, int | None], ...] = ((TBS, None), (MICRO, None), (GAS, None))
    """train_batch_size, the micro-batch and the accumulation steps, each known or None (absent, or "auto")."""
    given: frozenset[str] = frozenset()
    """The batch keys the config names (a value or "auto"): a config that names none needs no line about them."""
    hidden_keys: tuple[str, ...] = ()
    """The HIDDEN_KEYS given as "auto"."""
    reduce_dtype: str = "fp32"
    """communication_data_type's name: the bucket is counted in its elements where the model has no hidden size."""
    elastic: ElasticPolicy | None = None
    """An enabled elasticity block, which chooses every batch size for the world size."""

    @property
    def pending(self) -> tuple[str, ...]:
        """Paths whose value needs the world size or the model's hidden size before training can start."""
        batch = dict(self.batch)
        if self.elastic is not None:  # the block chooses them for the world size
            return self.hidden_keys + tuple(path for path in (TBS, MICRO, GAS) if batch[path] is None)
        derived = batch[GAS] is None and batch[TBS] is not None and batch[MICRO] is not None
        return self.hidden_keys + ((GAS,) if derived else ())  # GAS: train_batch_size / (micro-batch x world size)


def pending(config: DeepSpeedConfig) -> tuple[str, ...]:
    """Paths whose value needs the world size or the model's hidden size before training can start."""
    return unknowns(config).pending


def unknowns(config: DeepSpeedConfig) -> Unknowns:
    """What `config` (resolved where no context is needed) leaves to the world size and the model."""
    elastic = ElasticPolicy.from_block(config.under("elasticity")) if config.get(ELASTIC_SWITCH, False) else None
    return Unknowns(batch=tuple((path, _known(config, path)) for path in (TBS, MICRO, GAS)),
                    given=frozenset(path for path in (TBS, MICRO, GAS) if config.given(path)),
                    hidden_keys=tuple(path for path in HIDDEN_KEYS if config.get(path, None) is AUTO),
                    reduce_dtype=config.get("communication_data_type") or "fp32", elastic=elastic)


def resolve(config: DeepSpeedConfig, *, world_size: int | None = None, hidden_size: int | None = None) -> Resolution:
    """Fill in every AUTO and the derived batch sizes. world_size None: only what needs no context (the
    `pending()` paths stay as they are); with a world size, everything, or a one-line error naming the key."""
    updates: dict[str, Any] = {}
    drops: list[str] = []
    choices: list[Choice] = []
    if world_size is None:
        _batch_without_world_size(config, updates, choices)
    else:
        updates, choices = fill(unknowns(config), world_size, hidden_size)
    for path in config.auto_paths():
        if path in updates or path in (GAS, TBS, MICRO) or path in HIDDEN_KEYS:
            continue
        value, why = _default_for(config, path)
        choices.append(Choice(path, value, why))
        if value is None:
            drops.append(path)
        else:
            updates[path] = value
    return Resolution(config.with_values(updates, tuple(drops)), tuple(choices))


def fill(unknown: Unknowns, world_size: int, hidden_size: int | None) -> tuple[dict[str, Any], list[Choice]]:
    """The values the world size and the model decide, by key, and the choices to log: every unknown batch size
    (by DeepSpeed's identity, or the elasticity block's choice) and the "auto" hidden-size keys."""
    values: dict[str, Any] = {}
    choices: list[Choice] = []
    if unknown.elastic is not None:
        _elastic_batch(unknown.elastic, _named_batch(unknown), world_size, values, choices)
    else:
        _batch(unknown, world_size, values, choices)
    _hidden(unknown, hidden_size, values, choices)
    return values, choices


def _named_batch(unknown: Unknowns) -> dict[str, int | None]:
    """The batch keys the config names, with their values (None: "auto")."""
    return {path: value for path, value in unknown.batch if path in unknown.given}


def _known(config: DeepSpeedConfig, path: str) -> int | None:
    value = config.get(path, None)
    return None if value is AUTO else value


def _default_for(config: DeepSpeedConfig, path: str) -> tuple[Any, str]:
    if path == "scheduler.params.total_num_steps":
        raise ValueError("scheduler.params.total_num_steps='auto': zerokit cannot know how many steps you will "
                         "train; write the number")
    if path == "gradient_clipping":
        return 1.0, "DeepSpeed 0.19.8's default and the Hugging Face Trainer's max_grad_norm"
    if path in ("bf16.enabled", "fp16.enabled"):
        return False, "no key asks for this precision"
    for kind in ("optimizer", "scheduler"):
        if path.startswith(kind + ".params."):
            type_name = config.get(kind + ".type")
            key = params_table(kind, type_name)[path.rpartition(".")[2]]
            return key.default, f"DeepSpeed's {type_name} default" if key.default is not None else key.note
    value = SCHEMA[path].default
    return value, "the default" if value is not None else "zerokit's default"


def _batch_without_world_size(config: DeepSpeedConfig, updates: dict, choices: list) -> None:
    """What the batch keys decide before the world size is known: an elasticity block's clashes, and "auto"
    accumulation steps where no batch key fixes them."""
    unknown = unknowns(config)
    if unknown.elastic is not None:
        _elastic_batch(unknown.elastic, _named_batch(unknown), None, updates, choices)
        return
    batch = _checked_batch(unknown)
    if config.get(GAS, None) is AUTO and not (batch[TBS] is not None and batch[MICRO] is not None):
        _choose(GAS, 1, "no batch key fixes it", unknown.given, updates, choices)


def _checked_batch(unknown: Unknowns) -> dict[str, int | None]:
    batch = dict(unknown.batch)
    for name, value in batch.items():
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    return batch


def _batch(unknown: Unknowns, world_size: int, updates: dict, choices: list) -> None:
    batch = _checked_batch(unknown)
    tbs, micro, gas = batch[TBS], batch[MICRO], batch[GAS]
    derived = derive_batch(tbs, micro, gas, world_size)
    reasons = {TBS: f"micro-batch x accumulation x {world_size} ranks",
               MICRO: f"train_batch_size / (accumulation x {world_size} ranks)" if tbs is not None
               else "no batch key fixes it",
               GAS: f"train_batch_size / (micro-batch x {world_size} ranks)" if tbs is not None and micro is not None
               else "1, as DeepSpeed sets it when it cannot be derived"}
    for path, value in zip((TBS, MICRO, GAS), derived):
        if batch[path] is None:
            updates[path] = value
            if unknown.given:  # a config that names no batch key needs no line about them
                choices.append(Choice(path, value, reasons[path], derived=path not in unknown.given))


def _elastic_batch(policy: ElasticPolicy, named: dict[str, int | None], world_size: int | None, updates: dict,
                   choices: list) -> None:
    """The batch sizes DeepSpeed's elasticity block chooses for this world size (See [Note: elastic batch sizes] in
    elastic.py). Batch keys given beside it (`named`) are refused, as DeepSpeed refuses them, unless the block says to
    ignore them (then overridden) or they are what it chooses (a config resolved before)."""
    chosen = None if world_size is None else elastic_batch(policy, world_size)
    values = {} if chosen is None else {TBS: chosen.train_batch_size, MICRO: chosen.micro_batch,
                                        GAS: chosen.accumulation}
    clashing = [path for path, value in named.items() if values.get(path) != value]
    if clashing and not policy.ignore_non_elastic_batch_info:
        raise ValueError(f"{', '.join(clashing)} given beside an enabled elasticity block, which chooses the batch "
                         "sizes for the world size: remove them, or set elasticity.ignore_non_elastic_batch_info="
                         "true to have them overridden (DeepSpeed refuses them the same way)")
    if chosen is None:
        return
    why = f"elasticity at {world_size} ranks; valid world sizes {list(chosen.valid_world_sizes)}"
    for path, value in values.items():
        updates[path] = value
        choices.append(Choice(path, value, why, derived=True))


def _choose(path: str, value: Any, why: str, given: frozenset[str], updates: dict, choices: list) -> None:
    updates[path] = value
    choices.append(Choice(path, value, why, derived=path not in given))


def derive_batch(tbs: int | None, micro: int | None, gas: int | None, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro-batch, accumulation) as DeepSpeed derives them, exactly or a one-line error."""
    if tbs is not None and micro is not None and gas is None:
        gas = _split(tbs, micro * world_size, f"{micro} micro-batch x {world_size} ranks")
    elif tbs is not None and micro is None:
        gas = 1 if gas is None else gas
        micro = _split(tbs, gas * world_size, f"{gas} accumulation steps x {world_size} ranks")
    micro = 1 if micro is None else micro
    gas = 1 if gas is None else gas
    expected = micro * gas * world_size
    if tbs is not None and tbs != expected:
        raise ValueError(f"train_batch_size={tbs} but train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                         f"x world size = {micro} x {gas} x {world_size} = {expected}")
    return expected, micro, gas


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"train_batch_size={total} cannot be split over {what} ({total} is not a multiple of "
                         f"{parts})")
    return total // parts


def _hidden(unknown: Unknowns, hidden_size: int | None, updates: dict, choices: list) -> None:
    if not unknown.hidden_keys:
        return
    if hidden_size is not None and hidden_size < 1:
        raise ValueError(f"hidden_size={hidden_size} must be a positive number of features")
    if hidden_size is None:
        rules = _without_hidden_size(unknown.reduce_dtype)
    else:
        rules = {HIDDEN_KEYS[0]: (hidden_size * hidden_size, "hidden^2"),
                 HIDDEN_KEYS[1]: (int(0.9 * hidden_size * hidden_size), "0.9 x hidden^2"),
                 HIDDEN_KEYS[2]: (10 * hidden_size, "10 x hidden")}
        rules = {path: (value, f"{rule}, hidden size {hidden_size}, as Hugging Face sets it")
                 for path, (value, rule) in rules.items()}
    for path in unknown.hidden_keys:
        _choose(path, *rules[path], frozenset(unknown.hidden_keys), updates, choices)


def _without_hidden_size(reduce_dtype: str) -> dict[str, tuple[int, str]]:
    """zerokit's defaults for the hidden-size keys, for a model with no config.hidden_size (See [Note: resolving
    "auto"]). The bucket is DEFAULT_BUCKET_BYTES counted in elements of the dtype gradients are reduced in."""
    missing = "the model has no config.hidden_size"
    bucket = f"zerokit's default bucket, {DEFAULT_BUCKET_BYTES >> 20} MiB of {reduce_dtype}: {missing}"
    return {HIDDEN_KEYS[0]: (DEFAULT_BUCKET_BYTES // ELEMENT_BYTES[reduce_dtype], bucket),
            HIDDEN_KEYS[1]: (SCHEMA[HIDDEN_KEYS[1]].default, f"zerokit's and DeepSpeed's default: {missing}"),
            HIDDEN_KEYS[2]: (SCHEMA[HIDDEN_KEYS[2]].default, f"zerokit's and DeepSpeed's default: {missing}")}


def hidden_size_of(model: Any) -> int | None:
    """The model's hidden size, for "auto" bucket sizes: Hugging Face's config fields (hidden_size, the largest
    of hidden_sizes, the text_config's), then GPT-2-style n_embd and T5-style d_model; None if it has none."""
    configs = [getattr(model, "config", None)]
    configs.append(getattr(configs[0], "text_config", None))
    for config in configs:
        for name in ("hidden_size", "hidden_sizes", "n_embd", "d_model"):
            value = getattr(config, name, None) if config is not None else None
            if isinstance(value, (list, tuple)) and value:
                value = max(value)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


DIFFERING_DEFAULTS = ("gradient_clipping", "communication_data_type", Z + "overlap_comm")
"""Keys whose absence means something else in zerokit than in DeepSpeed 0.19.8 (See default_differences)."""


def unset_differing_defaults(config: DeepSpeedConfig) -> tuple[str, ...]:
    """The DIFFERING_DEFAULTS `config` leaves unset, recorded where it is read for the start-up log's lines."""
    return tuple(path for path in DIFFERING_DEFAULTS if not config.given(path))


def default_differences(unset: tuple[str, ...], compute: str, reduce: str, stage: int) -> list[str]:
    """Start-up lines for the keys of DIFFERING_DEFAULTS left `unset`, whose absence means something else in zerokit
    than in DeepSpeed 0.19.8."""
    lines = []
    if "gradient_clipping" in unset:
        lines.append("gradient_clipping not set: zerokit does not clip (DeepSpeed 0.19.8 clips at 1.0 by default)")
    if compute != "fp32" and "communication_data_type" in unset:
        lines.append(f"communication_data_type not set: gradients are reduced in {reduce} (DeepSpeed reduces in "
                     f"the compute dtype, {compute})")
    if Z + "overlap_comm" in unset and stage < 3:
        lines.append("zero_optimization.overlap_comm not set: zerokit overlaps reduction with backward (DeepSpeed "
                     "overlaps only at stage 3 by default)")
    return lines
