"""Real `mpirun`: the step protocol's run-time check names a divergence instead of hanging."""
import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, mpi_env

PROBE = str(REPO / "tests/programs/protocol_probe.py")
CONFIG = str(REPO / "configs/demo_cpu.yaml")


def _run(mpirun, tmp_path, *extra):
    proc = subprocess.run([mpirun, "--oversubscribe", "-np", "4", PYTHON, PROBE, CONFIG, str(tmp_path), *extra],
                          env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]


def test_ranks_that_walk_the_declared_step_pass_the_check(mpirun, tmp_path):
    assert _run(mpirun, tmp_path) == ["ok"] * 4


@pytest.mark.parametrize("rank, group, others", [
    pytest.param(2, "rollout", "world ranks 0,1,3 (genrm/trainer)", id="rollout"),
    pytest.param(3, "genrm", "world ranks 0-2 (rollout/trainer)", id="genrm"),
])
def test_a_rank_that_skips_the_gates_is_named_on_every_rank(mpirun, tmp_path, rank, group, others):
    seen = _run(mpirun, tmp_path, str(rank))
    for message in seen:
        assert "diverged from the step protocol" in message, seen
        assert f"world rank {rank} ({group}) at step 1 event 2 'agree more'" in message, message
        assert f"{others} at step 1 event 2 'gate generated'" in message, message
