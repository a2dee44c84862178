"""zerokit.testing.spawn starts the ranks again, once, when gloo fails to connect them, and for nothing else
(See [Note: a gloo mesh that does not connect] in zerokit/testing/spawn.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerokit.testing.spawn import MESH_FAILURE, spawn


def _fails_first(rank: int, world_size: int, marker: str, message: str) -> int:
    """Raises `message` on the first attempt (rank 0 leaves a marker when it does), returns the rank after."""
    if not Path(marker).exists():
        if rank == 0:
            Path(marker).touch()
        raise RuntimeError(message)
    return rank


def test_a_mesh_that_did_not_connect_is_started_again_once(tmp_path: Path,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    marker = str(tmp_path / "tried")
    assert spawn(_fails_first, 2, marker, f"{MESH_FAILURE} with [pair.cc] Connection closed by peer") == [0, 1]
    assert "started again once" in capfd.readouterr().err


def test_any_other_failure_is_not_started_again(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="a rank failed:\nrank [01]: RuntimeError: the step diverged"):
        spawn(_fails_first, 2, str(tmp_path / "tried"), "the step diverged")
