"""Real `mpirun`: trainer replicas rebalance long-tail work by moving whole groups, losing nothing."""
import json
import subprocess

import numpy as np

from tests.conftest import PYTHON, REPO, mpi_env
from tests.programs.rebalance_probe import start_batch


def test_rebalance_moves_whole_groups_and_evens_the_load(mpirun, tmp_path):
    proc = subprocess.run([mpirun, "--oversubscribe", "-np", "4", PYTHON, str(REPO / "tests/programs/rebalance_probe.py"),
                           str(tmp_path)], env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reps = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    want = np.sort(np.concatenate([start_batch(r).sample_id for r in range(4)]))
    got = np.sort(np.concatenate([rep["sample_id"] for rep in reps]))
    np.testing.assert_array_equal(got, want)  # nothing lost, nothing duplicated
    for rep in reps:
        assert rep["sample_id"] == sorted(rep["sample_id"]) and rep["responses_ok"]
        ids, counts = np.unique(rep["prompt_id"], return_counts=True)
        assert set(counts) <= {4}, "a GRPO group was split"
    owners = {}
    for r, rep in enumerate(reps):
        for g in set(rep["prompt_id"]):
            assert owners.setdefault(g, r) == r
    info = reps[0]
    assert {(rep["before"], rep["after"], rep["moved"]) for rep in reps} == {(info["before"], info["after"], info["moved"])}
    assert info["before"] > 2.0, "rank 0 starts with the long tail"
    assert info["after"] < 1.25 and info["moved"] > 0
