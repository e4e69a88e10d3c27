"""The `code` reward term in real `yatt-hpc run`s: its tests run on the tools group's rank when there is one (never on
the rollout or GenRM ranks), in the rollout rank's sandbox when there is none, and score the same either way.

    .venv/bin/python -m pytest tests/mpi/test_code_reward_run.py -q          # five short runs (~1.5 min)
    YATT_FULL_FAULT_MATRIX=1 .venv/bin/python -m pytest tests/mpi/test_code_reward_run.py -q   # + over-dispatch

The policy is the demo's; `tests.programs.coding_engine` replaces each response by a program chosen by its sample
id (right, wrong, crashing, endless, none, half right), so every score is known in advance: each row has two
stdin/stdout tests, and every 6 samples score 1, 0, 0, 0, 0 and 0.5.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import NO_EVAL, REPO, final_state, full_matrix_only, mpi_env
from tests.mpi.test_exact_resume import assert_same, finished_steps
from tests.programs.held_engine import held_env
from yatt_hpc.metrics.writer import step_rows
from yatt_hpc.rollout.engine import TEST_WRAPPER_ENV

CONFIG = str(REPO / "configs/demo_cpu.yaml")
TESTS = {"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10\n"]}
GROUP = "placement.tools.tasks_per_node=1"  # world rank 4, after trainer 0-1, rollout 2, genrm 3


CODING = "tests.programs.coding_engine:CodingEngine"


def write_rows(path: Path, n: int = 32) -> Path:
    with path.open("w") as f:
        for k in range(n):
            f.write(json.dumps({"prompt": f"x2 {k}\n> ", "tests": TESTS}) + "\n")
    return path


def command(run_dir: Path, data: Path, *sets: str) -> list[str]:
    sets = ("train.steps=2", "train.prompts_per_step=6", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=40",
            f"data.source={data}", "reward.mode=rule_only",
            "reward.terms=[{name: tests, kind: code}]", "agent.sandbox.timeout_s=1", "logging.progress=false",
            "checkpoint.interval=0", *NO_EVAL, *sets)
    return [sys.executable, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir),
            *(a for kv in sets for a in ("--set", kv))]


def run(run_dir: Path, data: Path, *sets: str, timeout: int = 600) -> list[dict]:
    proc = subprocess.run(command(run_dir, data, *sets), cwd=REPO, env={**mpi_env(), TEST_WRAPPER_ENV: CODING},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return step_rows(run_dir)


def test_the_code_reward_runs_on_the_tools_rank_and_scores_as_on_the_rollout_rank(mpirun, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl")
    alone = run(tmp_path / "alone", data)
    group = run(tmp_path / "group", data, GROUP)
    assert len(alone) == len(group) == 2
    for a, g in zip(alone, group):
        samples = 6 * 4  # prompts x samples: sample ids k..k+23 of each step, 4 of each ANSWERS kind
        assert a["code/samples"] == g["code/samples"] == samples
        assert a["code/parse_failures"] == g["code/parse_failures"] == samples / 6
        runs = 2 * (samples - samples / 6)  # two tests per program
        # without a group the rollout rank ran every test; with one the tools rank did, the rollout rank none
        assert a["code/runs_on_rollout_ranks"] == runs and "code/runs_on_tools_group" not in a
        assert g["code/runs_on_tools_group"] == runs and g["code/runs_on_rollout_ranks"] == 0
        assert a["code/timeouts"] == g["code/timeouts"] == 2 * samples / 6
        assert a["code/run_errors"] == g["code/run_errors"] == 2 * samples / 6  # the crashes
        assert a["code/pass_rate"] == g["code/pass_rate"] == pytest.approx(3 / 10)  # (2 + 1) of 10 tests per 6
        assert a["code/score_mean"] == g["code/score_mean"] == pytest.approx(1.5 / 6)
        keys = [k for k in a if k.startswith("reward/")]
        assert keys and {k: a[k] for k in keys} == {k: g[k] for k in keys}
        assert a["reward/tests/mean"] == pytest.approx(1.5 / 6)
    log = (tmp_path / "group" / "logs" / "rank-0004-tools.log").read_text()
    assert "the code reward's tests" in log and "(loaded: no torch)" in log



@full_matrix_only
def test_over_dispatch_with_the_tools_group_scores_the_generated_samples(mpirun, tmp_path):
    """A helper thread takes the STOPs while the loop thread waits on the tools group's test runs."""
    data = write_rows(tmp_path / "rows.jsonl")
    rows = run(tmp_path / "run", data, "placement.mode=partial", "rollout.over_dispatch_ratio=1.5",
               "rollout.stream_chunk=4", GROUP)
    for r in rows:
        assert r["code/samples"] >= 6 * 4 and r["code/runs_on_tools_group"] == r["code/test_runs"] > 0
        assert r["code/runs_on_rollout_ranks"] == 0  # which groups are kept depends on timing, so no mean here

ASYNC = ("train.steps=4", "checkpoint.interval=2", "checkpoint.stop_grace_s=2", "placement.mode=disjoint",
         "rollout.max_staleness=1", GROUP)


def test_an_asynchronous_run_with_code_rewards_resumes_bitwise(mpirun, tmp_path):
    """Step 2's checkpoint holds step 3's batch, generated ahead with its `code_reward` column: a run SIGTERMed
    after step 2 and resumed ends with the uninterrupted run's weights and consumed prompts, bitwise."""
    data = write_rows(tmp_path / "rows.jsonl")
    straight = run(tmp_path / "straight", data, *ASYNC)
    assert [r["async/staleness"] for r in straight] == [0, 1, 1, 1]
    # each step's row counts the rollout done in it: step 4 generates nothing (no step 5)
    assert all(r["code/runs_on_tools_group"] == r["code/test_runs"] > 0 for r in straight[:3])
    stopped = tmp_path / "stopped"
    # the rollout of step 4 (weights version 2) holds until the signal: the run cannot end before it
    env = mpi_env() | held_env(tmp_path / "held", until="signal", at_version=2)
    env[TEST_WRAPPER_ENV] = f"{CODING},{env[TEST_WRAPPER_ENV]}"
    proc = subprocess.Popen(command(stopped, data, *ASYNC), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while finished_steps(stopped) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert finished_steps(stopped) < 4, "the stop came too late to test anything"
    resumed = run(stopped, data, *ASYNC)
    assert_same(final_state(stopped, 4), final_state(tmp_path / "straight", 4), prompts=4 * 6)
    for a, b in zip(resumed[-2:], straight[-2:]):  # the steps after the resume
        keys = [k for k in b if k.startswith(("reward/", "code/")) and not k.endswith("latency_mean_s")]
        assert {k: a.get(k) for k in keys} == {k: b[k] for k in keys}
