"""Reading one JSON value as DeepSpeed does, never silently wrong.

[Note: reading JSON values]
DeepSpeed reads most of its sections through pydantic in lax mode, so "true"/"false" strings are booleans,
"4" is 4 and 5e8 (a float in JSON) is the integer 500000000. zerokit reads them the same way, and stricter
where lax mode would turn a value into a different setting without a word: Python's bool("false") is True,
int(2.7) is 2, and pydantic reads "1", "yes" and "on" as true. So a boolean is a JSON boolean or the string
"true"/"false"; a whole number is an int, a whole float or a string of one ("5e8"); a float is finite (a nan
clipping threshold compares false with everything and would turn clipping off). bool is an int subclass in
Python but never a number here. "auto" (the Hugging Face template placeholder) becomes the AUTO marker,
which a later step resolves (See zerokit/config/dsconfig/auto.py).
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Iterable


class _Auto:
    """The marker for "auto": zerokit decides the value once the world size and the model are known."""

    _instance: _Auto | None = None

    def __new__(cls) -> _Auto:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "'auto'"

    def __reduce__(self) -> str:
        return "AUTO"


AUTO = _Auto()

DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
               "fp16": "fp16", "float16": "fp16", "half": "fp16"}
"""Spellings DeepSpeed accepts for a dtype, to zerokit's canonical name."""
REFUSED_DTYPE_NAMES = {"bfp16": "bf16"}
"""Spellings found in public configs (Hugging Face's docs once wrote communication_data_type "bfp16") that
DeepSpeed 0.19.8 refuses: refused here too, naming the spelling meant."""


def is_auto(raw: Any) -> bool:
    return raw is AUTO or (isinstance(raw, str) and raw == "auto")


def to_bool(raw: Any, key: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ValueError(f"{key}={raw!r} is not a boolean; use true or false")


def _number_from_text(raw: str, key: str, what: str) -> float | int:
    text = raw.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a number; zerokit needs {what} here") from None


def _real(raw: Any, key: str, what: str) -> numbers.Real:
    """`raw` as a number: numbers as they are, numeric text parsed (as DeepSpeed coerces it), else one line."""
    value = _number_from_text(raw, key, what) if isinstance(raw, str) else raw
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{key}={raw!r} is not a number; zerokit needs {what} here")
    return value


def to_int(raw: Any, key: str) -> int:
    value = _real(raw, key, "a whole number")
    if isinstance(value, numbers.Integral):
        return int(value)
    if math.isfinite(value) and float(value).is_integer():
        return int(value)
    raise ValueError(f"{key}={raw!r} must be a whole number")


def is_infinity(raw: Any) -> bool:
    """Positive infinity: float("inf") as accelerate writes it, or JSON's Infinity."""
    return isinstance(raw, float) and math.isinf(raw) and raw > 0


def to_float(raw: Any, key: str) -> float:
    value = _real(raw, key, "a number")
    if not math.isfinite(value):  # json.loads reads NaN and Infinity
        raise ValueError(f"{key}={raw!r} must be a finite number")
    return float(value)


def to_str(raw: Any, key: str) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"{key}={raw!r} is not a string")
    return raw


def to_choice(raw: Any, key: str, choices: tuple[str, ...]) -> str:
    """One of a few words, case-insensitive (DeepSpeed upper-cases some, lower-cases others)."""
    if isinstance(raw, str):
        for choice in choices:
            if raw.strip().lower() == choice.lower():
                return choice
    raise ValueError(f"{key}={raw!r} is not accepted; use {words(choices)}")


def words(choices: Iterable[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    items = list(choices)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def to_dtype(raw: Any, key: str) -> str:
    """A dtype name as 'fp32', 'bf16' or 'fp16'."""
    if isinstance(raw, str):
        name = raw.strip().lower().removeprefix("torch.")
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
        if name in REFUSED_DTYPE_NAMES:
            raise ValueError(f"{key}={raw!r} is not a dtype: DeepSpeed 0.19.8 refuses it too; write "
                             f"{REFUSED_DTYPE_NAMES[name]}")
    raise ValueError(f"{key}={raw!r} is not a dtype zerokit knows; use fp32, bf16 or fp16")


def to_names(raw: Any, key: str) -> tuple[str, ...]:
    """One name or a list of them (a single string is one name, not a tuple of its letters)."""
    if isinstance(raw, str) and raw:
        return (raw,)
    if isinstance(raw, (list, tuple)) and all(isinstance(item, str) and item for item in raw):
        return tuple(raw)
    what, example = ("a module class name", '["LlamaDecoderLayer"]') if "unit_classes" in key else \
        ("a name", '["all_reduce"]')
    raise ValueError(f"{key}={raw!r} must be {what} or a list of them, like {example}")


def to_float_pair(raw: Any, key: str) -> tuple[float, float]:
    if isinstance(raw, (list, tuple)) and len(raw) == 2:
        return (to_float(raw[0], f"{key}[0]"), to_float(raw[1], f"{key}[1]"))
    raise ValueError(f"{key}={raw!r} must be a pair of numbers, like [0.9, 0.999]")


def to_float_or_list(raw: Any, key: str) -> float | tuple[float, ...]:
    """A number, or one per parameter group (DeepSpeed's schedules take either)."""
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise ValueError(f"{key}=[] must be a number or a non-empty list of numbers")
        return tuple(to_float(item, f"{key}[{index}]") for index, item in enumerate(raw))
    return to_float(raw, key)


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The accepted key a misspelt one most likely meant, if any is close."""
    matches = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return matches[0] if matches else None


def typo_of(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate `word` is a typo of: at most one edit away (two for words over 8 characters), an edit
    being an insertion, deletion, substitution or swap of neighbours. Tighter than `closest`, which also
    suggests keys that merely look alike ("comms_config" is not a typo of "comms_logger")."""
    allowed = 1 if len(word) <= 8 else 2
    near = [(edit_distance(word.lower(), name.lower()), name) for name in sorted(set(candidates))]
    near = [(distance, name) for distance, name in near if distance <= allowed]
    return min(near)[1] if near else None


def edit_distance(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) turning a into b: the optimal string alignment
    distance, the usual measure of a typo."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[len(b)]


def show(value: Any) -> str:
    """A value as JSON writes it, for messages: true, 500000000, 'cpu'."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e4:
        return repr(int(value))  # 5e8 is an element count
    return repr(value)


def whole(value: Any) -> Any:
    """5e8 read from JSON is a float; written back, it is the element count it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
