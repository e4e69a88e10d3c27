"""Checkpoint faults in the real demo run (`yatt-hpc run`, mpirun, 4 ranks): a full disk, a corrupt latest.

    sudo .venv/bin/python -m pytest tests/mpi/test_ckpt_faults.py -q      # the disk-full case mounts tmpfs

Each run saves a checkpoint after every step (checkpoint.interval=1, keep_last=2). The reference is the
session's uninterrupted run (tests/conftest.py reference_run) at 2 and 3 steps; a faulty run must end
with bitwise the same weights and the same consumed prompt positions as the reference of its length:
nothing lost, nothing consumed twice.

- Disk full: RUN_DIR/checkpoints is a tmpfs of 1.5 checkpoints. The run fails at step 2's commit
  with one line naming the disk, the path and the fix; step 1 stays latest. After the disk grows,
  the same command resumes from step 1 and completes.
- Corrupt latest: of a 2-step run's checkpoints (the reference run's first two), step 2 is damaged
  (a flipped byte in the parameters; a truncated state.h5). A 3-step rerun skips it, says why in
  the leader's log, moves it aside to step-2.corrupt, and resumes from step 1.
The checkpoint-level versions are tests/unit/test_ckpt_disk_full.py and tests/unit/test_ckpt_manager.py.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, final_state, mpi_env
from tests.mpi.test_exact_resume import assert_same
from yatt_hpc.ckpt import find_latest, layout
from yatt_hpc.ckpt.manifest import verify_step

CONFIG = str(REPO / "configs/demo_cpu.yaml")
PROMPTS_PER_STEP = 8
FAST = ["--set", f"train.prompts_per_step={PROMPTS_PER_STEP}", "--set", "rollout.samples_per_prompt=4",
        "--set", "checkpoint.interval=1", "--set", "checkpoint.keep_last=2", "--set", "logging.progress=false",
        "--set", "logging.trackers=[]"]


def yatt_run(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir),
                           "--set", f"train.steps={steps}", *FAST],
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture
def two_steps(reference_run, tmp_path):
    """A run directory as a 2-step run leaves it (step-1 and step-2 committed: the session's reference
    run with its later checkpoints left out) and the final state of an uninterrupted 2-step run."""
    run_dir = tmp_path / "two_steps"
    shutil.copytree(reference_run.dir, run_dir, ignore=shutil.ignore_patterns("step-[3-9]", "step-[1-9][0-9]*"))
    assert [s.step for s in layout.list_steps(layout.checkpoints_dir(run_dir))] == [1, 2]
    return run_dir, reference_run.state(2)


@pytest.fixture
def three_steps(reference_run):
    """The final state of an uninterrupted 3-step run (the session's reference run at step 3)."""
    return reference_run.state(3)


def test_a_full_disk_at_a_checkpoint_fails_the_run_in_one_line_and_a_rerun_after_making_room_resumes(
        two_steps, small_disk, tmp_path):
    reference_dir, reference = two_steps
    one_checkpoint = sum(p.stat().st_size for p in (reference_dir / "checkpoints/step-1").iterdir())
    run_dir = tmp_path / "run"
    ckpt = small_disk.mount(layout.checkpoints_dir(run_dir), str(math.ceil(one_checkpoint * 1.5)))

    failed = yatt_run(run_dir, 2)
    assert failed.returncode != 0, failed.stdout[-2000:]
    inc = layout.incomplete_dir(ckpt, 2)
    lines = [line for line in failed.stderr.splitlines() if "disk full" in line]
    print("\n".join(lines[:1]))
    assert lines, failed.stderr[-4000:]
    assert failed.returncode == 2, "a full disk is the user's to fix: the user-error exit code"
    assert any("] error: checkpoint step 2 was not committed" in line for line in lines), lines
    for line in lines:
        assert "checkpoint step 2 was not committed" in line
        for part in ("No space left on device", f"Writing {inc}: ", " free of ", "Fix: free space", "--run-dir",
                     "it resumes from step 1"):
            assert part in line, (part, line)
    assert "Traceback (most recent call last)" not in failed.stderr + failed.stdout
    # the earlier checkpoint is still the latest, and whole; step 2 only a leftover
    assert find_latest(ckpt) == (1, [])
    assert not layout.step_dir(ckpt, 2).exists() and inc.is_dir()

    small_disk.grow(ckpt, str(one_checkpoint * 8))
    again = yatt_run(run_dir, 2)  # the same command
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"resumed from checkpoint step 1 in {run_dir}" in again.stdout
    assert not inc.exists()
    assert find_latest(ckpt) == (2, [])
    assert_same(final_state(run_dir, 2), reference, prompts=2 * PROMPTS_PER_STEP)


def _flip_a_parameter_byte(step_dir: Path) -> None:
    path = step_dir / "model-tp0-pp0.safetensors"
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x10]))


def _truncate_state(step_dir: Path) -> None:
    path = step_dir / "state.h5"
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("corrupt, reason", [
    pytest.param(_flip_a_parameter_byte, "model-tp0-pp0.safetensors: sha256 mismatch", id="flipped-safetensors-byte"),
    pytest.param(_truncate_state, "state.h5: size", id="truncated-state-h5"),
])
def test_a_corrupt_latest_checkpoint_is_skipped_moved_aside_and_the_run_resumes_from_the_one_before(
        two_steps, three_steps, tmp_path, corrupt, reason):
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps[0], run_dir)
    ckpt = layout.checkpoints_dir(run_dir)
    step2 = layout.step_dir(ckpt, 2)
    corrupt(step2)
    assert reason in verify_step(step2)

    proc = yatt_run(run_dir, 3)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"resumed from checkpoint step 1 in {run_dir}" in proc.stdout
    leader_log = (run_dir / "logs/rank-0000-trainer.log").read_text()
    assert f"checkpoint {step2} is not usable ({reason}" in leader_log
    assert f"moved {step2} aside to {step2}.corrupt" in leader_log
    assert (ckpt / "step-2.corrupt").is_dir()
    assert find_latest(ckpt) == (3, [])
    assert_same(final_state(run_dir, 3), three_steps, prompts=3 * PROMPTS_PER_STEP)
