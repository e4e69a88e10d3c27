"""Pure rendering of the one MPMD launch that starts every group as ranks of one MPI world.

    argv = local_launch(plan, run_dir)            # mpirun ... : ... : ...   (no Slurm)
    argv = srun_launch(plan, run_dir)             # srun --mpi=pmix ... (inside an allocation)
    print(shlex.join(argv))

Each component runs the same worker module with `--group NAME`; the worker checks its world
rank against the plan, so a launch that disagrees with the plan fails at start, not mid-run.
Nothing here reads the environment or touches files; `launch/` is the only package that
executes these commands.
"""
from __future__ import annotations

import shlex
from collections.abc import Sequence

from yatt_hpc.placement import Plan

WORKER_MODULE = "yatt_hpc.runtime.worker"
RANK_GROUP_MODULE = "yatt_hpc.launch.rank_group"


def worker_argv(python: str, group: str, run_dir: str) -> list[str]:
    """The command one rank of `group` runs; the resolved config is `run_dir/config.yaml`."""
    return [python, "-m", WORKER_MODULE, "--group", group, "--run-dir", run_dir]


def local_launch(plan: Plan, run_dir: str, python: str = "python3", mpirun: str = "mpirun") -> list[str]:
    """`mpirun` MPMD command for one machine: every group's ranks in one MPI_COMM_WORLD.

    Binding is off and oversubscription allowed: the embedded default runs more controller ranks
    than there are cores, and pinned ranks would queue behind each other.
    """
    argv = [mpirun, "--bind-to", "none", "--oversubscribe"]
    for index, group in enumerate(plan.groups):
        if index:
            argv.append(":")
        argv += ["-np", str(group.tasks)] + worker_argv(python, group.name, run_dir)
    return argv


def srun_launch(plan: Plan, run_dir: str, python: str = "python3", program: Sequence[str] | None = None) -> list[str]:
    """`srun --mpi=pmix` command inside an allocation: every group's ranks in one step, one MPI world.

    Disjoint plans are heterogeneous jobs: one MPMD component per het group (`--het-group=i`).
    Shared plans (colocate/partial) cannot use MPMD components: Slurm gives each component of a
    heterogeneous step its own nodes. Instead one step of `world_size` tasks is placed rank by rank
    from SLURM_HOSTFILE (`rank_hosts`, `--distribution=arbitrary`) and `yatt_hpc.launch.rank_group`
    turns each task's SLURM_PROCID into its `--group`. `program` replaces the worker (tests).
    """
    argv = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1"]
    if plan.mode == "disjoint":
        argv.append(f"--het-group=0-{len(plan.groups) - 1}")
    else:
        cpus = max(g.cpus_per_task for g in plan.groups)
        argv += [f"--ntasks={plan.world_size}", "--distribution=arbitrary", f"--cpus-per-task={cpus}"]
    ranges = ",".join(f"{g.name}={g.rank_start}-{g.rank_stop - 1}" for g in plan.groups)
    return argv + [python, "-m", RANK_GROUP_MODULE, ranges, "--", *_program(python, program), "--run-dir", run_dir]


def rank_hosts(plan: Plan, nodes: Sequence[str]) -> list[str]:
    """The SLURM_HOSTFILE of a shared-mode step: one host per world rank, in rank order.

    Each group spreads over all nodes, `tasks_per_node` consecutive ranks per node, so trainer
    ranks of one node stay contiguous (tensor parallelism inside a node).
    """
    assert plan.mode != "disjoint" and len(nodes) == plan.total_nodes, (plan.mode, nodes)
    return [node for g in plan.groups for node in nodes for _ in range(g.tasks_per_node)]


def _program(python: str, program: Sequence[str] | None) -> list[str]:
    return list(program) if program else [python, "-m", WORKER_MODULE]


def render(argv: Sequence[str]) -> str:
    """Shell text for an argv, every word quoted where needed; MPMD `:` separators stay bare."""
    return " ".join(":" if word == ":" else shlex.quote(word) for word in argv)
