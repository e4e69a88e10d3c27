"""The program every rank runs: join the MPI world, become a trainer, rollout, GenRM or tools controller.

    python -m yatt_hpc.runtime.worker --group trainer --run-dir RUN_DIR     # one rank; see `yatt-hpc plan`

`yatt-hpc run` (mpirun) and `yatt-hpc submit` (srun --mpi=pmix) start it in one MPMD launch; the
resolved config is RUN_DIR/config.yaml. Each rank logs to RUN_DIR/logs/rank-NNNN-GROUP.log.

Failure policy: any error on any rank aborts the whole MPI world at once (MPI_Abort), so a broken
rank never leaves the others waiting in a receive. A user error (bad data, missing model file,
mismatched launch) prints one line naming the cause and exits 2; anything else prints where the
traceback is logged and exits 1.

Safe as the main module of a `spawn` child: SGLang starts its scheduler and detokenizer with the
multiprocessing `spawn` method, whose children re-run this module (as `__mp_main__`, so not `main()`).
Its top level therefore imports the standard library only: above all not mpi4py, whose import runs
MPI_Init, which in a child would join the world with the parent's PMIx identity
(tests/unit/test_spawn_safety.py checks it).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

EXIT_USER_ERROR, EXIT_BUG = 2, 1


def setup_logging(run_dir: Path, rank: int, group: str, level: str) -> Path:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank-{rank:04d}-{group}.log"
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter(f"%(asctime)s {group}[{rank}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)
    quiet_known_warnings()
    return path


# Third-party start-up notices that tell a user of this product nothing: Megatron-Core says at each import
# that it falls back to its local (plain torch) kernels, which is what the trainer builds on purpose
# (train/megatron_model.py: the local layer spec), and that its FSDP module found Megatron-Core.
_KNOWN_WARNINGS = (r"(Transformer Engine and )?Apex (is|are) not installed", r"full scope is deprecated")
_KNOWN_INFO = ("megatron.core.distributed.fsdp",)


def quiet_known_warnings() -> None:
    import warnings

    for message in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for name in _KNOWN_INFO:
        logging.getLogger(name).setLevel(logging.WARNING)


def leader_console():
    """The leader's console: styled only when the user's terminal is (the launcher says so in YATT_COLOR:
    mpirun gives every rank a pseudo-terminal, so the rank's own isatty() says yes even when the user
    redirected the run's output to a file). NO_COLOR drops the colours (rich reads it)."""
    from rich.console import Console

    color = os.environ.get("YATT_COLOR")
    terminal = sys.stdout.isatty() if color is None else color == "1"
    return Console(force_terminal=terminal, width=160)


def build_controller(world, cfg, run_dir: Path, stats, protocol):
    from yatt_hpc.roles.colocation import set_host_memory, set_phase_threads

    idle, active = world.plan.phase_threads(world.group)
    set_phase_threads(idle, active)
    set_host_memory(world.plan.host_memory_in_turns)
    if cfg.placement.mode == "colocate" and not world.plan.device_ids(world.rank):  # the cores are the devices
        logging.getLogger(__name__).info(
            "colocated on CPU: %d torch thread(s) in this rank's phase, %d outside it (placement.node_cpus=%s%s)",
            active, idle, cfg.placement.node_cpus,
            ": the most a group asks of the node; set it to the node's cores" if cfg.placement.node_cpus is None else "")
    if world.group == "trainer":
        from yatt_hpc.roles.trainer import TrainerController

        return TrainerController(world, cfg, run_dir, stats, protocol)
    if world.group == "tools":  # the tools group: runs the rollout ranks' tool calls (placement.tools)
        from yatt_hpc.agent.tools_group import ToolsController

        return ToolsController(world, cfg, stats, protocol)
    if world.plan.dynamic_split:  # rollout and GenRM ranks form one pool; each step says who does what
        from yatt_hpc.roles.pool import PoolController

        return PoolController(world, cfg, stats, protocol)
    if world.group == "rollout":
        from yatt_hpc.roles.rollout import RolloutController

        return RolloutController(world, cfg, stats, protocol)
    from yatt_hpc.roles.genrm import GenRMController

    return GenRMController(world, cfg, stats, protocol)


def quiet_libraries() -> None:
    """Per-rank progress bars from transformers would interleave on the launcher's terminal."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # transformers reads both when it is imported; a rank that never imports it (a GenRM rank scoring by
    # rule) must not pay ~1 s for it here
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def tracker_settings(cfg, run_dir: Path, config_yaml: str, environ):
    """What the leader's trackers need (`logging:`), the environment read here: W&B goes offline unless
    WANDB_MODE says how it runs."""
    from yatt_hpc.metrics.tracking import TrackerSettings, code_version, flat_params

    lc = cfg.logging
    params = {**flat_params(cfg.model_dump(mode="json", by_alias=True)), "code_version": code_version()}
    return TrackerSettings(names=list(lc.trackers), run_dir=run_dir, project=lc.project or "yatt-hpc",
                           run_name=lc.run_name, mlflow_tracking_uri=lc.mlflow_tracking_uri,
                           wandb_mode=None if environ.get("WANDB_MODE") else "offline", config_yaml=config_yaml,
                           params=params)


def run_rank(group: str, run_dir: Path) -> str:
    from mpi4py import MPI

    from yatt_hpc.ckpt import CheckpointManager
    from yatt_hpc.comm.doorbell import DOORBELL, launch_nonce
    from yatt_hpc.comm.transport import quiet_barrier
    from yatt_hpc.comm.world import build_world
    from yatt_hpc.config import load_config
    from yatt_hpc.launch.requeue import job_end_time
    from yatt_hpc.launch.slurm_env import SlurmEnv
    from yatt_hpc.metrics import build_metrics
    from yatt_hpc.metrics.tracking import hide_tracker_libraries
    from yatt_hpc.placement import plan
    from yatt_hpc.roles.protocol import StepProtocol, check_requested
    from yatt_hpc.runtime.allocator import heap_pages, keep_freed_memory
    from yatt_hpc.runtime.collector import resume_after_startup
    from yatt_hpc.runtime.inputs import check_model_dirs
    from yatt_hpc.runtime.loop import SlurmFacts, StepLoop
    from yatt_hpc.runtime.rank_stats import RankStats
    from yatt_hpc.runtime.signals import StopFlag

    stop_flag = StopFlag.install()  # first: a signal during the slow start-up must not kill us mid-write
    logging.getLogger(__name__).info("%s; %s", keep_freed_memory(), heap_pages())  # before the first big allocation
    quiet_libraries()
    config_yaml = (run_dir / "config.yaml").read_text()
    cfg = load_config(run_dir / "config.yaml")  # checks that the trackers' libraries are installed: then
    hide_tracker_libraries()  # keeps them out until the leader's trackers open (Megatron would load wandb)
    logging.getLogger().setLevel(cfg.logging.level)  # INFO until the config is read
    # groups finish their imports seconds apart: the first ones sleep (not spin) until all are here
    quiet_barrier(MPI.COMM_WORLD, "start: every rank imported")
    # waiting ranks sleep until a peer on their node rings them (comm/doorbell.py)
    DOORBELL.open(MPI.COMM_WORLD, MPI.COMM_WORLD.bcast(launch_nonce() if MPI.COMM_WORLD.Get_rank() == 0 else None))
    world = build_world(plan(cfg), MPI.COMM_WORLD, expected_group=group)
    check_model_dirs(cfg)
    (run_dir / "timeline").mkdir(exist_ok=True)
    stats = RankStats(group, run_dir / "timeline" / f"rank-{world.rank:04d}-{group}.jsonl")
    protocol = StepProtocol(world.comm, world.plan, check=check_requested(os.environ))  # on in tests
    with stop_flag.children_shielded():  # engines start their child processes here
        controller = build_controller(world, cfg, run_dir, stats, protocol)
        stop_flag.reclaim()  # before the block lifts: a signal that came meanwhile reaches our handler
    quiet_barrier(world.comm, "start: every controller built")  # engines are ready long before trainers
    metrics = build_metrics(run_dir, is_writer=world.is_leader,
                            settings=tracker_settings(cfg, run_dir, config_yaml, os.environ) if world.is_leader else None)
    console = leader_console() if world.is_leader else None
    slurm_env = SlurmEnv.from_environ(os.environ)
    slurm = SlurmFacts(slurm_env.job_id, slurm_env.restart_count, job_end_time(os.environ))
    ckpt = CheckpointManager(run_dir, world.comm, keep_last=cfg.checkpoint.keep_last,
                             async_save=cfg.checkpoint.async_save, staging_bytes=cfg.checkpoint.staging_mb * 2**20)
    logging.getLogger(__name__).info("%s", resume_after_startup())  # the steps run with the collector on
    try:
        outcome = StepLoop(world, cfg, controller, stats, metrics, ckpt, stop_flag, protocol, console, run_dir, slurm,
                           config_yaml).run()
    finally:
        metrics.close()
    controller.close()  # engines' child processes (SGLang's scheduler) end with the run, not at interpreter exit
    protocol.close()
    heavy = [m for m in ("torch", "torch._dynamo", "transformers", "megatron.core", "wandb", "mlflow")
             if sys.modules.get(m) is not None]  # None: kept out (hide_tracker_libraries)
    logging.getLogger(__name__).info("done: %s (loaded: %s)", outcome, ", ".join(heavy) or "no torch")
    quiet_barrier(world.comm, "end")
    return outcome


def leave(code: int) -> None:
    """End a rank whose run is over: join our non-daemon threads, finalize MPI, flush, then `os._exit`.

    Everything the run wrote is closed by then; what is skipped is only the interpreter's teardown of
    torch and transformers' module graph: measured here, 2.9 s per rank after the last step (0.1 s
    with os._exit), paid by every run of the demo and every test.
    """
    import threading

    from mpi4py import MPI

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()  # what interpreter exit would wait for (a checkpoint writer, if one were left)
    logging.shutdown()
    if "yatt_hpc.comm.doorbell" in sys.modules:
        sys.modules["yatt_hpc.comm.doorbell"].DOORBELL.close()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def profiled(fn, group: str, run_dir: Path, rank: int):
    """`fn(group, run_dir)`, under cProfile when YATT_PROFILE_DIR names a directory (a developer's tool:
    `YATT_PROFILE_DIR=/tmp/prof yatt-hpc run ...` leaves rank-NNNN-GROUP.prof there for pstats/snakeviz)."""
    where = os.environ.get("YATT_PROFILE_DIR")
    if not where:
        return fn(group, run_dir)
    import cProfile

    Path(where).mkdir(parents=True, exist_ok=True)
    profile = cProfile.Profile()
    try:
        return profile.runcall(fn, group, run_dir)
    finally:
        profile.dump_stats(str(Path(where) / f"rank-{rank:04d}-{group}.prof"))


def main(argv: list[str] | None = None) -> None:
    from yatt_hpc.runtime.collector import pause_during_startup

    pause_during_startup()  # first: start-up's imports and model build run without the cyclic collector
    from mpi4py import MPI  # initialises MPI: here, never at import (see the module docstring)

    from yatt_hpc.errors import USER_ERRORS
    from yatt_hpc.placement import GROUPS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", required=True, choices=GROUPS)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    log_path = setup_logging(args.run_dir, comm.Get_rank(), args.group, "INFO")
    logging.getLogger(__name__).info("started: pid %d", os.getpid())
    try:
        profiled(run_rank, args.group, args.run_dir, rank=comm.Get_rank())
    except USER_ERRORS as err:
        logging.getLogger(__name__).error("%s", err)
        print(f"yatt-hpc [{args.group} rank {comm.Get_rank()}] error: {err}", file=sys.stderr, flush=True)
        comm.Abort(EXIT_USER_ERROR)
    except BaseException as err:  # noqa: BLE001 - any failure must take the whole world down, not hang it
        logging.getLogger(__name__).error("%s", traceback.format_exc())
        print(f"yatt-hpc [{args.group} rank {comm.Get_rank()}] failed: {err.__class__.__name__}: {err} "
              f"(traceback in {log_path})", file=sys.stderr, flush=True)
        comm.Abort(EXIT_BUG)
    leave(0)


if __name__ == "__main__":
    from yatt_hpc.runtime.allocator import restart_on_huge_pages

    restart_on_huge_pages()  # before anything starts: glibc reads its tunables only at start (allocator.py)
    main()
