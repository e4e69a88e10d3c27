"""Asynchronous RL on real runs (`rollout.max_staleness`): the rollout and GenRM ranks generate and score the
batch of step t + s while the trainer trains on step t's, and a run stopped at any moment resumes bitwise.

    .venv/bin/python -m pytest tests/mpi/test_async_run.py -q

The demo in `disjoint` placement (trainer dp 2, one rollout and one GenRM rank). A step's samples come from the
weights after step t - s's update (the first s steps' from the initial weights): `async/staleness` is 0, 1, ..
up to s, then s, and every prompt is consumed once (none is generated for a step past the last). SIGTERM at a
random moment after a random step, then the same command again: the batches waiting for their step are in the
checkpoint, so the resumed run ends with the uninterrupted run's weights and consumed prompts, bitwise.

With partial rollouts (over-dispatch 1.5, segments of 1 token: the demo's responses end within a few tokens of
each other, and longer segments find every group complete at the same boundary) samples unfinished when a replica's groups are
complete are paused, kept by their owner (and in its checkpoint) and continued in the next wave under newer
weights: some samples then span two weight versions, and the resume is still bitwise. CI runs s = 1 with partial
rollouts; `make test-faults` runs s = 1 and s = 2 without, and s = 2 with.
"""
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, final_state, full_matrix_only, mpi_env
from tests.mpi.test_exact_resume import assert_same, finished_steps
from tests.programs.held_engine import held_env
from yatt_hpc.metrics.writer import step_rows

K = 8
PARTIAL = ("rollout.over_dispatch_ratio=1.5", "rollout.partial_rollouts=true", "rollout.partial_segment_tokens=1")


def command(run_dir, staleness: int, partial: bool = False) -> list[str]:
    sets = [f"train.steps={K}", "train.prompts_per_step=8", "rollout.samples_per_prompt=4", "checkpoint.interval=2",
            "checkpoint.stop_grace_s=2", "logging.progress=false", "placement.mode=disjoint", "eval.every=0",
            *(PARTIAL if partial else ()), f"rollout.max_staleness={staleness}"]
    return [sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"), "--run-dir", str(run_dir),
            *(a for s in sets for a in ("--set", s))]


def interrupt(run_dir, staleness: int, partial: bool):
    """The run, SIGTERMed at a random moment after a random step; the last step that generates (weights
    version K - 1 - s) holds its rollout until the signal, so the run cannot end before it. (The hold ends with
    the signal, not with the process: an asynchronous step whose trainer has updated is finished, not given up,
    and a rollout held until the process ends would hold it forever.)"""
    env = mpi_env() | held_env(run_dir.parent / "held", until="signal", at_version=K - 1 - staleness)
    proc = subprocess.Popen(command(run_dir, staleness, partial), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    after, delay = rng.randint(2, K - 2 - staleness), rng.uniform(0.0, 0.3)
    print(f"SIGTERM {delay:.3f}s after step {after} (seed {seed})")
    deadline = time.monotonic() + 600
    while finished_steps(run_dir) < after and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out


@pytest.mark.parametrize(("staleness", "partial"), [
    pytest.param(1, True, id="s1-partial"),
    pytest.param(1, False, id="s1", marks=full_matrix_only),
    pytest.param(2, False, id="s2", marks=full_matrix_only),
    pytest.param(2, True, id="s2-partial", marks=full_matrix_only),
])
def test_an_asynchronous_run_resumes_bitwise(mpirun, tmp_path, staleness, partial):
    straight = tmp_path / "straight"
    proc = subprocess.run(command(straight, staleness, partial), cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = step_rows(straight)
    assert [r["async/staleness"] for r in rows] == [min(t, staleness) for t in range(K)]
    assert sum(r["data/prompts_consumed"] for r in rows) == K * 8
    assert all(r["train/grad_norm"] > 0 for r in rows)
    if partial:
        paused, continued = sum(r["partial/paused"] for r in rows), sum(r["partial/continued"] for r in rows)
        print(f"paused {paused:g}, continued {continued:g}, kept tokens {sum(r['partial/kept_tokens'] for r in rows):g}")
        assert paused > 0 and continued > 0, "nothing was paused and continued: the test tests nothing"
        assert max(r["partial/version_span_max"] for r in rows) >= 1, "no trained sample spans two weight versions"
        assert all(r["partial/version_span_max"] <= staleness for r in rows)
        assert all(r["partial/token_age_max"] <= 2 * staleness for r in rows)

    run_dir = tmp_path / "stopped"
    code, out = interrupt(run_dir, staleness, partial)
    assert code == 0, out[-3000:]
    assert finished_steps(run_dir) < K, "the stop came too late to test anything"
    proc = subprocess.run(command(run_dir, staleness, partial), cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from checkpoint step" in proc.stdout
    assert_same(final_state(run_dir, K), final_state(straight, K))


def test_a_checkpoint_with_waiting_batches_refuses_another_staleness(mpirun, tmp_path):
    """Step 2's checkpoint of a 4-step s = 1 run holds step 3's batch; the run as if it had died after that save
    (step 4's checkpoint removed) resumed synchronously is refused, naming the setting."""
    run_dir = tmp_path / "run"
    first = command(run_dir, 1)
    first[first.index(f"train.steps={K}")] = "train.steps=4"
    done = subprocess.run(first, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    shutil.rmtree(run_dir / "checkpoints" / "step-4")
    sync = first[:-2]  # the same command without its last `--set rollout.max_staleness=1`
    assert first[-1] == "rollout.max_staleness=1"
    proc = subprocess.run(sync, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "holds 1 batches generated ahead of their step" in out and "resume it with the rollout.max_staleness" in out
    assert "Traceback" not in proc.stdout
