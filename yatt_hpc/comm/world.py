"""One MPI world, split by the plan into trainer, rollout and GenRM group communicators.

    from mpi4py import MPI
    world = build_world(plan(cfg), MPI.COMM_WORLD, expected_group="trainer")
    world.group_comm          # intra-communicator of this rank's group

Every rank calls this collectively right after MPI starts. A rank whose launch disagrees with the
plan (wrong world size, wrong group for its rank) raises `LaunchMismatch` on every rank alike, so
the launch fails at once with one message instead of hanging in a later collective.
"""
from __future__ import annotations

from dataclasses import dataclass

from yatt_hpc.placement import GROUPS, Plan

LEADER_RANK = 0  # world rank 0 = trainer rank 0: decisions (stop, requeue), never data


class LaunchMismatch(RuntimeError):
    """The running MPI world does not have the shape the plan asks for."""


@dataclass
class World:
    comm: object  # MPI.COMM_WORLD
    plan: Plan
    group: str
    group_comm: object

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
        self.group_comm.Free()


def build_world(plan: Plan, comm, expected_group: str | None = None) -> World:
    """Split `comm` into group communicators (collective). Groups talk over `comm` itself, point to point."""
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
    return World(comm, plan, group, group_comm)
