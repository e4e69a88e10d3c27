"""One MPI world, split by the plan into trainer, rollout and GenRM group communicators.

    from mpi4py import MPI
    world = build_world(plan(cfg), MPI.COMM_WORLD, expected_group="trainer")
    world.group_comm          # intra-communicator of this rank's group
    world.inter["rollout"]    # inter-communicator to another group (remote ranks = that group's ranks)

Every rank calls this collectively right after MPI starts. A rank whose launch disagrees with the
plan (wrong world size, wrong group for its rank) raises `LaunchMismatch` on every rank alike, so
the launch fails at once with one message instead of hanging in a later collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from yatt_hpc.placement import GROUPS, Plan

LEADER_RANK = 0  # world rank 0 = trainer rank 0: decisions (stop, requeue), never data
_INTERCOMM_TAG = 7301


class LaunchMismatch(RuntimeError):
    """The running MPI world does not have the shape the plan asks for."""


@dataclass
class World:
    comm: object  # MPI.COMM_WORLD
    plan: Plan
    group: str
    group_comm: object
    inter: dict[str, object] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def group_rank(self) -> int:
        return self.group_comm.Get_rank()

    @property
    def is_leader(self) -> bool:
        return self.rank == LEADER_RANK

    def free(self) -> None:
        for ic in self.inter.values():
            ic.Free()
        self.inter.clear()
        self.group_comm.Free()


def build_world(plan: Plan, comm, expected_group: str | None = None) -> World:
    """Split `comm` into group communicators and connect every pair of groups (collective)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    problem = ""
    if size != plan.world_size:
        problem = (f"the MPI world has {size} ranks but the plan needs {plan.world_size} "
                   f"({', '.join(f'{g.name}={g.tasks}' for g in plan.groups)}); launch with the command "
                   "`yatt-hpc plan` prints")
    group = plan.group_of(rank) if not problem else "?"
    if not problem and expected_group and expected_group != group:
        problem = (f"world rank {rank} was launched as {expected_group!r} but the plan puts it in {group!r}; "
                   "launch groups in plan order (trainer, rollout, genrm) with the plan's task counts")
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise LaunchMismatch(problems[0])
    color = GROUPS.index(group)
    group_comm = comm.Split(color, rank)
    world = World(comm, plan, group, group_comm)
    for other in GROUPS:
        if other == group:
            continue
        remote_leader = plan.group(other).rank_start  # world rank of the other group's first rank
        # both sides must use the same tag for one pair: derive it from the unordered pair
        pair = tuple(sorted((color, GROUPS.index(other))))
        world.inter[other] = group_comm.Create_intercomm(0, comm, remote_leader, _INTERCOMM_TAG + 3 * pair[0] + pair[1])
    return world
