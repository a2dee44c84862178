"""Run a script or module in this process as `python script.py args...` or `python -m module args...` would: the
commands that do something first and then hand over to an unchanged script (`python -m zerokit.deepspeed.install`,
`python -m zerokit.testing.deepspeed_peer`)."""

from __future__ import annotations

import os
import runpy
import sys
from typing import Callable


def run_as_python(argv: list[str], usage: str, first: Callable[[], None] | None = None) -> None:
    """What `python *argv` runs (sys.argv and sys.path[0] as that command would set them), after `first`; `usage`
    where argv names nothing to run (and `first` is not called)."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(usage)
    if first is not None:
        first()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # where `python script.py` would look first
    runpy.run_path(argv[0], run_name="__main__")
