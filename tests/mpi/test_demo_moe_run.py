"""Real `yatt-hpc run configs/demo_moe_cpu.yaml`: the demo with its mixture-of-experts policy (models/demo_moe, built
by tools/make_demo_moe.py) learns the task at trainer dp 2, and a resume from step 20 ends bitwise where the straight
run ended.

    YATT_FULL_FAULT_MATRIX=1 .venv/bin/python -m pytest tests/mpi/test_demo_moe_run.py -q     # in `make test-faults`
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, final_state, full_matrix_only, mpi_env

pytestmark = full_matrix_only
CONFIG = str(REPO / "configs/demo_moe_cpu.yaml")
QUIET = ["--set", "logging.progress=false"]


def yatt(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", *args], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_moe_run(mpirun, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo_moe") / "run"
    proc = yatt("run", CONFIG, "--run-dir", str(run_dir), *QUIET)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run_dir


def test_the_moe_demo_learns_the_task(demo_moe_run):
    summary = json.loads((demo_moe_run / "summary.json").read_text())
    assert summary["steps"] == 30
    assert summary["reward_last5"] - summary["reward_first5"] >= 0.2, summary


def test_a_moe_demo_resumed_from_step_20_ends_bitwise_where_the_straight_run_ended(demo_moe_run, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(demo_moe_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-30")
    proc = yatt("run", CONFIG, "--run-dir", str(resumed), *QUIET)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from checkpoint step 20" in proc.stdout + proc.stderr
    (wa, ca), (wb, cb) = final_state(demo_moe_run, 30), final_state(resumed, 30)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert ca == cb
