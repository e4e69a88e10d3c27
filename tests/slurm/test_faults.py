"""Real Slurm: one rank of a running job dies or stops; the job ends in bounded time naming it, and
resubmitting the same run directory resumes with every prompt consumed once.

The rank is found by the pid its own log recorded, and checked to belong to this test's job (its
SLURM_JOB_ID) before it is signalled: nothing is matched by name. The signal lands after checkpoint
step-N is committed by the job hit (the event, not a time). The full 3 groups x 3 placements SIGKILL
matrix runs under mpirun (tests/mpi/test_faults.py); here each group and each placement is hit once:
`make test` runs the heterogeneous job's SIGKILL and SIGSTOP one after the other on one run directory
(three submissions), `make test-faults` adds SIGKILL in colocate and partial.
"""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import PYTHON, REPO, full_matrix_only
from tests.mpi.test_faults import assert_every_prompt_once
from tests.programs.held_engine import release
from tests.slurm.jobs import held_overrides, job_rank_pid
from yatt_hpc.ckpt import layout
from yatt_hpc.launch.jobs import top_states, wait_job

DEMO = str(REPO / "configs/demo_cpu.yaml")
STEPS = 6  # two faults, each after a step its job committed with steps still to run, and steps left for the last job
ARGS = [f"train.steps={STEPS}", "train.prompts_per_step=8", "rollout.samples_per_prompt=4", "checkpoint.interval=1",
        "logging.progress=false", "logging.trackers=[]", "slurm.env.OMPI_MCA_btl=self,tcp", "slurm.time=00:20:00",
        "health.heartbeat_s=1", "health.stall_timeout_s=8"]
RANK_OF = {"trainer": 1, "rollout": 2, "genrm": 3}


def submit(run_dir, mode, held=None, at_version: int = 1) -> str:
    """Submit the run; `held`: a directory, and the rollout on weights version `at_version` holds
    until `release(held)` (tests/programs/held_engine.py)."""
    holds = held_overrides(held, "released", at_version) if held is not None else ()
    sets = [a for kv in (*ARGS, f"placement.mode={mode}", *holds) for a in ("--set", kv)]
    proc = subprocess.run([PYTHON, "-m", "yatt_hpc.cli", "submit", DEMO, "--run-dir", str(run_dir), *sets],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split("submitted job ", 1)[1].split(":")[0]


def hit(run_dir, mode, rank: int, sig: int) -> tuple[dict, str]:
    """Submit, and signal `rank` once this job has committed a checkpoint of its own (the first step
    after the latest one an earlier job left: a killed job may have committed one more than it logged)."""
    committed = [s.step for s in layout.list_steps(layout.checkpoints_dir(run_dir)) if s.committed]
    after_step = max(committed, default=0) + 1
    assert after_step < STEPS, f"no step left to hit after checkpoint step-{after_step - 1}"
    # the rollout after step N holds until the hit has landed: a fresh job's engine serves version 1 after
    # step 1; a resumed one's gets the restored weights first (version 1), then step N's (version 2)
    held = run_dir.parent / f"held-{after_step}"
    job = submit(run_dir, mode, held, at_version=1 if after_step == 1 else 2)
    deadline = time.monotonic() + 300
    pid = job_rank_pid(run_dir, rank, job, deadline)
    marker = run_dir / "checkpoints" / f"step-{after_step}" / "COMMITTED"
    while not marker.exists():
        assert time.monotonic() < deadline, f"checkpoint step-{after_step} never committed: {top_states(job)}"
        time.sleep(0.1)
    os.kill(pid, sig)
    sent = time.monotonic()
    release(held)  # the held rollout (its step after step-N) goes on: the run could not end before the hit
    states = wait_job(job, poll_s=1, timeout_s=120, components=3 if mode == "disjoint" else 0)
    print(f"{mode}: {signal.Signals(sig).name} to rank {rank} -> {states} after {time.monotonic() - sent:.0f}s")
    assert set(states.values()) == {"FAILED"}, states
    summary = json.loads(next((run_dir / "logs").glob(f"summary_{job}_*.json")).read_text())
    return summary, job


def resubmit_and_check(run_dir, mode) -> None:
    job = submit(run_dir, mode)
    states = wait_job(job, poll_s=1, timeout_s=300, components=3 if mode == "disjoint" else 0)
    log = "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob(f"job_{job}_*.log")))
    assert set(states.values()) == {"COMPLETED"}, (states, log[-3000:])
    assert "resumed from checkpoint step" in log
    assert_every_prompt_once(run_dir, steps=STEPS)


@full_matrix_only
@pytest.mark.parametrize("mode, group", [pytest.param("colocate", "trainer", id="colocate-trainer"),
                                         pytest.param("partial", "genrm", id="partial-genrm")])
def test_a_killed_rank_fails_the_job_named_and_a_resubmission_resumes(slurm_cluster, tmp_path, mode, group):
    run_dir = tmp_path / "run"
    rank = RANK_OF[group]
    summary, _ = hit(run_dir, mode, rank, signal.SIGKILL)
    assert summary["failure"].startswith(f"{group} (world rank {rank}) on "), summary
    assert "killed by signal 9" in summary["failure"], summary
    resubmit_and_check(run_dir, mode)


def test_a_killed_then_a_stopped_rank_each_fail_the_job_named_and_resubmissions_resume(slurm_cluster, tmp_path):
    """The heterogeneous job (disjoint), three submissions of one run directory: SIGKILL of the rollout
    rank once step 1 is committed; in the resubmission SIGSTOP of the GenRM rank once it has committed
    the next step; the third job completes the run, every prompt consumed once over all three."""
    run_dir = tmp_path / "run"
    summary, _ = hit(run_dir, "disjoint", RANK_OF["rollout"], signal.SIGKILL)
    assert summary["failure"].startswith("rollout (world rank 2) on "), summary
    assert "killed by signal 9" in summary["failure"], summary
    summary, job = hit(run_dir, "disjoint", RANK_OF["genrm"], signal.SIGSTOP)
    assert summary["failure"].startswith("genrm (world rank 3): stalled (silent): no heartbeat for"), summary
    assert (run_dir / "logs" / f"stall_{job}_0.json").exists()
    resubmit_and_check(run_dir, "disjoint")
