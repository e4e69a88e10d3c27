"""MPI probe used by tests/mpi and tests/slurm: every rank reports what the world looks like to it.

    mpirun -np 4 python tests/programs/world_probe.py OUT_DIR configs/demo_cpu.yaml [--set k=v ...]

Each rank builds the plan from the config, splits the world into group communicators, does an
allreduce inside its group and a message exchange over every inter-communicator, and writes
OUT_DIR/rank-<world rank>.json. The test reads the files; nothing here asserts.
"""
import json
import os
import socket
import sys

from mpi4py import MPI

from yatt_hpc.comm.world import build_world
from yatt_hpc.config import load_config
from yatt_hpc.placement import plan


def main() -> None:
    out_dir, config = sys.argv[1], sys.argv[2]
    overrides = [a for a in sys.argv[3:] if a != "--set"]
    p = plan(load_config(config, overrides))
    comm = MPI.COMM_WORLD
    world = build_world(p, comm)
    group_sum = world.group_comm.allreduce(world.rank)
    heard = {}
    for other in sorted(g.name for g in p.groups if g.name != world.group):
        # group-rank-0 of each side exchanges its world rank with the other side's first rank
        if world.group_rank == 0:
            first = p.group(other).rank_start
            heard[other] = comm.sendrecv(world.rank, dest=first, source=first)
    report = {
        "world_rank": world.rank, "world_size": comm.Get_size(), "group": world.group,
        "group_rank": world.group_rank, "group_size": world.group_comm.Get_size(), "group_rank_sum": group_sum,
        "heard": heard,
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "slurm_step": os.environ.get("SLURM_STEP_ID"), "is_leader": world.is_leader,
    }
    with open(os.path.join(out_dir, f"rank-{world.rank}.json"), "w") as fh:
        json.dump(report, fh)
    world.free()


if __name__ == "__main__":
    main()
