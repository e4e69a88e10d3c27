"""Pure rendering of the one MPMD launch that starts every group as ranks of one MPI world.

    argv = local_launch(plan, run_dir)            # mpirun ... : ... : ...   (no Slurm)
    argv = srun_launch(plan, run_dir)             # srun --mpi=pmix ... : ... : ...  (inside an allocation)
    print(shlex.join(argv))

Each component runs the same worker module with `--group NAME`; the worker checks its world
rank against the plan, so a launch that disagrees with the plan fails at start, not mid-run.
Nothing here reads the environment or touches files; `launch/` is the only package that
executes these commands.
"""
from __future__ import annotations

import shlex
from typing import Sequence

from yatt_hpc.placement import GroupPlan, Plan

WORKER_MODULE = "yatt_hpc.control.worker"


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


def srun_launch(plan: Plan, run_dir: str, python: str = "python3") -> list[str]:
    """`srun --mpi=pmix` MPMD command inside an allocation: one step component per group.

    Disjoint plans address het-job components with `--het-group=i`; shared plans give each
    component its own shape on the same nodes and `--overlap`, since groups share devices in time.
    """
    argv = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1"]
    for index, group in enumerate(plan.groups):
        if index:
            argv.append(":")
        argv += _component_flags(plan, group) + worker_argv(python, group.name, run_dir)
    return argv


def _component_flags(plan: Plan, group: GroupPlan) -> list[str]:
    if group.slurm.kind == "het_component":
        return [f"--het-group={group.slurm.component}"]
    flags = [f"--nodes={group.nodes}", f"--ntasks={group.tasks}", f"--ntasks-per-node={group.tasks_per_node}",
             f"--cpus-per-task={group.cpus_per_task}", "--overlap"]
    if group.devices_per_task:
        flags.append(f"--gpus-per-task={group.devices_per_task}")
    return flags


def render(argv: Sequence[str]) -> str:
    """Shell text for an argv, every word quoted where needed; MPMD `:` separators stay bare."""
    return " ".join(":" if word == ":" else shlex.quote(word) for word in argv)
