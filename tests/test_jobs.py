"""zerokit.testing.jobs, the harness that runs several torchrun jobs in one launch (See [Note: jobs forked inside one
torchrun launch]): each job meets its peers in a process group of its own, sees its own environment and arguments,
and a job that fails on one rank is reported, with its output, without stopping the jobs after it; a rank whose peer
failed is stopped soon after, not at the job's timeout."""

from __future__ import annotations

import json

import pytest

from zerokit.testing.jobs import Job, launch

SCRIPT = """
import json, os, sys, time
import torch.distributed as dist

if sys.argv[2] == "stuck":  # rank 1 fails before meeting; rank 0 would wait for it for good
    if os.environ["RANK"] == "1":
        sys.exit(2)
    time.sleep(600)

dist.init_process_group("gloo")
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, (os.environ["MASTER_PORT"], os.environ.get("JOB_COLOUR"), sys.argv[1:]))
print("rank", dist.get_rank(), "says hello")
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as out:
    json.dump(gathered, out)
rank = dist.get_rank()
dist.destroy_process_group()
if sys.argv[2] == "fail" and rank == 1:
    sys.exit(3)
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("jobs")
    script = root / "job.py"
    script.write_text(SCRIPT)
    jobs = [Job(name, [str(script), str(root / name), ending], env={"JOB_COLOUR": name})
            for name, ending in (("first", "ok"), ("failing", "fail"), ("stuck", "stuck"), ("after", "ok"))]
    for job in jobs:
        (root / job.name).mkdir()
    return root, launch(jobs, root / "launch")


def test_each_job_has_its_own_group_environment_and_arguments(outcomes) -> None:
    root, done = outcomes
    ports = set()
    for name in ("first", "after"):
        done.check(name)
        seen = [json.loads((root / name / f"rank{rank}.json").read_text()) for rank in range(2)]
        assert seen[0] == seen[1] and len(seen[0]) == 2  # both ranks of the job met, and only they
        port, colour, argv = seen[0][0]
        assert colour == name and argv == [str(root / name), "ok"] and all(peer[0] == port for peer in seen[0])
        ports.add(port)
    assert len(ports) == 2  # a store of its own per job


def test_a_failed_rank_is_reported_with_its_output_and_later_jobs_still_run(outcomes) -> None:
    _, done = outcomes
    assert done.statuses("failing") == ["0", "3"]
    with pytest.raises(AssertionError, match=r"(?s)job 'failing' ended with \['0', '3'\].*rank 1 says hello"):
        done.check("failing")
    assert done.statuses("stuck") == ["a peer failed", "2"]  # stopped a few seconds after its peer, not at the timeout
    done.check("after")
