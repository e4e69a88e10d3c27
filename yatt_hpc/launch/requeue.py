"""The leader's actions on Slurm when a run stops early: requeue, and the job's end time.

    requeue_job(job_id)            # scontrol requeue: Slurm restarts the job, SLURM_RESTART_COUNT += 1
    job_end_time(os.environ)       # epoch seconds of the wall-time limit, or None
"""
from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping

log = logging.getLogger(__name__)


def requeue_job(job_id: str) -> bool:
    """Ask Slurm to requeue `job_id`; returns whether it accepted (and logs why not)."""
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, proc.stderr.strip())
        return False
    log.info("scontrol requeue %s accepted", job_id)
    return True


def job_end_time(environ: Mapping[str, str]) -> float | None:
    """SLURM_JOB_END_TIME (set by Slurm >= 21.08 in the batch and step environment)."""
    value = environ.get("SLURM_JOB_END_TIME")
    try:
        return float(value) if value else None
    except ValueError:
        return None
