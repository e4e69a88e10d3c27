"""Watching submitted jobs: status (squeue/sacct), logs, cancel — `yatt-hpc status|logs|cancel`.

    require_slurm("status")                     # SlurmUnavailable outside a cluster
    rows = job_rows("42")                       # the job, its het components and steps, group-labelled
    logs = find_logs("42")                      # RUN_DIR from the job's StdOut, then its log files
    cancel("42")

A yatt-hpc job writes its batch output to RUN_DIR/logs/slurm-<job>.out, so the run dir of a job
slurmctld still knows is found from `scontrol show job`; afterwards pass RUN_DIR itself.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.table import Table

from yatt_hpc.placement import GROUPS

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "REVOKED"}
_SACCT_FIELDS = ("JobID", "JobName", "Partition", "State", "Elapsed", "NNodes", "NTasks", "NodeList", "ExitCode")
_JOB_ID = re.compile(r"^\d+$")


class SlurmError(RuntimeError):
    """A Slurm-side problem the user has to fix; `str(err)` is one line naming it and the fix."""


class SlurmUnavailable(SlurmError):
    """No Slurm cluster can be reached from here."""


class JobError(SlurmError):
    """A job query the user has to fix (unknown job, not a yatt-hpc job, ...)."""


def require_slurm(verb: str) -> None:
    missing = [tool for tool in ("sbatch", "squeue", "sacct", "scontrol", "scancel") if not shutil.which(tool)]
    if missing:
        raise SlurmUnavailable(f"yatt-hpc {verb}: no Slurm cluster here ({missing[0]} is not on PATH); run it on a "
                               "Slurm login node, or start the dev cluster: sudo tools/slurm-dev-cluster.sh start")
    ping = _run(["scontrol", "ping"], check=False)
    if ping.returncode or "UP" not in ping.stdout:
        why = " ".join((ping.stdout + ping.stderr).split()) or f"exit {ping.returncode}"
        raise SlurmUnavailable(f"yatt-hpc {verb}: the Slurm controller does not answer ({why}); "
                               "check slurmctld, or start the dev cluster: sudo tools/slurm-dev-cluster.sh start")


def check_job_id(job: str) -> str:
    if not _JOB_ID.match(job):
        raise JobError(f"{job!r} is not a Slurm job id; pass the number `yatt-hpc submit` printed, e.g. 42")
    return job


@dataclass(frozen=True)
class JobRow:
    job_id: str
    group: str
    name: str
    partition: str
    state: str
    elapsed: str
    nodes: str
    tasks: str
    nodelist: str
    exit_code: str


def job_rows(job: str | None) -> list[JobRow]:
    """sacct rows of one job (components and steps) or, without JOB, of the last day's jobs."""
    cmd = ["sacct", "-n", "-P", "-o", ",".join(_SACCT_FIELDS)]
    cmd += ["-j", check_job_id(job)] if job else ["-X", "-S", "now-1days"]
    out = _run(cmd)
    rows = []
    for line in out.stdout.splitlines():
        fields = line.split("|")
        if len(fields) != len(_SACCT_FIELDS):
            continue
        jid = fields[0]
        rows.append(JobRow(jid, group_label(jid), fields[1], fields[2], fields[3].split(" ")[0],
                           *fields[4:]))
    if job and not rows:
        queued = _run(["squeue", "-h", "-j", job, "-o", "%i|%j|%P|%T|%M|%D|%C|%R"], check=False).stdout
        for line in queued.splitlines():
            f = line.split("|")
            rows.append(JobRow(f[0], group_label(f[0]), f[1], f[2], f[3], f[4], f[5], f[6], f[7], ""))
    if job and not rows:
        raise JobError(f"job {job} is unknown to squeue and sacct; check the id (yatt-hpc status lists recent jobs)")
    return rows


def group_label(job_id: str) -> str:
    """`42+1.0` -> `rollout`; `42.batch` -> `launcher`; `42.0` -> `all groups` (shared step)."""
    base, _, step = job_id.partition(".")
    _, plus, component = base.partition("+")
    if step in ("batch", "extern"):
        return "launcher" if step == "batch" else "-"
    if plus and component.isdigit() and int(component) < len(GROUPS):
        return GROUPS[int(component)]
    return "all groups" if step else "job"


def status_table(rows: list[JobRow], title: str) -> Table:
    table = Table(title=title)
    for col in ("job/step", "group", "name", "partition", "state", "elapsed", "nodes", "tasks", "nodelist", "exit"):
        table.add_column(col)
    for r in rows:
        style = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow"}.get(r.state, "red")
        table.add_row(r.job_id, r.group, r.name, r.partition, f"[{style}]{r.state}[/]", r.elapsed, r.nodes,
                      r.tasks, r.nodelist, r.exit_code)
    return table


def print_status(job: str | None, console: Console) -> None:
    rows = job_rows(job)
    title = f"job {job}" if job else "jobs of the last day (yatt-hpc status JOB for components and steps)"
    console.print(status_table(rows, title))


def is_queued(job: str) -> bool:
    return bool(_run(["squeue", "-h", "-j", check_job_id(job)], check=False).stdout.strip())


def top_states(job: str) -> dict[str, str]:
    """sacct state of the job or of each het component (no steps)."""
    return {r.job_id: r.state for r in job_rows(job) if "." not in r.job_id}


def wait_job(job: str, poll_s: float = 2.0, on_change=None, timeout_s: float | None = None,
             components: int = 0) -> dict[str, str]:
    """Block until the job left the queue and sacct shows every component final; return those states.

    ``components``: the job is heterogeneous with that many components; wait until sacct lists each
    of N+0, N+1, ... (right after a het job ends sacct can show a plain N, final, for a few polls)."""
    last: dict[str, str] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        queued = is_queued(job)
        states = top_states(job)
        settled = states == last  # sacct can briefly list a finished het job as N before N+0, N+1, ...
        if states != last and on_change:
            on_change(states)
        last = states
        listed = all(f"{job}+{i}" in states for i in range(components))
        if settled and listed and not queued and states and all(s in FINAL for s in states.values()):
            return states
        time.sleep(poll_s)
    raise JobError(f"job {job} did not finish within {timeout_s:.0f} s (states: {last}); "
                   f"yatt-hpc status {job} / yatt-hpc logs {job} show where it stands")


def cancel(job: str) -> None:
    """End JOB for good. A run saves and requeues itself on a stop signal (preemption, the time limit), and
    scancel's SIGTERM is one too: without this the job came back as a new attempt (measured with B7: a
    cancelled demo job restarted 14 s later). So the job is made non-requeueable first (all het components:
    the leader's `scontrol requeue` is then refused), and scancel's SIGTERM still lets the ranks save."""
    job = check_job_id(job)
    _run(["scontrol", "update", f"JobId={job}", "Requeue=0"], check=False)  # a finished job: scancel says so
    out = _run(["scancel", job], check=False)
    if out.returncode:
        raise JobError(f"scancel {job} failed: {' '.join(out.stderr.split())}; check the id with yatt-hpc status")


@dataclass(frozen=True)
class JobLogs:
    run_dir: Path
    job: str | None

    def job_logs(self) -> list[Path]:
        """Launcher logs, one per (re)start, oldest first."""
        pattern = f"job_{self.job}_*.log" if self.job else "job_*_*.log"
        return sorted((self.run_dir / "logs").glob(pattern), key=_restart_key)

    def rank_logs(self, group: str) -> list[Path]:
        return sorted((self.run_dir / "logs").glob(f"rank-*-{group}.log"))


def find_logs(job_or_dir: str) -> JobLogs:
    """Logs of a job id (run dir from `scontrol show job`) or of a run dir given directly."""
    path = Path(job_or_dir)
    if not _JOB_ID.match(job_or_dir):
        if (path / "logs").is_dir():
            return JobLogs(path, None)
        raise JobError(f"{job_or_dir!r} is neither a job id nor a run directory with logs/; pass the job id "
                       "`yatt-hpc submit` printed or the --run-dir of the run")
    out = _run(["scontrol", "show", "job", job_or_dir], check=False)
    stdout = next((line.strip()[len("StdOut="):] for line in out.stdout.splitlines()
                   if line.strip().startswith("StdOut=")), None)
    if stdout is None:
        raise JobError(f"slurmctld no longer knows job {job_or_dir}; pass its run directory instead: "
                       "yatt-hpc logs RUN_DIR")
    log = Path(stdout)
    if log.parent.name != "logs" or not log.name.startswith("slurm-"):
        raise JobError(f"job {job_or_dir} writes to {stdout}, not to RUN_DIR/logs/slurm-<job>.out: it was not "
                       "submitted by yatt-hpc; read its output there")
    return JobLogs(log.parent.parent, job_or_dir)


def show_logs(logs: JobLogs, group: str | None, follow: bool, out: TextIO = sys.stdout) -> None:
    """Print the launcher logs (or a group's rank logs); with follow, keep printing until the job ends."""
    offsets: dict[Path, int] = {}

    def files() -> list[Path]:
        return logs.rank_logs(group) if group else logs.job_logs()

    def drain() -> None:
        for path in files():
            with path.open("rb") as fh:
                fh.seek(offsets.get(path, 0))
                data = fh.read()
            if path not in offsets:
                out.write(f"==> {path} <==\n")
            offsets[path] = offsets.get(path, 0) + len(data)
            out.write(data.decode("utf-8", "replace"))
        out.flush()

    drain()
    if not offsets:
        what = f"rank logs of group {group}" if group else "launcher logs"
        out.write(f"(no {what} yet in {logs.run_dir / 'logs'})\n")
    while follow:
        time.sleep(1.0)
        drain()
        if logs.job and not is_queued(logs.job):
            drain()
            return


def _restart_key(path: Path) -> tuple[int, str]:
    tail = path.stem.rsplit("_", 1)[-1]
    return (int(tail) if tail.isdigit() else 0, path.name)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmUnavailable(f"{cmd[0]} is not on PATH; run on a Slurm login node") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"`{' '.join(cmd)}` did not answer within 60 s; is slurmctld/slurmdbd up?") from None
    if check and out.returncode:
        raise JobError(f"`{' '.join(cmd)}` failed: {' '.join(out.stderr.split())}")
    return out
