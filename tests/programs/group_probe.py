"""A stand-in for the worker in Slurm launch tests: same arguments, joins the plan's MPI world.

    python tests/programs/group_probe.py --group trainer --run-dir RUN_DIR

Every rank builds the plan from RUN_DIR/config.yaml, checks its world rank belongs to --group
(as the worker does), allreduces in its group, and writes RUN_DIR/probe/rank-<world rank>.json.
Test knobs come from the job environment (exported through `slurm.env`):
YATT_PROBE_SLEEP=S keeps every rank alive S seconds; YATT_PROBE_CRASH_RANK=R makes world rank R
die hard (os._exit(7), no MPI_Abort) while the others wait in a barrier.
"""
import argparse
import json
import os
import socket
import time
from pathlib import Path

from mpi4py import MPI

from yatt_hpc.comm.world import build_world
from yatt_hpc.config import load_config
from yatt_hpc.placement import plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args()
    world = build_world(plan(load_config(args.run_dir / "config.yaml")), MPI.COMM_WORLD, expected_group=args.group)
    total = world.group_comm.allreduce(world.rank)
    time.sleep(float(os.environ.get("YATT_PROBE_SLEEP", "0")))
    if os.environ.get("YATT_PROBE_CRASH_RANK") == str(world.rank):
        print(f"probe: world rank {world.rank} crashing on purpose", flush=True)
        os._exit(7)
    out = args.run_dir / "probe"
    out.mkdir(exist_ok=True)
    report = {"world_rank": world.rank, "world_size": world.comm.Get_size(), "group": world.group,
              "group_rank": world.group_rank, "group_rank_sum": total,
              "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
              "slurm_step": os.environ.get("SLURM_STEP_ID"), "restart": os.environ.get("SLURM_RESTART_COUNT", "0")}
    (out / f"rank-{world.rank}.json").write_text(json.dumps(report))
    world.comm.Barrier()
    world.free()


if __name__ == "__main__":
    main()
