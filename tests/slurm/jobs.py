"""Submit hand-written batch scripts from tests; watch them with `yatt_hpc.launch.jobs.wait_job`
(it polls squeue/sacct every second here: `sbatch --wait` polls too slowly)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.conftest import REPO
from tests.programs.held_engine import held_env


def sbatch(script: str, workdir: Path) -> str:
    path = workdir / "job.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", f"--chdir={workdir}", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def held_overrides(directory: Path, until: str, at_version: int = 1) -> tuple[str, ...]:
    """`slurm.env.*` overrides that make a submitted run's rollout on weights version `at_version`
    (step at_version + 1) hold until `until` (tests/programs/held_engine.py): a run that cannot end
    before the test acts on it."""
    env = {"PYTHONPATH": str(REPO)} | held_env(directory, until, at_version)
    return tuple(f"slurm.env.{name}={value}" for name, value in env.items())


def job_rank_pid(run_dir: Path, rank: int, job: str, deadline: float) -> int:
    """The pid world rank `rank` logged at start (`started: pid N`), once it is a process of job `job`
    (its SLURM_JOB_ID or SLURM_HET_JOB_ID): nothing is matched by name, and a line an earlier job of
    the same run directory left in the log (resubmissions append) is waited past, never signalled."""
    seen = None
    while True:
        logs = list((run_dir / "logs").glob(f"rank-{rank:04d}-*.log"))
        text = logs[0].read_text() if logs else ""
        if "started: pid " in text:
            pid = int(text.rsplit("started: pid ", 1)[1].split()[0])
            seen = (pid, _jobs_of(pid))
            if job in seen[1]:
                return pid
        assert time.monotonic() < deadline, f"rank {rank} of job {job} never logged its pid (last seen: {seen})"
        time.sleep(0.1)  # polling for the event (the log line), bounded


def _jobs_of(pid: int) -> set[str | None]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_text()
    except OSError:  # gone: an earlier job's rank
        return set()
    environ = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
    return {environ.get("SLURM_JOB_ID"), environ.get("SLURM_HET_JOB_ID")}
