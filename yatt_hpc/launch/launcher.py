"""The launcher: inside a Slurm allocation, start every group as one MPMD srun step and wait for it.

    python -m yatt_hpc.launch.launcher --run-dir RUN_DIR                    # config from RUN_DIR/config.yaml
    python -m yatt_hpc.launch.launcher --run-dir RUN_DIR --config C [--set k=v ...]   # write it first

This is the one launch entry of a Slurm job: the `sbatch/` scripts exec it, and `yatt-hpc submit`
pickles a `Launcher` that submitit's runner calls. It checks the allocation against the plan, runs
`srun --mpi=pmix --kill-on-bad-exit=1 ...` (`commands.srun_launch`), forwards USR1/USR2/TERM to the
step (then to whatever handler was there before, e.g. submitit's checkpoint-and-requeue), relays the
step's stderr, and on failure names the first failing rank and its group. The result is a
`RunSummary`, also written to RUN_DIR/logs/summary_<job>_<restart>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from yatt_hpc.config import load_config
from yatt_hpc.launch.commands import rank_hosts, render, srun_launch
from yatt_hpc.launch.local import LaunchError, gave_up_step, launch_env, prepare_run_dir
from yatt_hpc.launch.rank_group import EXIT_DIR_ENV
from yatt_hpc.launch.slurm_env import SlurmEnv
from yatt_hpc.placement import Plan, plan
from yatt_hpc.sched.requeue import stop_record_name

FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
EXIT_STEP_ENDED_BY_SLURM = 1  # the code of a step Slurm ended without any rank recording a failure
_WORKER_LINE = re.compile(r"yatt-hpc \[(?P<group>\w+) rank (?P<rank>\d+)\] (?:failed|error): (?P<what>.*)")
_SRUN_LINE = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.*)")
_MPIRUN_LINE = re.compile(r"process rank (?P<rank>\d+) with PID \d+ on node (?P<node>\S+) exited on signal "
                          r"(?P<sig>\d+)(?: \((?P<name>[^)]*)\))?")
# What a rank says when a peer it was talking to directly (Gloo's TCP pairs of the trainers' all-reduce)
# died under it: a consequence, not a cause, when mpirun names a rank that a signal killed.
_PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe", re.IGNORECASE)


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
    _say(f"starting {p.world_size} ranks ({p.mode}): {render(argv)}")
    start = time.monotonic()
    watch = step_watch_for(cfg, p, exits, slurm)
    code, stderr_lines, signals = _run_step(argv, env, run_dir / "logs" / f"step_{tag}.err", watch)
    if code and gave_up_step(run_dir / "logs" / stop_record_name(slurm.job_id, slurm.restart_count)):
        _say(f"the step exited {code} after giving up a step with its checkpoint committed: a stop")
        code = 0
    failure = first_failure(stderr_lines, p, _node_groups(p, slurm), watch.records()) if code else None
    summary = RunSummary(slurm.job_id or "", slurm.restart_count, p.mode, p.world_size, code,
                         round(time.monotonic() - start, 1), failure, render(argv), watch.ended_srun)
    (run_dir / "logs" / f"summary_{tag}.json").write_text(json.dumps(asdict(summary), indent=1) + "\n")
    _say(summary.describe())
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


def expand_nodes(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise LaunchError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()


def _node_groups(p: Plan, slurm: SlurmEnv) -> dict[str, str]:
    """Disjoint: node -> group of its het component (srun numbers tasks per component there)."""
    if p.mode != "disjoint":
        return {}
    return {node: g.name for g, c in zip(p.groups, slurm.components) for node in expand_nodes(c.nodelist)}


def first_failure(lines: Sequence[str], p: Plan, node_groups: Mapping[str, str] | None = None,
                  records: Sequence[Mapping] = ()) -> str | None:
    """Name the rank that failed first: a rank killed by a signal before any other rank failed (its
    exit record says so; what the others print afterwards are consequences), else the worker's own
    line (it says why; not one saying its peer's connection broke while mpirun names a rank a signal
    killed), else the earliest failing exit record, else mpirun's or srun's line.

    srun reports `NODE: task N: Exited with exit code X`; in a heterogeneous step N counts within the
    component, so `node_groups` (node -> group) turns it into a world rank."""
    first = _first_failing(records)
    if first is not None and first.get("signal") is not None:
        return record_failure([first], p)
    killed = next((m for m in map(_MPIRUN_LINE.search, lines) if m), None)
    for line in lines:
        m = _WORKER_LINE.search(line)
        if m and killed and int(killed.group("rank")) != int(m.group("rank")) and _PEER_LOST.search(m.group("what")):
            continue  # it lost the peer mpirun saw killed: what killed that rank came first
        if m:
            rank = int(m.group("rank"))
            return f"{m.group('group')} (world rank {rank}): {m.group('what').strip()}"
    from_records = record_failure(records, p)
    if from_records:
        return from_records
    if killed:
        rank = int(killed.group("rank"))
        where = f"{p.group_of(rank)} (world rank {rank})" if rank < p.world_size else f"rank {rank}"
        name = f" ({killed.group('name')})" if killed.group("name") else ""
        return f"{where} on {killed.group('node')}: killed by signal {killed.group('sig')}{name}"
    reports = [m for m in map(_SRUN_LINE.search, lines) if m]
    culprits = [m for m in reports if not re.match(r"(Killed|Terminated)", m.group("what"))] or reports
    if not culprits:
        return None
    m = culprits[0]
    rank = int(re.split(r"[,\-]", m.group("tasks"))[0])
    group = (node_groups or {}).get(m.group("node"))
    if group:
        rank += p.group(group).rank_start
    where = f"{p.group_of(rank)} (world rank {rank})" if rank < p.world_size else f"task {rank}"
    return f"{where} on {m.group('node')}: {m.group('what').strip()}"


def _first_failing(records: Sequence[Mapping]) -> Mapping | None:
    """The exit record written first among those that are not a clean exit."""
    return next((rec for rec in sorted(records, key=lambda r: (r["time"], r["rank"]))
                 if rec.get("signal") is not None or rec["code"]), None)


def record_failure(records: Sequence[Mapping], p: Plan) -> str | None:
    """Name the first rank (by the time of its record) that did not exit cleanly: the others are
    usually the ones the launcher then took down."""
    rec = _first_failing(records)
    if rec is None:
        return None
    sig = rec.get("signal")
    how = f"killed by signal {sig} ({signal.Signals(sig).name})" if sig is not None else f"exit code {rec['code']}"
    return f"{p.group_of(rec['rank'])} (world rank {rec['rank']}) on {rec['node']}: {how}"


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


class SlurmSteps:
    """Whether Slurm still runs a job step of this allocation (the batch shell's own steps aside).

    `alive()` asks `squeue --steps` for every component's job id at most every `poll_s`; None until a
    step has been seen (srun registers it a moment after it starts) and when squeue cannot answer."""

    _OWN = (".batch", ".extern", ".interactive")

    def __init__(self, job_ids: Sequence[str], poll_s: float = 5.0):
        self.job_ids, self.poll_s = [j for j in job_ids if j], poll_s
        self.seen, self._asked_at, self._last = False, None, None

    def alive(self) -> bool | None:
        now = time.monotonic()
        if not self.job_ids or (self._asked_at is not None and now - self._asked_at < self.poll_s):
            return self._last
        self._asked_at = now
        try:
            out = subprocess.run(["squeue", "-h", "--steps", "-j", ",".join(self.job_ids), "-o", "%i"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return self._last
        if out.returncode != 0:
            return self._last
        running = [s for s in out.stdout.split() if not s.endswith(self._OWN)]
        self.seen = self.seen or bool(running)
        self._last = bool(running) if self.seen else None
        return self._last


class StepWatch:
    """Wait for srun, but no longer than `timeout_s` after the step is over by other evidence.

    The step is over when every rank has written its exit record (`rank_group.write_exit_record`, one
    per world rank, written by the task's shim after the rank's process has exited), or when Slurm no
    longer runs any step of ours (`steps`): a step Slurm cancelled (MPI_Abort, --kill-on-bad-exit)
    SIGKILLs the shims too, so their records never come. srun's return is only the usual way to learn
    it. Slurm 22.05-24.05's mpi/pmix plugin starts one abort agent per heterogeneous component over
    one shared thread handle and can then wait forever for one of them at the end of the step (SchedMD
    ticket 16817, fixed in 24.11 by commit a2e9643): every rank has exited, srun has not. Then srun is
    killed (its shepherd process cancels the step) and the exit code is the ranks'.
    """

    def __init__(self, directory: Path, world_size: int, timeout_s: float, poll_s: float = 0.5,
                 steps: SlurmSteps | None = None):
        self.directory, self.world_size, self.timeout_s, self.poll_s = directory, world_size, timeout_s, poll_s
        self.steps = steps
        self.ended_srun = False

    def records(self) -> list[dict]:
        out = []
        for path in sorted(self.directory.glob("rank-*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # written atomically: only a vanished dir gets here
                continue
        return out

    def _over(self) -> str | None:
        if len(self.records()) >= self.world_size:
            return "records"
        if self.steps is not None and self.steps.alive() is False:
            return "slurm"
        return None

    def wait(self, proc: subprocess.Popen) -> int:
        over_at, how = None, None
        while True:
            try:
                return proc.wait(timeout=self.poll_s)
            except subprocess.TimeoutExpired:
                pass
            if over_at is None:
                how = self._over()
                if how is not None:
                    over_at = time.monotonic()
                continue
            if how == "slurm" and self._over() == "records":
                how = "records"
            if time.monotonic() - over_at < self.timeout_s:
                continue
            return self._end_srun(proc, how)

    def _end_srun(self, proc: subprocess.Popen, how: str) -> int:
        records = self.records()
        code = ranks_exit_code(records)
        if how == "records":
            _say(f"every one of the {self.world_size} ranks has exited (records in {self.directory}) but srun has not "
                 f"returned {self.timeout_s:g}s later (a known Slurm mpi/pmix hang at the end of heterogeneous steps, "
                 f"SchedMD ticket 16817, fixed in Slurm 24.11): ending srun; the step's exit code is the ranks' ({code})")
        else:
            code = code or EXIT_STEP_ENDED_BY_SLURM  # ranks without a record were killed with their shims
            _say(f"Slurm no longer runs the step ({len(records)} of {self.world_size} ranks left an exit record; "
                 f"the others were killed with the step) but srun has not returned {self.timeout_s:g}s later "
                 f"(the Slurm mpi/pmix hang of SchedMD ticket 16817, fixed in Slurm 24.11): ending srun; "
                 f"the step's exit code is {code}")
        proc.kill()
        proc.wait()
        self.ended_srun = True
        return code


def step_watch_for(cfg, p: Plan, exits: Path, slurm: SlurmEnv | None = None) -> StepWatch:
    """The watch of the step that runs plan `p`: every world rank's exit record under `exits` (or, in
    an allocation, Slurm's own list of running steps), then at most `cfg.slurm.step_exit_timeout_s`
    for srun to return."""
    steps = SlurmSteps([c.job_id for c in slurm.components]) if slurm is not None and slurm.in_allocation else None
    return StepWatch(exits, p.world_size, cfg.slurm.step_exit_timeout_s, steps=steps)


def ranks_exit_code(records: Sequence[Mapping]) -> int:
    """The step's code from the ranks' records: 0 if all are 0, else the lowest rank's non-zero code
    (a signal N counts as 128 + N, as a shell reports it)."""
    for rec in sorted(records, key=lambda r: r["rank"]):
        code = rec["code"] if rec.get("signal") is None else 128 + rec["signal"]
        if code:
            return code
    return 0


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
            _say(f"forwarding {signal.Signals(sig).name} to the step")
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
    _say(f"the run stopped at step {decision['step']}: {decision['reason']}")
    if not decision["requeue"]:
        return "stopped"
    # submitit binds its requeue handler to the preemption signal only (others it just logs)
    requeue_signal = next((s for s in signals.received
                           if getattr(signals.previous.get(s), "__name__", "") == "checkpoint_and_try_requeue"), None)
    if requeue_signal is not None:
        _say("requeueing through submitit")
        signals.previous[requeue_signal](requeue_signal, None)  # requeues, then exits this process
        return "requeued"
    from yatt_hpc.launch.requeue import requeue_job

    return "requeued" if requeue_job(slurm.job_id) else "requeue_failed"


def _say(text: str) -> None:
    print(f"yatt-hpc launcher: {text}", file=sys.stderr, flush=True)


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
        _say(f"error: {err}")
        sys.exit(2)
    sys.exit(summary.return_code)


if __name__ == "__main__":
    main()
