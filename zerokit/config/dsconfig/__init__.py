"""DeepSpeed's config format, read the one way zerokit reads it. Importable without torch.

    read(raw)                  -> DeepSpeedConfig: canonical, coerced values ("auto" kept as AUTO)
    resolve(cfg, world_size=, hidden_size=) -> Resolution: "auto" filled in, batch sizes derived,
                                  with the choices made (for the start-up log)
    SCHEMA / KeyClass / rows() every key DeepSpeed 0.19.x knows, and what zerokit does with it

The engine's typed config (zerokit/config/typed.py) and the translator (zerokit/planner/translate.py) are both
built on this package, so the two cannot disagree about a key.
"""

from zerokit.config.dsconfig.auto import Choice, Resolution, pending, resolve
from zerokit.config.dsconfig.keys import Key, KeyClass, Kind
from zerokit.config.dsconfig.reader import DeepSpeedConfig, Refusal, read
from zerokit.config.dsconfig.schema import SCHEMA, children, default, key_at, rows
from zerokit.config.dsconfig.values import AUTO, is_auto

__all__ = ["AUTO", "Choice", "DeepSpeedConfig", "Key", "KeyClass", "Kind", "Refusal", "Resolution", "SCHEMA",
           "children", "default", "is_auto", "key_at", "pending", "read", "resolve", "rows"]
