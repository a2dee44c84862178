"""Where the test suite's time goes (issue 42), from the JUnit XML of a pytest run:

    python -m pytest -q -n 2 --junitxml=/tmp/suite.xml      # or without -n 2: one worker
    python benchmarks/suite_time.py /tmp/suite.xml [--modules 30]

prints the seconds by kind of test and by module (setup, call and teardown of every test added; under two workers
the sum is worker time, about twice the wall time). A test module is of the kind of what it mostly waits on: its
spawned gloo ranks, real frameworks launched with torchrun, process ends and deadlines, or nothing but itself."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ElementTree
from collections import Counter

# The modules whose time is mostly one kind of wait; every other module is "one process" (the test's own work).
KINDS = {
    "parity sweep and its one-process references": [
        "test_accounting", "test_parity", "test_exact_steps", "test_offload"],
    "real frameworks under torchrun (DeepSpeed, HF Trainer, accelerate, Lightning, TRL)": [
        "test_hf_trainer", "test_accelerate", "test_lightning", "test_trl", "test_deepspeed_scripts",
        "test_deepspeed_pipe", "test_deepspeed_export", "test_deepspeed_import", "test_deepspeed_frameworks",
        "test_benchmarks", "test_demo"],
    "process ends, restarts and deadlines (real signals, torchrun restarts, timeouts)": [
        "test_restart", "test_restart_ranks", "test_exit", "test_reliability", "test_resume", "test_offload_memory"],
    "spawned gloo ranks (zerokit.testing.spawn)": [
        "test_hybrid", "test_pipeline", "test_checkpoint_multirank", "test_tensor_parallel", "test_mistakes",
        "test_parallel_layout", "test_two_engines", "test_offload_budget", "test_scenarios", "test_stage3_access",
        "test_stage3_frozen", "test_sharded_construction", "test_forward_only", "test_deepspeed_engine_blocks",
        "test_dsconfig_public", "test_planner_engine_exact", "test_settings_grid",
        "test_planner_offload_against_engine", "test_planner_calibration", "test_deepspeed_api", "test_checkpoint"],
}
KIND_OF = {module: kind for kind, modules in KINDS.items() for module in modules}


def seconds_by_module(path: str) -> tuple[Counter, Counter]:
    seconds, tests = Counter(), Counter()
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = next(part for part in reversed(case.get("classname").split(".")) if part.startswith("test_"))
        seconds[module] += float(case.get("time"))
        tests[module] += 1
    return seconds, tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="pytest's --junitxml file")
    parser.add_argument("--modules", type=int, default=30, help="how many of the slowest modules to list")
    args = parser.parse_args()
    seconds, tests = seconds_by_module(args.junit)
    by_kind = Counter()
    for module, value in seconds.items():
        by_kind[KIND_OF.get(module, "one process (the test's own work)")] += value
    total = sum(seconds.values())
    print(f"| kind | s | share |\n|---|---|---|")
    for kind, value in by_kind.most_common():
        print(f"| {kind} | {value:,.0f} | {value / total:.0%} |")
    print(f"| all ({sum(tests.values()):,} tests) | {total:,.0f} | |\n\n| module | tests | s |\n|---|---|---|")
    for module, value in seconds.most_common(args.modules):
        print(f"| {module} | {tests[module]} | {value:,.1f} |")


if __name__ == "__main__":
    main()
