"""Real `yatt-hpc run configs/demo_moe_cpu.yaml`: the demo with its mixture-of-experts policy (models/demo_moe, built
by tools/make_demo_moe.py) at trainer dp 2 with expert parallelism 2. CI: three steps, each rank's experts in the
engine and in the checkpoint. `make test-faults`: the task learned in 30 steps, and a resume from step 20 ends
bitwise where the straight run ended.

    .venv/bin/python -m pytest tests/mpi/test_demo_moe_run.py -q                              # the CI case
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

CONFIG = str(REPO / "configs/demo_moe_cpu.yaml")
QUIET = ["--set", "logging.progress=false"]


def yatt(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", *args], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_three_steps_at_ep2_sync_and_save_each_ranks_experts(mpirun, tmp_path):
    """The engine scores its samples like the trainer (it holds both ranks' experts after each sync), and the
    checkpoint holds rank 0's file (dense layers, experts 0-1) and rank 1's (experts 2-3), model-wide numbers."""
    from safetensors.torch import load_file

    from yatt_hpc.ckpt.loader import read_weights
    from yatt_hpc.metrics.writer import step_rows

    run_dir = tmp_path / "run"
    proc = yatt("run", CONFIG, "--run-dir", str(run_dir), *QUIET, "--set", "train.steps=3", "--set",
                "checkpoint.interval=3", "--set", "checkpoint.async=false", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/rollout_logp_diff_max"] < 1e-4 and r["train/grad_norm"] > 0 for r in rows), rows
    step = run_dir / "checkpoints" / "step-3"
    experts = [sorted({int(n.split(".")[6]) for n in load_file(str(step / name)) if ".local_experts." in n})
               for name in ("model-tp0-pp0.safetensors", "model-tp0-pp0-ep1.safetensors")]
    assert experts == [[0, 1], [2, 3]]
    assert all(".local_experts." in n for n in load_file(str(step / "model-tp0-pp0-ep1.safetensors")))
    assert len([n for n in read_weights(step) if ".local_experts." in n]) == 3 * 4 * 2  # layers x experts x fc1/fc2


@pytest.fixture(scope="module")
def demo_moe_run(mpirun, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo_moe") / "run"
    proc = yatt("run", CONFIG, "--run-dir", str(run_dir), *QUIET)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run_dir


@full_matrix_only
def test_the_moe_demo_learns_the_task(demo_moe_run):
    summary = json.loads((demo_moe_run / "summary.json").read_text())
    assert summary["steps"] == 30
    assert summary["reward_last5"] - summary["reward_first5"] >= 0.2, summary


@full_matrix_only
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
