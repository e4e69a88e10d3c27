"""Real `mpirun`: the plan splits one MPI world into trainer/rollout/genrm groups, connected pairwise."""
import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, mpi_env

PROBE = str(REPO / "tests/programs/world_probe.py")
CONFIG = str(REPO / "configs/demo_cpu.yaml")


def run_probe(mpirun, out, nps, overrides=()):
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none"]
    for i, n in enumerate(nps):
        cmd += ([":"] if i else []) + ["-np", str(n), PYTHON, PROBE, str(out), CONFIG, *overrides]
    return subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=120)


def reports(out):
    return {r["world_rank"]: r for r in (json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json")))}


@pytest.mark.parametrize("overrides, sizes", [
    pytest.param([], {"trainer": 2, "rollout": 1, "genrm": 1}, id="demo-colocate-2-1-1"),
    pytest.param(["--set", "placement.mode=disjoint", "--set", "placement.trainer.tasks_per_node=4",
                  "--set", "placement.trainer.tp=2", "--set", "placement.trainer.dp=null",
                  "--set", "placement.rollout.tasks_per_node=2"],
                 {"trainer": 4, "rollout": 2, "genrm": 1}, id="disjoint-tp2-4-2-1"),
])
def test_world_splits_into_plan_groups_with_intercomms(mpirun, tmp_path, overrides, sizes):
    world_size = sum(sizes.values())
    proc = run_probe(mpirun, tmp_path, [world_size], overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = reports(tmp_path)
    assert sorted(got) == list(range(world_size))
    start = 0
    for group, n in sizes.items():
        ranks = list(range(start, start + n))
        for r in ranks:
            rep = got[r]
            assert rep["group"] == group and rep["group_size"] == n and rep["group_rank"] == r - start
            assert rep["group_rank_sum"] == sum(ranks)  # allreduce stayed inside the group
        # the group's first rank heard each other group's first world rank over the world communicator
        firsts = {g: sum(list(sizes.values())[:i]) for i, g in enumerate(sizes)}
        assert got[start]["heard"] == {g: firsts[g] for g in sizes if g != group}
        start += n
    assert [r for r, rep in got.items() if rep["is_leader"]] == [0]


def test_wrong_world_size_fails_fast_with_the_fix(mpirun, tmp_path):
    proc = run_probe(mpirun, tmp_path, [3])
    assert proc.returncode != 0
    assert "the MPI world has 3 ranks but the plan needs 4" in proc.stderr
    assert "trainer=2, rollout=1, genrm=1" in proc.stderr
