"""The launcher: inside a Slurm allocation, start every group as one MPMD srun step and wait for it.

    python -m yatt_hpc.launch.launcher --run-dir RUN_DIR                    # config from RUN_DIR/config.yaml
    python -m yatt_hpc.launch.launcher --run-dir RUN_DIR --config C [--set k=v ...]   # write it first

This is the one launch entry of a Slurm job: the `sbatch/` scripts exec it, and `yatt-hpc submit`
pickles a `Launcher` that submitit's runner calls. It checks the allocation against the plan, runs
`srun --mpi=pmix --kill-on-bad-exit=1 ...` (`commands.srun_launch`), forwards USR1/USR2/TERM to the
step (then to whatever handler was there before, e.g. submitit's checkpoint-and-requeue), relays the
step's stderr, ends a srun that outlives its ranks (`step_watch`), and on failure names the first
failing rank and its group (`failures`). The result is a `RunSummary`, also written to
RUN_DIR/logs/summary_<job>_<restart>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from yatt_hpc.config import load_config
from yatt_hpc.launch.commands import rank_hosts, render, srun_launch
from yatt_hpc.launch.failures import expand_nodes, first_failure, node_groups_of
from yatt_hpc.launch.local import LaunchError, gave_up_step, launch_env, prepare_run_dir
from yatt_hpc.launch.rank_group import EXIT_DIR_ENV
from yatt_hpc.launch.slurm_env import SlurmEnv
from yatt_hpc.launch.step_watch import StepWatch, say, step_watch_for
from yatt_hpc.placement import Plan, plan
from yatt_hpc.sched.requeue import stop_record_name

FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


class StepFailed(RuntimeError):
    """The srun step ended non-zero; the message is the run summary."""


@dataclass(frozen=True)
class RunSummary:
    job_id: str
    restart_count: int
    mode: str
    world_size: int
    return_code: int
    seconds: float
    failure: str | None
    launch: str
    ended_srun: bool = False  # every rank had exited and srun had not returned: the launcher ended it

    def describe(self) -> str:
        head = f"job {self.job_id} start {self.restart_count}: {self.mode}, {self.world_size} ranks, " \
               f"exit {self.return_code} after {self.seconds:.1f}s"
        return head + (f"; first failure: {self.failure}" if self.failure else "")


@dataclass(frozen=True)
class Launcher:
    """The callable `yatt-hpc submit` hands to submitit: runs in the batch shell of the job."""

    run_dir: str
    program: tuple[str, ...] | None = None  # replaces the worker (tests); None runs yatt_hpc.runtime.worker

    def __call__(self) -> RunSummary:
        summary = launch_in_allocation(Path(self.run_dir), SlurmEnv.from_environ(os.environ), self.program)
        if summary.return_code:
            raise StepFailed(summary.describe())
        return summary


def launch_in_allocation(run_dir: Path, slurm: SlurmEnv, program: Sequence[str] | None = None) -> RunSummary:
    """Start the plan of RUN_DIR/config.yaml as one srun step in this allocation; wait; summarize."""
    if not slurm.in_allocation:
        raise LaunchError("the launcher runs inside a Slurm job (SLURM_JOB_ID is unset); "
                          "use `yatt-hpc submit`, `sbatch sbatch/...`, or `yatt-hpc run` outside Slurm")
    run_dir = run_dir.resolve()
    cfg = load_config(run_dir / "config.yaml")
    p = plan(cfg)
    check_allocation(p, slurm)
    argv = srun_launch(p, str(run_dir), python=sys.executable, program=program)
    env = launch_env({**os.environ, **cfg.slurm.env})  # hand-edited scripts get slurm.env too
    tag = f"{slurm.job_id}_{slurm.restart_count}"
    if p.mode != "disjoint":
        hostfile = run_dir / "logs" / f"hosts_{tag}"
        hostfile.write_text("\n".join(rank_hosts(p, expand_nodes(slurm.nodelist))) + "\n")
        env["SLURM_HOSTFILE"] = str(hostfile)
    exits = run_dir / "logs" / f"exits_{tag}"
    shutil.rmtree(exits, ignore_errors=True)  # a rerun of the same job start must not count old records
    env[EXIT_DIR_ENV] = str(exits)
    say(f"starting {p.world_size} ranks ({p.mode}): {render(argv)}")
    start = time.monotonic()
    watch = step_watch_for(cfg, p, exits, slurm)
    code, stderr_lines, signals = _run_step(argv, env, run_dir / "logs" / f"step_{tag}.err", watch)
    if code and gave_up_step(run_dir / "logs" / stop_record_name(slurm.job_id, slurm.restart_count)):
        say(f"the step exited {code} after giving up a step with its checkpoint committed: a stop")
        code = 0
    failure = first_failure(stderr_lines, p, node_groups_of(p, slurm), watch.records()) if code else None
    summary = RunSummary(slurm.job_id or "", slurm.restart_count, p.mode, p.world_size, code,
                         round(time.monotonic() - start, 1), failure, render(argv), watch.ended_srun)
    (run_dir / "logs" / f"summary_{tag}.json").write_text(json.dumps(asdict(summary), indent=1) + "\n")
    say(summary.describe())
    if code == 0:
        act_on_stop(run_dir, slurm, signals)
    return summary


def check_allocation(p: Plan, slurm: SlurmEnv) -> None:
    """The job must have the shape the plan needs (a hand-edited script can drift from its config)."""
    fix = "regenerate the script with `yatt-hpc plan CONFIG --sbatch` or submit with `yatt-hpc submit`"
    comps = slurm.components
    if p.mode == "disjoint":
        if len(comps) != len(p.groups):
            raise LaunchError(f"placement.mode=disjoint needs a heterogeneous job with {len(p.groups)} components "
                              f"(one per group) but job {slurm.job_id} has {len(comps)}; {fix}")
        for g, c in zip(p.groups, comps):
            if c.num_nodes != g.nodes or c.ntasks < g.tasks:
                raise LaunchError(f"het component {c.index} ({g.name}) has {c.num_nodes} nodes / {c.ntasks} tasks but "
                                  f"placement.{g.name} needs {g.nodes} nodes / {g.tasks} tasks; {fix}")
        return
    if len(comps) != 1 or comps[0].num_nodes != p.total_nodes or comps[0].ntasks < p.world_size:
        have = f"{len(comps)} het components" if len(comps) != 1 else \
            f"{comps[0].num_nodes} nodes / {comps[0].ntasks} tasks"
        raise LaunchError(f"placement.mode={p.mode} needs one allocation of {p.total_nodes} nodes and "
                          f"{p.world_size} tasks but job {slurm.job_id} has {have}; {fix}")



def _run_step(argv: list[str], env: dict[str, str], stderr_path: Path,
              watch: StepWatch) -> tuple[int, list[str], SignalLog]:
    """Run srun with its stderr in a regular file, copied live into our stderr (the job log).

    Not a pipe: with srun's stderr on a pipe, heterogeneous steps on the dev cluster left srun hanging
    after every rank had exited more often. srun is not trusted to return: `watch` ends it once every
    rank has recorded its exit and srun has not followed within the timeout."""
    with stderr_path.open("w") as sink:
        proc = subprocess.Popen(argv, env=env, stderr=sink)
        done = threading.Event()
        copier = threading.Thread(target=_copy_new_lines, args=(stderr_path, done), daemon=True)
        copier.start()
        with forward_signals(proc) as signals:
            code = watch.wait(proc)
        done.set()
        copier.join(timeout=10)
    return code, stderr_path.read_text(errors="replace").splitlines(keepends=True), signals



def _copy_new_lines(path: Path, done: threading.Event) -> None:
    with path.open("r", errors="replace") as src:
        while True:
            finished = done.is_set()
            chunk = src.read()
            if chunk:
                sys.stderr.write(chunk)
                sys.stderr.flush()
            if finished:
                return
            done.wait(0.5)


@dataclass
class SignalLog:
    """Signals seen while the step ran, and the handlers that were installed before ours."""

    received: list[int]
    previous: dict[int, object]


@contextmanager
def forward_signals(proc: subprocess.Popen, signals: Sequence[int] = FORWARDED) -> Iterator[SignalLog]:
    """While the step runs, pass these signals on to srun (which signals every rank) and remember them.

    The handler installed before (submitit's checkpoint-and-requeue under `yatt-hpc submit`) is NOT
    called here: requeueing now would kill the ranks before they save. `act_on_stop` calls it after
    the step has exited, if the leader decided to requeue."""
    log = SignalLog([], {sig: signal.getsignal(sig) for sig in signals})

    def handler(sig: int, frame) -> None:
        log.received.append(sig)
        if proc.poll() is None:
            say(f"forwarding {signal.Signals(sig).name} to the step")
            proc.send_signal(sig)

    for sig in signals:
        signal.signal(sig, handler)
    try:
        yield log
    finally:
        for sig, before in log.previous.items():
            signal.signal(sig, before)


def act_on_stop(run_dir: Path, slurm: SlurmEnv, signals: SignalLog) -> str | None:
    """After the step: carry out the leader's stop decision (RUN_DIR/logs/stop_<job>_<restart>.json).

    Requeue through the handler that was there before ours (submitit: pickles the submission and
    runs `scontrol requeue`), or with `scontrol requeue $SLURM_JOB_ID` for hand-written scripts."""
    path = run_dir / "logs" / stop_record_name(slurm.job_id, slurm.restart_count)
    if not path.exists():
        return None
    decision = json.loads(path.read_text())
    say(f"the run stopped at step {decision['step']}: {decision['reason']}")
    if not decision["requeue"]:
        return "stopped"
    # submitit binds its requeue handler to the preemption signal only (others it just logs)
    requeue_signal = next((s for s in signals.received
                           if getattr(signals.previous.get(s), "__name__", "") == "checkpoint_and_try_requeue"), None)
    if requeue_signal is not None:
        say("requeueing through submitit")
        signals.previous[requeue_signal](requeue_signal, None)  # requeues, then exits this process
        return "requeued"
    from yatt_hpc.launch.requeue import requeue_job

    return "requeued" if requeue_job(slurm.job_id) else "requeue_failed"



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start a yatt-hpc run inside a Slurm allocation.")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--config", help="write RUN_DIR/config.yaml from this config first")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--program", nargs="+", help=argparse.SUPPRESS)  # test probes instead of the worker
    args = parser.parse_args(argv)
    from yatt_hpc.config import ConfigError
    from yatt_hpc.placement import PlanError

    try:
        if args.config:
            prepare_run_dir(load_config(args.config, args.overrides), args.run_dir)
        summary = launch_in_allocation(args.run_dir, SlurmEnv.from_environ(os.environ), args.program)
    except (ConfigError, PlanError, LaunchError) as err:
        say(f"error: {err}")
        sys.exit(2)
    sys.exit(summary.return_code)


if __name__ == "__main__":
    main()
