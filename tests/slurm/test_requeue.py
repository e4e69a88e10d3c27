"""Real Slurm: a run that is requeued or killed comes back by itself and ends where it would have.

(a) preemption: a job on `debug` is preempted by a job on `high` (Slurm sends the job's signal, the
    ranks save at the next step boundary, the launcher requeues through submitit), it restarts with
    SLURM_RESTART_COUNT >= 1, resumes and completes; final weights equal an uninterrupted local run.
(b) `scontrol requeue` mid-run: same outcome.
(c) SIGKILL of the job's ranks: the job fails; resubmitting the same run dir resumes from the last
    periodic checkpoint and completes.
(d) `scontrol requeue` during a long step: the ranks give the step up after checkpoint.stop_grace_s,
    commit the last completed step well before Slurm's KillWait, exit cleanly, and the job comes back
    from there (bitwise equality with long steps is tests/mpi/test_stop_grace.py's).
(e) `yatt-hpc cancel`: the ranks save at the SIGTERM and the job ends CANCELLED, not requeued (a stop
    signal otherwise requeues: scancel's SIGTERM brought the job back before cancel disabled requeueing).

(a)-(e) stop the run in a step held open until the stop arrives (`held_overrides`: the rollout
engine wrapped in tests/programs/held_engine.py), never in a step that is merely long enough: steps
got ~10x shorter over time, and a stop sent after "step 6 finished" could find the run done.
"""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PYTHON, REPO, checkpoint_weights, full_matrix_only, mpi_env, wait_for_file
from tests.programs.held_engine import holding_marker
from tests.slurm.jobs import held_overrides, job_rank_pid
from yatt_hpc.config import load_config
from yatt_hpc.launch.jobs import wait_job
from yatt_hpc.launch.submitit_exec import submit_run
from yatt_hpc.metrics.writer import step_rows
from yatt_hpc.placement import plan

DEMO = str(REPO / "configs/demo_cpu.yaml")
STEPS = 20
ARGS = (f"train.steps={STEPS}", "train.prompts_per_step=8", "rollout.samples_per_prompt=4",
        "checkpoint.interval=4", "logging.progress=false")
SLURM_ARGS = ("slurm.env.OMPI_MCA_btl=self,tcp", "slurm.time=00:30:00", "slurm.max_requeues=3")


def finished_steps(run_dir: Path) -> int:
    return len(step_rows(run_dir))


def restart_count(run_dir: Path, job_id: str) -> int:
    """Highest SLURM_RESTART_COUNT a launcher of this job ran under (its summary_<job>_<restart>.json)."""
    starts = [json.loads(p.read_text())["restart_count"] for p in (run_dir / "logs").glob(f"summary_{job_id}_*.json")]
    return max(starts, default=-1)


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    """The final weights of the uninterrupted local run (mpirun): the session's reference run at STEPS."""
    assert STEPS <= reference_run.STEPS
    return reference_run.weights(STEPS)


def submit(run_dir: Path, *extra: str):
    cfg = load_config(DEMO, (*ARGS, *SLURM_ARGS, *extra))
    return submit_run(cfg, plan(cfg), run_dir)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs from the uninterrupted run"


def logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("job_*.log")))


def preempt_held_run(run_dir: Path, tmp_path: Path, *extra: str) -> str:
    """Submit the run to the low-priority partition with step 7 held until the preemption's signal (14 steps of
    ~0.09 s had left it 7 to spare), preempt it with a job on the high-priority partition that needs every node,
    and wait until it has been requeued and completed; the high job's id."""
    sub = submit(run_dir, "slurm.partition=debug", *extra, *held_overrides(tmp_path / "held", "signal", at_version=6))
    wait_for_file(holding_marker(tmp_path / "held"), timeout_s=240)
    high = subprocess.run(["sbatch", "--parsable", "--partition=high", "--nodes=4", "--time=2",
                           f"--output={tmp_path}/high-%j.out", "--wrap", "sleep 5"],
                          capture_output=True, text=True, check=True).stdout.strip()
    states = wait_job(sub.job_id, poll_s=1, timeout_s=500)
    assert set(states.values()) == {"COMPLETED"}, (states, logs(run_dir)[-3000:])
    assert restart_count(run_dir, sub.job_id) >= 1
    return high


@full_matrix_only  # the requeue path of (a) and (d), triggered by hand
def test_scontrol_requeue_mid_run_resumes_and_completes(slurm_cluster, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    sub = submit(run_dir, *held_overrides(tmp_path / "held", "signal", at_version=6))
    wait_for_file(holding_marker(tmp_path / "held"), timeout_s=240)  # step 7 holds until the signal
    subprocess.run(["scontrol", "requeue", sub.job_id], check=True)
    states = wait_job(sub.job_id, poll_s=1, timeout_s=400)
    assert set(states.values()) == {"COMPLETED"}, (states, logs(run_dir)[-3000:])
    assert restart_count(run_dir, sub.job_id) >= 1
    assert "resumed from checkpoint step" in logs(run_dir)
    assert finished_steps(run_dir) == STEPS
    assert_same_weights(checkpoint_weights(run_dir, STEPS), uninterrupted)


def test_preempted_job_saves_requeues_and_completes(slurm_cluster, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    high = preempt_held_run(run_dir, tmp_path)
    log = logs(run_dir)
    assert "stop signal" in log or "resumed from checkpoint step" in log
    assert_same_weights(checkpoint_weights(run_dir, STEPS), uninterrupted)
    subprocess.run(["scancel", high])


def test_cancel_saves_and_ends_the_job_without_a_requeue(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    sub = submit(run_dir, "slurm.max_requeues=3", *held_overrides(tmp_path / "held", "signal"))
    wait_for_file(holding_marker(tmp_path / "held"), timeout_s=240)  # step 2 holds until the signal
    done = subprocess.run([str(Path(PYTHON).parent / "yatt-hpc"), "cancel", sub.job_id], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    states = wait_job(sub.job_id, poll_s=1, timeout_s=120)
    assert set(states.values()) == {"CANCELLED"}, (states, logs(run_dir)[-3000:])
    history = subprocess.run(["sacct", "-j", sub.job_id, "-X", "-n", "-P", "--duplicates", "--format=State"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert "REQUEUED" not in history, history
    assert restart_count(run_dir, sub.job_id) == 0
    stop = json.loads((run_dir / "logs" / f"stop_{sub.job_id}_0.json").read_text())
    assert stop["step"] >= 2 and stop["reason"].startswith("stop signal"), stop
    assert (run_dir / "checkpoints" / f"step-{stop['step']}" / "COMMITTED").exists()


@full_matrix_only  # kill + resubmit is tests/slurm/test_faults.py's, exact weights after a kill test_exact_resume.py's
def test_sigkilled_job_resumes_from_periodic_checkpoint_after_resubmission(slurm_cluster, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    sub = submit(run_dir, *held_overrides(tmp_path / "held", "stopped", at_version=10))
    wait_for_file(holding_marker(tmp_path / "held"), timeout_s=240)  # step 11 holds until the kill
    # SIGKILL to every rank at once, each found by the pid it logged and checked to be this job's
    # (`scancel --signal=KILL` would be a graceful cancel: SIGTERM first, and the ranks would save)
    pids = [job_rank_pid(run_dir, rank, sub.job_id, time.monotonic() + 60) for rank in range(4)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_job(sub.job_id, poll_s=1, timeout_s=200)
    done = finished_steps(run_dir)
    assert done < STEPS, "the kill came too late"
    again = submit(run_dir)
    states = wait_job(again.job_id, poll_s=1, timeout_s=400)
    assert set(states.values()) == {"COMPLETED"}, (states, logs(run_dir)[-3000:])
    assert "resumed from checkpoint step" in logs(run_dir)
    assert finished_steps(run_dir) == STEPS
    assert_same_weights(checkpoint_weights(run_dir, STEPS), uninterrupted)


@full_matrix_only  # the give-up of tests/mpi/test_stop_grace.py, triggered by Slurm's requeue
def test_requeue_during_a_long_step_gives_it_up_within_the_grace(slurm_cluster, tmp_path):
    # step 2 is long by construction (tests/programs/held_engine.py holds its rollout until the rank is
    # stopped; the requeued attempt finds the hold's file and runs through): 64 x 16 samples had been
    # long enough until a step of them took 0.73 s, under the 1 s grace
    run_dir, held_dir = tmp_path / "run", tmp_path / "held"
    sub = submit(run_dir, "train.steps=3", "train.prompts_per_step=16", "rollout.samples_per_prompt=4",
                 "checkpoint.interval=0", "checkpoint.stop_grace_s=1", *held_overrides(held_dir, "stopped"))
    wait_for_file(holding_marker(held_dir), timeout_s=240)  # inside step 2, its rollout held
    sent = time.monotonic()
    subprocess.run(["scontrol", "requeue", sub.job_id], check=True)
    record = run_dir / "logs" / f"stop_{sub.job_id}_0.json"
    while not record.exists():
        assert time.monotonic() - sent < 30, logs(run_dir)[-3000:]
        time.sleep(0.05)
    took = time.monotonic() - sent
    states = wait_job(sub.job_id, poll_s=1, timeout_s=400)
    assert set(states.values()) == {"COMPLETED"}, (states, logs(run_dir)[-3000:])
    stop = json.loads(record.read_text())
    assert stop["step"] == 1 and "gave up step 2" in stop["abandoned"], stop
    print(f"\nscontrol requeue -> stop record (checkpoint step-1 committed) {took:.2f}s")
    assert took < 5, f"the stop record came {took:.1f}s after the requeue (KillWait is 5s on the dev cluster)"
    assert restart_count(run_dir, sub.job_id) >= 1
    assert "resumed from checkpoint step 1" in logs(run_dir)
    assert finished_steps(run_dir) == 3


ASYNC = ("placement.mode=partial", "rollout.max_staleness=1", "eval.every=0")  # one node, as the high job needs
PARTIAL = ("rollout.over_dispatch_ratio=1.5", "rollout.partial_rollouts=true", "rollout.partial_segment_tokens=1")


@pytest.mark.parametrize("extra", [pytest.param((), id="async"),
                                   pytest.param(PARTIAL, id="partial-rollouts", marks=full_matrix_only)])
def test_a_preempted_asynchronous_job_requeues_and_resumes_bitwise(slurm_cluster, tmp_path, extra):
    """`rollout.max_staleness=1` (docs/async.md): the batch generated ahead of its step (and, with partial rollouts,
    the paused samples) are in the checkpoint the preemption's stop writes, so the requeued job ends with the
    weights of the same run under mpirun."""
    straight = tmp_path / "straight"
    args = [a for s in (*ARGS, *ASYNC, *extra) for a in ("--set", s)]
    proc = subprocess.run([PYTHON, "-m", "yatt_hpc.cli", "run", DEMO, "--run-dir", str(straight), *args],
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = tmp_path / "run"
    high = preempt_held_run(run_dir, tmp_path, *ASYNC, *extra)
    assert "resumed from checkpoint step" in logs(run_dir)
    assert finished_steps(run_dir) == STEPS
    assert_same_weights(checkpoint_weights(run_dir, STEPS), checkpoint_weights(straight, STEPS))
    subprocess.run(["scancel", high])
