"""`yatt-hpc submit`: the job goes to Slurm through submitit, heterogeneous when the plan is disjoint.

    sub = submit_run(cfg, plan(cfg), Path("runs/demo"))      # writes runs/demo/config.yaml, sbatch's the job
    sub.job.job_id, sub.job.state, sub.job.result()         # submitit's Job (result: a RunSummary)

submitit has no heterogeneous jobs (upstream issue #1741). `HetSlurmExecutor` keeps submitit's
pickled submission, runner (`submitit.core._submit`), signal handler and `scontrol requeue`, and
replaces only the script text with `render_sbatch(...)`, which adds one `#SBATCH hetjob` component
per group. The pickled callable is `Launcher(run_dir)`: inside the job it starts the one MPMD srun
step, forwards signals to it, waits and returns a `RunSummary`. A `checkpoint()` method added to
`Launcher` makes submitit's preemption handler requeue with it.
"""
from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from yatt_hpc.config import RunConfig
from yatt_hpc.launch.jobs import SlurmError, SlurmUnavailable, require_slurm, wait_job
from yatt_hpc.launch.launcher import Launcher, RunSummary
from yatt_hpc.launch.local import prepare_run_dir
from yatt_hpc.launch.sbatch import component_flags, render_sbatch, time_minutes
from yatt_hpc.placement import Plan


class SubmitError(SlurmError):
    """sbatch refused the job; the message carries sbatch's reason."""


class HetInfoWatcher(SlurmInfoWatcher):
    """sacct lists a het job as N+0, N+1, ... and never as N: report component 0's state for N."""

    def read_info(self, string):  # type: ignore[override]
        info = super().read_info(string)
        for key in list(info):
            base, plus, component = key.partition("+")
            if plus and component == "0":
                info.setdefault(base, info[key])
        return info


class HetSlurmJob(SlurmJob):
    watcher = HetInfoWatcher(delay_s=60)


class HetSlurmExecutor(SlurmExecutor):
    """A SlurmExecutor whose script is `render_sbatch(...)`: het components, requeue flags, our launcher."""

    job_class = HetSlurmJob

    def __init__(self, folder: Path, cfg: RunConfig, plan: Plan, run_dir: Path, python: str = sys.executable) -> None:
        super().__init__(folder, max_num_timeout=cfg.slurm.max_requeues, python=shlex.quote(python))
        self._cfg, self._plan, self._run_dir, self._python = cfg, plan, run_dir, python
        # submitit's timeout accounting (timed-out vs preempted) reads the limit in minutes
        self.update_parameters(time=time_minutes(cfg.slurm.time))

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_sbatch(self._cfg, self._plan, str(self._run_dir), self._python, submitit_folder=str(self.folder))

    def _num_tasks(self) -> int:
        return 1  # one launcher in the batch shell; the ranks are its srun step


@dataclass(frozen=True)
class Submission:
    job: HetSlurmJob
    run_dir: Path
    script: Path

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def job_log(self) -> Path:
        return self.run_dir / "logs" / f"job_{self.job_id}_0.log"


def submit_run(cfg: RunConfig, plan: Plan, run_dir: Path, python: str = sys.executable,
               program: Sequence[str] | None = None) -> Submission:
    """Write RUN_DIR/config.yaml, sbatch the job through submitit, return without waiting."""
    require_slurm("submit")
    run_dir = run_dir.resolve()
    render_sbatch(cfg, plan, str(run_dir), python)  # reject bad values before anything is written
    prepare_run_dir(cfg, run_dir)
    executor = HetSlurmExecutor(run_dir / "submitit", cfg, plan, run_dir, python)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr; we say it in one line
            job = executor.submit(Launcher(str(run_dir), tuple(program) if program else None))
    except submitit_utils.FailedJobError as err:
        reason = " ".join(str(err).split())
        raise SubmitError(f"sbatch refused the job: {reason[-400:]}; check the slurm.* and placement.* "
                          "settings (yatt-hpc plan CONFIG --sbatch shows the script)") from None
    return Submission(job, run_dir, job.paths.submission_file)


def dry_run_text(cfg: RunConfig, plan: Plan, run_dir: Path, python: str = sys.executable) -> str:
    """The exact script `submit` would hand to sbatch (submitit's runner calling our Launcher)."""
    run_dir = run_dir.resolve()
    return render_sbatch(cfg, plan, str(run_dir), python, submitit_folder=str(run_dir / "submitit"))


def submit_command(cfg: RunConfig, plan: Plan, run_dir: Path, wait: bool, echo: Callable[[str], None]) -> int:
    """`yatt-hpc submit`: submit, print where to look, optionally wait; the exit code to return."""
    sub = submit_run(cfg, plan, run_dir)
    logs = sub.run_dir / "logs"
    echo(f"submitted job {sub.job_id}: placement {plan.mode}, {plan.world_size} ranks on {plan.total_nodes} node(s)")
    echo(f"  run dir:   {sub.run_dir}")
    echo(f"  job log:   {sub.job_log}  (one per restart: job_{sub.job_id}_<restart>.log)")
    echo(f"  rank logs: {logs}/rank-<rank>-<group>.log")
    echo(f"  status:    yatt-hpc status {sub.job_id}    logs: yatt-hpc logs {sub.job_id} --follow")
    if not wait:
        return 0
    het = len(component_flags(cfg, plan))
    states = wait_job(sub.job_id, on_change=lambda st: echo(
        f"job {sub.job_id}: " + ", ".join(f"{k} {v}" for k, v in sorted(st.items()))),
        components=het if het > 1 else 0)
    summary = latest_summary(logs, sub.job_id)
    if all(s == "COMPLETED" for s in states.values()):
        echo(f"job {sub.job_id} completed" + (f": {summary}" if summary else ""))
        return 0
    echo(f"job {sub.job_id} ended {'/'.join(sorted(set(states.values())))}"
         + (f": {summary}" if summary else "") + f"; see {sub.job_log}")
    return 1


def latest_summary(logs: Path, job_id: str) -> str | None:
    """The launcher's summary line of the job's last start, if it wrote one."""
    paths = sorted(logs.glob(f"summary_{job_id}_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[-1]))
    if not paths:
        return None
    data = json.loads(paths[-1].read_text())
    return RunSummary(**data).describe()


__all__ = ["HetSlurmExecutor", "SlurmUnavailable", "SubmitError", "Submission", "submit_run", "submit_command"]
