"""Start one rank of an srun step as the group its world rank belongs to, and record how it ended.

    srun --ntasks=4 --distribution=arbitrary python -m yatt_hpc.launch.rank_group \\
        trainer=0-1,rollout=2-2,genrm=3-3 -- python -m yatt_hpc.runtime.worker --run-dir RUN_DIR

Colocated groups share nodes, and Slurm gives each component of a heterogeneous step its own
nodes, so shared modes run one plain step and this shim starts the worker with `--group G` for
the rank range that holds the task's world rank (heterogeneous steps use it too: one argv).

With `YATT_EXIT_DIR` set (the launcher sets it) the shim runs the program as its child and, once
the child has exited, writes `YATT_EXIT_DIR/rank-NNNN.json` (world rank, group, exit code or
signal, node, pid): the last thing the task does. The launcher reads these records so that it
need not trust srun to return (`step_watch.StepWatch`). The shim forwards nothing: Slurm signals
every process of the step (the child gets SIGUSR2/SIGTERM itself); the shim only outlives the
child, then leaves with the child's status (re-raising its signal, so srun reports it as before).
Standard library only: it runs once per rank at start.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

EXIT_DIR_ENV = "YATT_EXIT_DIR"
_PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


def group_for(ranges: str, rank: int) -> str:
    """`trainer=0-1,rollout=2-2,genrm=3-3`, 2 -> `rollout`."""
    for item in ranges.split(","):
        name, _, span = item.partition("=")
        first, _, last = span.partition("-")
        if int(first) <= rank <= int(last or first):
            return name
    raise SystemExit(f"yatt-hpc rank_group: rank {rank} is outside {ranges}; the step has more tasks than the plan")


def exit_record_name(rank: int) -> str:
    return f"rank-{rank:04d}.json"


def write_exit_record(directory: str, rank: int, group: str, status: int, pid: int) -> None:
    """Atomically write how world rank `rank` ended (`status` as Popen.returncode: -N = signal N)."""
    record = {"rank": rank, "group": group, "pid": pid, "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
              "code": status if status >= 0 else None, "signal": -status if status < 0 else None,
              "time": time.time()}
    os.makedirs(directory, mode=0o755, exist_ok=True)
    final = os.path.join(directory, exit_record_name(rank))
    tmp = f"{final}.tmp"
    with open(tmp, "w") as out:
        json.dump(record, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, final)


def run_and_record(program: list[str], directory: str, rank: int, group: str) -> int:
    """Run `program` as a child, write its exit record, return its Popen-style status."""
    child = subprocess.Popen(program)
    # A Python-level no-op (not SIG_IGN, which a child would inherit): the step's signals reach the
    # child directly from slurmstepd; the shim must only survive them to write the record.
    for sig in _PASSED_ON:
        signal.signal(sig, lambda *_: None)
    status = child.wait()
    try:
        write_exit_record(directory, rank, group, status, child.pid)
    except OSError as err:  # a full or vanished run dir must not change the rank's exit status
        print(f"yatt-hpc rank_group: could not write the exit record of rank {rank}: {err}", file=sys.stderr)
    return status


def leave_like(status: int) -> None:
    """Exit with the child's code, or die of the child's signal (srun then says 'Killed' as before)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status >= 0:
        os._exit(status)
    sig = -status
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal that does not end a process (e.g. SIGCHLD): exit as a shell would


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m yatt_hpc.launch.rank_group RANGES -- PROGRAM [ARGS...]")
    # PMIx's rank is the MPI world rank; SLURM_PROCID counts the same way in plain and het steps
    rank = int(os.environ.get("PMIX_RANK") or os.environ["SLURM_PROCID"])
    group = group_for(argv[0], rank)
    program = argv[2:] + ["--group", group]
    sys.stdout.flush()
    directory = os.environ.get(EXIT_DIR_ENV)
    if not directory:
        os.execvp(program[0], program)
    leave_like(run_and_record(program, directory, rank, group))


if __name__ == "__main__":
    main(sys.argv[1:])
