"""The `zerokit` command: a tiny main that registers subcommands.

Each subcommand is a module with `add_parser(subparsers)` and `run(args) -> int`; the work itself
lives in pure functions elsewhere so that it can be tested in-process.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Module names under zerokit.cli, in the order `zerokit --help` lists them.
SUBCOMMANDS = ["demo", "plan", "translate", "consolidate", "convert"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerokit", description="ZeRO for PyTorch, and a planner.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"zerokit.cli.{name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(run=module.run)
    return parser


# Subcommands that hand unknown flags on to the program they launch.
PASSTHROUGH = {"demo"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in PASSTHROUGH:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra
    try:
        return args.run(args)
    except ValueError as error:  # user errors: one line, no traceback
        print(f"zerokit {args.command}: error: {error}", file=sys.stderr)
        return 2
