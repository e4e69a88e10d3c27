"""Failure attribution: which rank of a failed step failed first, and why, in one line for the job log.

    from yatt_hpc.launch.failures import first_failure, node_groups_of
    first_failure(stderr_lines, plan)                                   # mpirun (`yatt-hpc run`)
    first_failure(stderr_lines, plan, node_groups_of(plan, slurm), watch.records())   # srun, in an allocation
    # -> "rollout (world rank 2) on n1: killed by signal 9 (Killed)"

When one rank fails the others soon fail too (their peers are gone, the launcher takes them down), so
the line to show is the first cause, not the last report. The evidence: the per-rank exit records
(`rank_group.write_exit_record`), the workers' own `yatt-hpc [GROUP rank N] failed: ...` lines, mpirun's
`exited on signal` line and srun's `task N: ...` lines; `first_failure` says which wins when they
disagree. Both launchers use it: `launcher` for a Slurm step, `local` for mpirun.
"""
from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Mapping, Sequence

from yatt_hpc.launch.local import LaunchError
from yatt_hpc.launch.slurm_env import SlurmEnv
from yatt_hpc.placement import Plan

_WORKER_LINE = re.compile(r"yatt-hpc \[(?P<group>\w+) rank (?P<rank>\d+)\] (?:failed|error): (?P<what>.*)")
_SRUN_LINE = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.*)")
_MPIRUN_LINE = re.compile(r"process rank (?P<rank>\d+) with PID \d+ on node (?P<node>\S+) exited on signal "
                          r"(?P<sig>\d+)(?: \((?P<name>[^)]*)\))?")
# What a rank says when a peer it was talking to directly (Gloo's TCP pairs of the trainers' all-reduce)
# died under it: a consequence, not a cause, when mpirun names a rank that a signal killed.
_PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe", re.IGNORECASE)


def expand_nodes(nodelist: str) -> list[str]:
    """The node names of a Slurm node list (`n[1-3]` -> n1 n2 n3), by scontrol."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise LaunchError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()


def node_groups_of(p: Plan, slurm: SlurmEnv) -> dict[str, str]:
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
