"""The README's main job: `zerokit demo`, really launched with torchrun on 2 CPU processes (tiny)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zerokit.cli import build_parser, main
from zerokit.cli.demo import command
from zerokit.demo.data import CharTokenizer, load_corpus


def test_corpus_ships_and_round_trips() -> None:
    text = load_corpus()
    assert len(text) > 20_000 and text.isascii()
    tokenizer = CharTokenizer(text)
    assert tokenizer.decode(tokenizer.encode(text[:500]).tolist()) == text[:500]


def test_demo_command_is_torchrun() -> None:
    args = build_parser().parse_args(["demo", "--nproc", "3", "--stage", "1"])
    assert command(args, ["--steps", "5"])[1:] == [
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m", "zerokit.demo.train",
        "--stage=1", "--steps", "5"]


def test_bad_nproc_is_one_line(capsys) -> None:
    assert main(["demo", "--nproc", "0"]) == 2
    assert capsys.readouterr().err.strip() == "zerokit demo: error: --nproc=0 must be >= 1"


@pytest.mark.parametrize("stage", [2, 3])
def test_demo_trains_on_two_processes(stage: int) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "zerokit", "demo", "--nproc", "2", "--stage", str(stage), "--steps", "4",
         "--layers", "1", "--width", "32", "--block-size", "32", "--batch-size", "4"],
        capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    assert f"stage {stage} on 2 ranks" in out and "optimizer_state" in out and "sample: The " in out
