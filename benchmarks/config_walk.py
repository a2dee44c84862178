"""The walk of `config`: which rooms (zerokit's subpackages) the configuration enters, in order, from
`zerokit.initialize(...)` through one forward, backward and step.

    python benchmarks/config_walk.py

[Note: each room gets its part] in zerokit/config/settings.py says the whole config stops at the engine's build and
each room below gets only its part. This measures what the code does: it traces every Python call (one process, a
gloo group of one rank) and keeps the calls that receive a config-bearing object (the raw dict given, a DeepSpeedConfig,
a ZeroConfig, the RunSettings or one of its parts). A visit is such a call whose room differs from the room of the
nearest zerokit frame below it ("user" where there is none: the script itself). A climb is a visit upwards, by the
FLOORS of tests/test_code_shape.py: a room handing its config to a room it may not import.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import socket
import sys
import threading
import typing
from collections import Counter
from itertools import groupby
from pathlib import Path
from types import FrameType

import torch

import zerokit
from zerokit.config.dsconfig.reader import DeepSpeedConfig
from zerokit.config.settings import RunSettings
from zerokit.config.typed import ZeroConfig

SHAPE_TEST = Path(__file__).resolve().parents[1] / "tests" / "test_code_shape.py"
# The parts are RunSettings' field types, read from the class, so that a part added there is followed here too.
CONFIG_TYPES = (DeepSpeedConfig, ZeroConfig, RunSettings,
                *(kind for kind in typing.get_type_hints(RunSettings).values() if dataclasses.is_dataclass(kind)))
OWN_ROOMS = {"zerokit.config.dsconfig": "reader", "zerokit.config.settings": "settings"}  # rooms of their own
FLOOR_OF_OWN_ROOM = {"reader": "config", "settings": "config"}


def room_of(module: str) -> str:
    """zerokit.a.b -> "a"; the DeepSpeed reader and the settings are rooms of their own (in config/)."""
    own = [room for package, room in OWN_ROOMS.items() if f"{module}.".startswith(f"{package}.")]
    return own[0] if own else module.split(".")[1] if "." in module else "zerokit"


def is_zerokit(frame: FrameType) -> bool:
    return frame.f_globals.get("__name__", "").partition(".")[0] == "zerokit"


def arguments(frame: FrameType) -> list:
    """The values a call received: its named parameters, and what its *args and **kwargs hold."""
    code, local = frame.f_code, frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    values = [local[name] for name in code.co_varnames[:count] if name in local]
    if code.co_flags & inspect.CO_VARARGS:
        values += list(local.get(code.co_varnames[count], ()))
        count += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        values += list(local.get(code.co_varnames[count], {}).values())
    return values


def function_name(frame: FrameType) -> str:
    """The callee's qualified name; a dataclass's generated method (`__create_fn__.<locals>.__init__`) by its class."""
    code = frame.f_code
    if code.co_qualname.startswith("__create_fn__") and code.co_argcount:
        return f"{type(frame.f_locals[code.co_varnames[0]]).__qualname__}.{code.co_name}"
    return code.co_qualname


def caller_room(frame: FrameType) -> str | None:
    """The room of the nearest zerokit frame below (through torch's frames: autograd hooks, nn.Module.__call__);
    None for a call made while a module is imported (a default argument built at import is not the given config)."""
    rooms = []
    while (frame := frame.f_back) is not None:
        if frame.f_globals.get("__name__", "").startswith("importlib"):
            return None
        rooms += [room_of(frame.f_globals["__name__"])] if is_zerokit(frame) else []
    return rooms[0] if rooms else "user"


def traced_visits(run, raw: dict) -> list[tuple[str, str, str]]:
    """Run `run()` with every call traced; the visits of config-bearing calls, in order."""
    visits: list[tuple[str, str, str]] = []

    def on_call(frame: FrameType, event: str, _arg) -> None:
        if event != "call" or not is_zerokit(frame):
            return None
        if not any(value is raw or isinstance(value, CONFIG_TYPES) for value in arguments(frame)):
            return None
        module = frame.f_globals["__name__"]
        callee, caller = room_of(module), caller_room(frame)
        if caller is not None and callee != caller:
            visits.append((caller, callee, f"{module}.{function_name(frame)}"))
        return None  # no per-line tracing: call events are all this needs

    sys.settrace(on_call)
    threading.settrace(on_call)  # a hook run on another thread is followed too
    try:
        run()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return visits


def one_rank_group_environment() -> None:
    """A gloo group of one rank, as torchrun would describe it (zerokit's initialize makes the group)."""
    with socket.socket() as probe:  # a port the kernel says is free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")


def walk() -> list[tuple[str, str, str]]:
    """(caller room, callee room, qualified callee) of every visit of the config, from initialize through one step."""
    one_rank_group_environment()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    raw = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

    def initialize_and_step() -> None:
        engine = zerokit.initialize(model=model, config=raw)  # returns the Engine itself, not a tuple
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()

    return traced_visits(initialize_and_step, raw)


def floors() -> dict[str, int]:
    """Room -> floor (0 at the bottom), from FLOORS in tests/test_code_shape.py, read with ast."""
    for node in ast.parse(SHAPE_TEST.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FLOORS" for t in node.targets):
            return {room: level for level, rooms in enumerate(ast.literal_eval(node.value)) for room in rooms}
    raise LookupError(f"no FLOORS in {SHAPE_TEST}")


def climbs(visits: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The visits into a room on a higher floor than the caller's (the script's own calls have no floor)."""
    floor = floors()
    floor.update({room: floor[under] for room, under in FLOOR_OF_OWN_ROOM.items()})
    return [visit for visit in visits if visit[0] != "user" and floor[visit[1]] > floor[visit[0]]]


def turns(visits: list[tuple[str, str, str]]) -> list[str]:
    """The rooms the engine hands the config (or a part of it) to, in order, one room's consecutive visits as one
    turn: what a reader of Engine.__init__ follows. Visits a room makes below it (the reader under load_config, the
    tiers under the stage) stay within that room's turn."""
    handed = [callee for caller, callee, _ in visits if caller in ("engine", "user")]
    return [room for index, room in enumerate(handed) if index == 0 or handed[index - 1] != room]


def main() -> None:
    visits = walk()
    if sys.argv[1:] == ["--json"]:  # for tests/test_config_walk.py
        print(json.dumps({"visits": visits, "turns": turns(visits), "climbs": climbs(visits)}))
        return
    print(f"visits ({len(visits)}; consecutive repeats of one visit printed once, as xN):")
    for (caller, callee, function), run in groupby(visits):
        repeats = len(list(run))
        print(f"  {caller} -> {callee} ({function})" + (f" x{repeats}" if repeats > 1 else ""))
    entries = Counter(callee for _, callee, _ in visits)
    print("\nvisits into each room, in the order of first entry:")
    print("".join(f"  {room}: {count}\n" for room, count in entries.items()), end="")  # a Counter keeps first order
    print(f"order of first entries: {' -> '.join(entries)}")
    print(f"the engine's turns (rooms it hands the config or a part to, in order): {' -> '.join(turns(visits))}")
    found = climbs(visits)
    print(f"\nclimbs ({len(found)}):")
    print("".join(f"  {caller} -> {callee} ({function})\n" for caller, callee, function in found), end="")


if __name__ == "__main__":
    main()
