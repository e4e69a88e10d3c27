"""An engine that starts like SGLang's, under real mpirun: a stop signal still ends the run with a checkpoint.

The demo (4 steps, no periodic checkpoint) runs with its `hf` engines (the rollout rank's and the
GenRM judge's) wrapped in tests/programs/spawning_engine.py, which at start spawns a child (`spawn`:
the child re-runs the rank's main module, yatt_hpc.runtime.worker), takes SIGTERM with a handler
that SIGKILLs the child and the rank, and sets a wakeup fd of its own. Over it,
tests/programs/held_engine.py holds step 2's rollout until the rank's stop signal, so the signal
always lands in step 2 (steps of ~0.1 s had left it one step of slack). Once step 2's rollout holds:

  * SIGTERM to the rollout rank and to the engine children, as Slurm's preemption SIGTERMs every
    process of the step; without StopFlag.reclaim the engine's handler would kill the rank (and
    mpirun the world), without children_shielded the children would die of it;
  * SIGUSR2 to the launcher, which mpirun passes on to every rank's process group, the engine
    child included (Open MPI's odls_base_signal_direct_children_only=false).

Either way the ranks agree to stop at step 2's boundary, commit its checkpoint, write
the stop record and exit 0, as the run with the plain `hf` engine does; each child held the signal
(pending, blocked) and never imported mpi4py although it inherited its rank's MPI identity.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, full_matrix_only, kill_leftovers, leftover_pids, mpi_env, tree_pids, wait_for_file
from tests.mpi.test_exact_resume import finished_steps
from tests.mpi.test_faults import rank_pid
from tests.programs.held_engine import held_env, holding_marker
from tests.programs.signal_probe import pending_and_blocked
from yatt_hpc.rollout.engine import TEST_WRAPPER_ENV

STEPS, ROLLOUT_RANK, ENGINE_RANKS = 4, 2, [2, 3]  # the demo: trainers 0-1, rollout 2, GenRM 3 (its judge engine)
ARGS = ["--set", f"train.steps={STEPS}", "--set", "train.prompts_per_step=8", "--set", "rollout.samples_per_prompt=4",
        "--set", "checkpoint.interval=0", "--set", "logging.progress=false", "--set", "logging.trackers=[]"]
WRAPPER = "tests.programs.spawning_engine:SpawningEngine"
STOP_NAMES = {"SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"}


@pytest.fixture
def run_dir(tmp_path):
    """The run's directory; whatever the run left alive (a failed test) is killed afterwards."""
    before = set(leftover_pids())
    yield tmp_path / "run"
    kill_leftovers(before)


def start(run_dir, engine_dir, spawning: bool):
    """Start the run; step 2's rollout holds until the rank's stop signal (tests/programs/held_engine.py),
    so the signal lands in step 2 however fast the steps are (over the spawning stand-in if `spawning`)."""
    env = mpi_env() | held_env(engine_dir, "signal")
    if spawning:
        env[TEST_WRAPPER_ENV] = f"{WRAPPER},{env[TEST_WRAPPER_ENV]}"
    argv = [sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"), "--run-dir", str(run_dir),
            *ARGS]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def engine_children(engine_dir, root: int) -> list[dict]:
    """What each engine child reported (the rollout rank's and GenRM's judge engine: both come from build_engine)."""
    children = [json.loads(path.read_text()) for path in sorted(engine_dir.glob("child-*.json"))]
    ranks = sorted(int(c["identity"]["OMPI_COMM_WORLD_RANK"]) for c in children)
    assert ranks == ENGINE_RANKS, f"engine children of world ranks {ranks}, expected {ENGINE_RANKS}"
    for child in children:
        assert child["pid"] in tree_pids(root), f"engine child {child['pid']} is not a process this test started"
    return children


def held_signals(pid: int, want: set[str], deadline: float) -> set[str]:
    """The stop signals pending (held, blocked) for `pid` once `want` all are, or at the deadline."""
    while True:
        try:
            pending = set(pending_and_blocked(pid)["ShdPnd"])
        except FileNotFoundError:
            return set()  # gone: it died of one, or the run ended already
        if want <= pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.02)


@pytest.mark.parametrize(("spawning", "how"), [
    pytest.param(True, "rank", id="spawning-engine-sigterm-to-rank-and-children"),
    pytest.param(True, "launcher", id="spawning-engine-sigusr2-through-mpirun"),
    pytest.param(False, "rank", id="plain-engine-sigterm-to-rank", marks=full_matrix_only),
])
def test_a_stop_signal_with_an_engine_that_spawns_and_takes_sigterm_still_saves_and_stops(mpirun, run_dir, tmp_path,
                                                                                           spawning, how):
    engine_dir, before = tmp_path / "engine", set(leftover_pids())
    started = time.monotonic()
    proc = start(run_dir, engine_dir, spawning)
    deadline = started + 300
    pid = rank_pid(run_dir, ROLLOUT_RANK, proc.pid, deadline)
    log_path = run_dir / "logs" / f"rank-{ROLLOUT_RANK:04d}-rollout.log"
    wait_for_file(holding_marker(engine_dir), alive=lambda: proc.poll() is None)  # in step 2, until the signal
    children = engine_children(engine_dir, proc.pid) if spawning else []
    if how == "rank":
        for target in [pid] + [c["pid"] for c in children]:
            os.kill(target, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGUSR2)
    sent = "SIGTERM" if how == "rank" else "SIGUSR2"
    held = [held_signals(c["pid"], {sent}, time.monotonic() + 10) for c in children]
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not end within 180 s of the {sent}")
    took = time.monotonic() - started
    assert proc.returncode == 0, out[-3000:]
    record = json.loads((run_dir / "logs" / "stop_local_0.json").read_text())
    step = record["step"]
    assert step == 2 and not record["abandoned"], record  # the boundary after the step the signal hit
    assert (run_dir / "checkpoints" / f"step-{step}" / "COMMITTED").exists(), f"checkpoint step-{step} not committed"
    assert finished_steps(run_dir) == step and "run the same command again to resume" in out, out[-3000:]
    assert leftover_pids(before) == [], "processes of the stopped run (the engine child?) are still alive"
    if not spawning:
        assert "handlers and wakeup fd intact" in log_path.read_text()
        print(f"\nplain engine: {sent} to the rollout rank -> stopped at step {step}; run {took:.1f}s")
        return
    for rank_log in (log_path, run_dir / "logs" / "rank-0003-genrm.log"):
        assert "replaced SIGTERM (was tests.programs.spawning_engine.SpawningEngine._kill_tree), the signal wakeup " \
               "fd" in rank_log.read_text(), f"{rank_log.name} did not reclaim the stop signals"
    for child, pending in zip(children, held):
        assert sent in pending, f"engine child {child['pid']} did not hold the {sent} (pending: {sorted(pending)})"
        assert set(child["blocked"]) >= STOP_NAMES, child
        assert child["main_module"] == "yatt_hpc.runtime.worker" and child["main_has_main"], child
        assert not child["mpi4py_imported"] and "OMPI_COMM_WORLD_RANK" in child["identity"], child
    print(f"\nspawning engines: {sent} ({how}) -> stopped at step {step}, children held {[sorted(h) for h in held]}; "
          f"run {took:.1f}s")
