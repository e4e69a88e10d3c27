"""Submit hand-written batch scripts from tests; watch them with `yatt_hpc.launch.jobs.wait_job`
(it polls squeue/sacct every second here: `sbatch --wait` polls too slowly)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path


def sbatch(script: str, workdir: Path) -> str:
    path = workdir / "job.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", f"--chdir={workdir}", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def job_rank_pid(run_dir: Path, rank: int, job: str, deadline: float) -> int:
    """The pid world rank `rank` logged at start (`started: pid N`), checked to be a process of job
    `job` (its SLURM_JOB_ID or SLURM_HET_JOB_ID) before anyone signals it: nothing is matched by name."""
    while True:
        logs = list((run_dir / "logs").glob(f"rank-{rank:04d}-*.log"))
        text = logs[0].read_text() if logs else ""
        if "started: pid " in text:
            pid = int(text.rsplit("started: pid ", 1)[1].split()[0])
            environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            jobs = {environ.get("SLURM_JOB_ID"), environ.get("SLURM_HET_JOB_ID")}
            assert job in jobs, f"pid {pid} belongs to job {jobs}, not to this test's job {job}"
            return pid
        assert time.monotonic() < deadline, f"rank {rank} never logged its pid"
        time.sleep(0.1)  # polling for the event (the log line), bounded
