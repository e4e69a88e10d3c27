"""Print a plan as a rich table plus the exact launch lines (`yatt-hpc plan`)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from yatt_hpc.launch.commands import local_launch, render, srun_launch
from yatt_hpc.placement.plan import Plan


def layout_text(layout: tuple[tuple[str, int], ...]) -> str:
    return " ".join(f"{dim}{size}" for dim, size in layout)


def plan_table(p: Plan) -> Table:
    table = Table(title=f"placement: {p.mode}  ({p.world_size} ranks, {p.total_nodes} nodes, "
                        f"{p.total_devices} devices)")
    for col in ("group", "ranks", "nodes", "tasks/node", "gpus/task", "cpus/task", "layout", "slurm"):
        table.add_column(col, justify="left" if col in ("group", "layout", "slurm") else "right")
    for g in p.groups:
        table.add_row(g.name, f"{g.rank_start}-{g.rank_stop - 1}", str(g.nodes), str(g.tasks_per_node),
                      str(g.devices_per_task) if g.devices_per_task else "cpu", str(g.cpus_per_task),
                      layout_text(g.layout), g.slurm.describe())
    return table


def print_plan(p: Plan, run_dir: str, console: Console, python: str = "python3") -> None:
    console.print(plan_table(p))
    console.print("leader (decisions only): world rank 0 = trainer rank 0")
    if p.dynamic_split:
        pool, first = p.pool_ranks, p.group("rollout").tasks
        console.print(f"dynamic split: ranks {pool.start}-{pool.stop - 1} are one engine pool, re-split by load every "
                      f"step (step 1: {first} rollout, {len(pool) - first} GenRM)")
    console.print("\nlocal launch (yatt-hpc run, no Slurm):")
    console.print(render(local_launch(p, run_dir, python=python)), markup=False, highlight=False, soft_wrap=True)
    console.print("\nSlurm launch (inside the allocation):")
    console.print(render(srun_launch(p, run_dir, python=python)), markup=False, highlight=False, soft_wrap=True)
