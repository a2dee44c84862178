"""`zerokit demo`: train a small GPT on local CPU processes, launched with torchrun."""

from __future__ import annotations

import argparse
import subprocess
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("demo", help="train a small GPT with zerokit on local CPU processes",
                                   description="Launches `torchrun --standalone` with N processes (gloo on CPU) "
                                               "running zerokit.demo.train; other flags are passed through.")
    parser.add_argument("--nproc", type=int, default=2, help="number of local processes (ranks)")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    return parser


def command(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    if args.nproc < 1:
        raise ValueError(f"--nproc={args.nproc} must be >= 1")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            "-m", "zerokit.demo.train", f"--stage={args.stage}", *passthrough]


def run(args: argparse.Namespace) -> int:
    return subprocess.call(command(args, args.passthrough))
