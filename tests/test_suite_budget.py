"""The suite's time is a budget (issue 42): `make test` within 15 minutes on this 2-core machine, set-up included.
tests/durations.json records each test's seconds (setup, call and teardown) from a whole run of the suite
(`ZEROKIT_RECORD_DURATIONS=tests/durations.json make test`); a test over BUDGET_SECONDS must say why in
docs/testing.md, on a line that names it, so that a slow test is a decision and not an accident."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "durations.json"
WHY = ROOT / "docs" / "testing.md"
BUDGET_SECONDS = 60.0


def over_budget(recorded: dict[str, float]) -> dict[str, float]:
    return {test: seconds for test, seconds in recorded.items() if seconds > BUDGET_SECONDS}


def unexplained(recorded: dict[str, float], why: str) -> list[str]:
    """The tests over the budget whose node id no line of `why` names."""
    lines = why.splitlines()
    return sorted(test for test in over_budget(recorded) if not any(test in line for line in lines))


def test_every_test_over_its_budget_says_why() -> None:
    recorded = json.loads(RECORDED.read_text())
    assert len(recorded) > 2000  # a whole run's record, not a part's
    assert unexplained(recorded, WHY.read_text()) == []


def test_the_check_finds_a_slow_test_without_a_reason() -> None:
    recorded = {"tests/test_a.py::test_slow": 61.0, "tests/test_a.py::test_quick": 2.0,
                "tests/test_b.py::test_slow_with_reason": 90.0}
    why = "- `tests/test_b.py::test_slow_with_reason`: it launches DeepSpeed three times.\n"
    assert unexplained(recorded, why) == ["tests/test_a.py::test_slow"]
