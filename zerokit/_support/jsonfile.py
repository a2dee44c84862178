"""Reading and writing the small JSON files zerokit keeps (configs, device profiles, calibrations, run records):
one place for what a missing or malformed file says. Pure Python (the planner reads it without torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from dataclasses import asdict
from typing import Any, Callable, ClassVar, TypeVar

T = TypeVar("T")
R = TypeVar("R", bound="JsonRecord")


def read_json(path: str | os.PathLike, what: str, hint: str = "") -> Any:
    """The JSON value in `path`; a one-line error naming `what` the file is when it is missing or not JSON
    (`hint`: how to make one)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist" + (f"; {hint}" if hint else ""))
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: {error}") from None


def read_json_object(path: str | os.PathLike, what: str, hint: str = "") -> dict[str, Any]:
    """read_json, refusing anything but a JSON object."""
    value = read_json(path, what, hint)
    if not isinstance(value, dict):
        raise ValueError(f"{what} {str(Path(path))!r} must hold a JSON object")
    return value


def load_record(path: str | os.PathLike, what: str, hint: str, build: Callable[[dict[str, Any]], T]) -> T:
    """A record saved by write_json: `build` makes it from the file's object; a file it cannot build from is
    named in one line."""
    raw = read_json_object(path, what, hint)
    try:
        return build(raw)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{what} {str(Path(path))!r} is not one zerokit wrote: {error}") from None


def write_json(path: str | os.PathLike, value: Any) -> None:
    Path(path).write_text(json.dumps(value, indent=2) + "\n")


class JsonRecord:
    """A dataclass saved as a JSON object of its fields: `WHAT` names its file in errors, `HINT` says how to
    make one."""

    WHAT: ClassVar[str]
    HINT: ClassVar[str]

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, asdict(self))

    @classmethod
    def load(cls: type[R], path: str | os.PathLike) -> R:
        return load_record(path, cls.WHAT, cls.HINT, lambda raw: cls(**raw))


__all__ = ["JsonRecord", "load_record", "read_json", "read_json_object", "write_json"]
