"""Submit and watch real Slurm jobs from tests (polls squeue/sacct: `sbatch --wait` polls too slowly)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def sbatch(script: str, workdir: Path) -> str:
    path = workdir / "job.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", f"--chdir={workdir}", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def job_states(job_id: str) -> dict[str, str]:
    """sacct JobID -> State for the job, its het components and steps."""
    out = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State"],
                         capture_output=True, text=True, timeout=30).stdout
    states = {}
    for line in out.splitlines():
        if "|" in line:
            jid, state = line.split("|", 1)
            states[jid] = state.split()[0] if state else ""
    return states


def wait_job(job_id: str, timeout: float = 180, components: int = 0) -> dict[str, str]:
    """Wait until the job has left the queue and sacct shows it final (the same answer twice in a
    row: sacct briefly lists a finished het job as plain N); with `components`, until every het
    component N+i is listed too. Returns all sacct states."""
    deadline = time.monotonic() + timeout
    previous = None
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip()
        states = job_states(job_id)
        top = [s for jid, s in states.items() if "." not in jid]
        listed = all(f"{job_id}+{i}" in states for i in range(components))
        if not queued and top and listed and all(s in FINAL for s in top):
            if states == previous:
                return states
            previous = states
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} not finished after {timeout}s: {job_states(job_id)}")
