"""A GenRM behind a stream scores its backlog in one judge call when grouping cannot change a reward.

    .venv/bin/python -m pytest tests/unit/test_genrm_backlog.py -q

Real MPI (`mpirun -np 1`, the batches sent to the rank itself), the demo judge (models/demo/).
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, mpi_env

DEMO_JUDGE = REPO / "models" / "demo" / "judge" / "model.safetensors"
pytestmark = pytest.mark.skipif(not DEMO_JUDGE.is_file(), reason="no models/demo; run tools/make_demo_models.py")


def _probe(mpirun, tmp_path, cap, *sets) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([mpirun, "-np", "1", PYTHON, str(REPO / "tests/programs/genrm_backlog_probe.py"), str(out),
                           str(cap), *sets], env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_greedy_verdicts_score_every_waiting_batch_in_one_call_as_they_score_alone(mpirun, tmp_path):
    got = _probe(mpirun, tmp_path, 32)
    assert got["taken"] == [8, 8, 8] and got["left"] == 0 and got["calls"] == [24]
    assert got["together"] == {"0": [list(range(16))], "1": [list(range(16, 24))]}
    alone = got["alone"]
    assert got["rewards"]["0"][0] == pytest.approx(alone[0] + alone[1], abs=1e-6)
    assert got["rewards"]["1"][0] == pytest.approx(alone[2], abs=1e-6)
    assert got["scored_groups"] == {"0": [0, 1, 2, 3], "1": [4, 5]}


def test_sampled_verdicts_keep_one_call_per_batch(mpirun, tmp_path):
    # a sampled verdict's seed follows its place in a call: grouping would change it, so nothing is merged
    got = _probe(mpirun, tmp_path, 32, "reward.verdict_temperature=0.7")
    assert got["taken"] == [8] and got["left"] == 2 and got["calls"] == []


def test_a_call_takes_no_more_than_one_replicas_share_of_the_backlog(mpirun, tmp_path):
    # what GenRM holds stays bounded (no single rank holds the batch): with a share of 16 rows it
    # takes two 8-row batches and leaves the third waiting for the next call
    got = _probe(mpirun, tmp_path, 16)
    assert got["taken"] == [8, 8] and got["left"] == 1
