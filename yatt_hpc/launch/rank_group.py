"""Start one rank of a shared-mode srun step as the group its world rank belongs to.

    srun --ntasks=4 --distribution=arbitrary python -m yatt_hpc.launch.rank_group \\
        trainer=0-1,rollout=2-2,genrm=3-3 -- python -m yatt_hpc.control.worker --run-dir RUN_DIR

Colocated groups share nodes, and Slurm gives each component of a heterogeneous step its own
nodes, so shared modes run one plain step and this shim execs the worker with `--group G` for
the rank range that holds SLURM_PROCID. Standard library only: it runs once per rank at start.
"""
from __future__ import annotations

import os
import sys


def group_for(ranges: str, rank: int) -> str:
    """`trainer=0-1,rollout=2-2,genrm=3-3`, 2 -> `rollout`."""
    for item in ranges.split(","):
        name, _, span = item.partition("=")
        first, _, last = span.partition("-")
        if int(first) <= rank <= int(last or first):
            return name
    raise SystemExit(f"yatt-hpc rank_group: rank {rank} is outside {ranges}; the step has more tasks than the plan")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m yatt_hpc.launch.rank_group RANGES -- PROGRAM [ARGS...]")
    # PMIx's rank is the MPI world rank; SLURM_PROCID counts the same way in plain and het steps
    rank = int(os.environ.get("PMIX_RANK") or os.environ["SLURM_PROCID"])
    program = argv[2:] + ["--group", group_for(argv[0], rank)]
    sys.stdout.flush()
    os.execvp(program[0], program)


if __name__ == "__main__":
    main(sys.argv[1:])
