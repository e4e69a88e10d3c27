"""Start a run: write RUN_DIR/config.yaml and launch the one MPMD command for the plan.

    code = launch_run(cfg, plan, Path("runs/demo"))     # mpirun locally; srun --mpi=pmix in an allocation

Inside a Slurm allocation (SLURM_JOB_ID set) this hands over to `launcher.launch_in_allocation`
(one `srun --mpi=pmix` step, the same entry as `submit` and the sbatch scripts); anywhere else it
runs `mpirun`. The environment is read here, once, at the edge.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from yatt_hpc.config import RunConfig, to_yaml
from yatt_hpc.launch.commands import local_launch, render
from yatt_hpc.placement import Plan
from yatt_hpc.sched.requeue import stop_record_name


class LaunchError(Exception):
    """The launcher itself is missing or unusable (e.g. no mpirun)."""


def prepare_run_dir(cfg: RunConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    (run_dir / "logs").mkdir(exist_ok=True, mode=0o755)
    target = run_dir / "config.yaml"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, target)  # a reader never sees half a config


def launch_env(environ: dict[str, str]) -> dict[str, str]:
    env = dict(environ)
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # more controller ranks than cores: waiting ranks must yield the CPU instead of spinning
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    # a stop that gives up a long step exits every rank without MPI_Finalize (its step's messages
    # are still in flight) once the checkpoint is committed: mpirun must not call that a failure
    env.setdefault("OMPI_MCA_orte_allowed_exit_without_sync", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the ranks' stdout is a pseudo-terminal of mpirun's: whether to style is the user's terminal's to say
    env.setdefault("YATT_COLOR", "1" if sys.stdout.isatty() and "NO_COLOR" not in environ else "0")
    return env


def check_one_host(plan: Plan) -> None:
    """Refuse a GPU plan that spans nodes: mpirun puts every rank on this host, where each node's ranks
    count their GPUs from 0 (`Plan.device_ids`), so ranks meant for other nodes would share devices
    (and a collective weight group would hold two ranks on one GPU)."""
    if plan.total_nodes > 1 and any(g.devices_per_task for g in plan.groups):
        raise LaunchError(f"this plan spans {plan.total_nodes} nodes (placement.mode={plan.mode}) with GPUs, but a "
                          "local run starts every rank on this host, where ranks of different nodes would drive the "
                          "same GPU indices; submit it (`yatt-hpc submit`) or run it inside a Slurm allocation of "
                          "that many nodes, or for one node set every group's `nodes: 1` (placement.mode=colocate or "
                          "partial share the node's GPUs in turn)")


def launch_argv(plan: Plan, run_dir: Path, environ: dict[str, str]) -> list[str]:
    check_one_host(plan)
    mpirun = shutil.which("mpirun")
    if not mpirun:
        raise LaunchError("mpirun not found on PATH; install Open MPI (`make system-deps` or "
                          "`apt-get install openmpi-bin libopenmpi-dev libpmix2`), or run inside a Slurm allocation")
    return local_launch(plan, str(run_dir), python=sys.executable, mpirun=mpirun)


def launch_run(cfg: RunConfig, plan: Plan, run_dir: Path) -> int:
    """Launch and wait; returns the launcher's exit code (2 = a rank reported a user error)."""
    prepare_run_dir(cfg, run_dir)
    environ = dict(os.environ)
    if environ.get("SLURM_JOB_ID"):  # inside an allocation: the same entry as sbatch scripts and submit
        from yatt_hpc.launch.launcher import launch_in_allocation
        from yatt_hpc.launch.slurm_env import SlurmEnv

        return launch_in_allocation(run_dir, SlurmEnv.from_environ(environ)).return_code
    argv = launch_argv(plan, run_dir, environ)
    (run_dir / "launch.sh").write_text("#!/bin/sh\n" + render(argv) + "\n")
    # Own session: a terminal Ctrl-C must not make mpirun kill the ranks mid-write. We forward
    # SIGINT/SIGTERM/SIGUSR2 as SIGUSR2, which mpirun and srun pass to every rank: they agree to
    # stop at the next step boundary (or give up the step after checkpoint.stop_grace_s), save, exit.
    record = run_dir / "logs" / stop_record_name(None, 0)
    record.unlink(missing_ok=True)
    proc = subprocess.Popen(argv, env=launch_env(environ), start_new_session=True, stderr=subprocess.PIPE, text=True,
                            errors="replace")
    lines: list[str] = []
    relay = threading.Thread(target=_relay, args=(proc.stderr, lines), daemon=True)
    relay.start()
    forward = lambda signum, _frame: proc.send_signal(signal.SIGUSR2)  # noqa: E731
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    relay.join(timeout=10)
    if code and gave_up_step(record):
        return 0
    if code:
        from yatt_hpc.launch.failures import first_failure

        failure = first_failure(lines, plan)
        print(f"yatt-hpc: the run failed (mpirun exit {code})" + (f"; first failure: {failure}" if failure else "")
              + f"; per-rank logs in {run_dir / 'logs'}; the same command resumes from the last checkpoint",
              file=sys.stderr, flush=True)
    return code


def _relay(stream, lines: list[str]) -> None:
    """Copy mpirun's stderr to ours as it comes, keeping the lines that can name a failure."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        if "yatt-hpc [" in line or "exited on signal" in line:
            lines.append(line)


def gave_up_step(record: Path) -> bool:
    """Whether the leader's stop record says the run gave up a step (stop watchdog) and committed the
    one before. Its ranks exit without MPI_Finalize, the step's messages in flight: an MPI launcher
    may call that a failure (a non-zero code, a peer that saw its TCP connection drop); it is a stop."""
    return record.exists() and bool(json.loads(record.read_text()).get("abandoned"))
