"""The walk of `config` (issue 43): from zerokit.initialize through one step, which rooms the configuration, or a part
of it, is handed to, measured by tracing every call (benchmarks/config_walk.py, in a process of its own: it traces
a real initialize on a gloo group of one rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _walk() -> dict:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "config_walk.py"), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_config_is_read_once_and_each_room_gets_its_part_in_the_order_a_step_flows() -> None:
    """The engine hands the config to: the config (load_config, which reads the dict, and the two parts the mesh and
    the engine's group need before the facts), the mesh, the config again (resolve, once the facts are known), then
    the rooms with their parts: reliability's start-up checks before the stage's first collective, the stage (which
    hands the comm and the tiers theirs), the training loop's guards after the hooks, the monitor, and preemption
    last, as a signal saves a checkpoint of everything above. Nothing below the engine hands anything back up."""
    walk = _walk()
    assert walk["climbs"] == []
    assert walk["turns"] == ["engine", "config", "parallel", "config", "reliability", "stages", "reliability",
                             "observe", "reliability"]
    visits = [tuple(visit) for visit in walk["visits"]]
    reader = [index for index, (_, callee, _) in enumerate(visits) if callee == "reader"]
    mesh = next(index for index, (_, callee, _) in enumerate(visits) if callee == "parallel")
    assert reader and max(reader) < mesh  # the DeepSpeed reader only while load_config reads the dict
    assert {caller for caller, callee, _ in visits if callee == "reader"} == {"config"}
    below = {"stages", "comm", "tiers", "reliability", "observe", "checkpoint", "masters", "flat", "precision"}
    assert not [visit for visit in visits if visit[0] in below and visit[1] in ("config", "reader")]
