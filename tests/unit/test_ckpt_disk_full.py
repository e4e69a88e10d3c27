"""A checkpoint write that meets a really full disk: the previous checkpoint stays latest, the error says so.

    sudo .venv/bin/python -m pytest tests/unit/test_ckpt_disk_full.py -q     # root: it mounts tmpfs

The disk is a tmpfs mounted on RUN_DIR/checkpoints, sized so that step 1 fits and step 2 does not;
the job is a real one-rank MPI process (tests/programs/ckpt_disk_full.py, singleton COMM_WORLD,
async save committed from the writer thread). Which write fails is chosen by the sizes: this rank's
safetensors file, the leader's state.h5, or (no inode left) the commit marker itself. Then the disk
grows, and a restart removes the leftover, resumes from step 1 and commits step 2.
The full-run version (`yatt-hpc run` under mpirun) is tests/mpi/test_ckpt_faults.py.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, mpi_env
from yatt_hpc.ckpt import CheckpointManager, RankState, SharedState, find_latest, layout
from yatt_hpc.ckpt.errors import describe_write_error, free_space

PROGRAM = str(REPO / "tests/programs/ckpt_disk_full.py")
IDENTITY = "trainer/dp0/tp0/pp0"
# Inodes of the checkpoints tmpfs: its root, step-1 (dir, model, state.h5, COMMITTED), then step 2's
# dir, model and state.h5: nothing left for the marker's temp file.
MARKER_INODES = 1 + 4 + 3

WHERE_IT_FAILS = [
    # 600 KB of parameters per checkpoint on a 1 MiB disk: step 2's safetensors write fails
    pytest.param(150_000, 0, "1m", None, "rank 0 (trainer/dp0/tp0/pp0): disk full (No space left on device)",
                 id="rank-safetensors"),
    # 600 KB in state.h5: the leader's HDF5 write fails
    pytest.param(256, 150_000, "1m", None, "leader: disk full (No space left on device)", id="leader-state-h5"),
    # plenty of bytes, no inode for the marker: everything is written, the commit point is not
    pytest.param(256, 0, "4m", MARKER_INODES, "leader: disk full (No space left on device)", id="commit-marker"),
]


@pytest.mark.parametrize("model_floats, extra_floats, size, inodes, problem", WHERE_IT_FAILS)
def test_a_full_disk_keeps_the_previous_checkpoint_latest_and_says_where_and_how_to_fix_it(
        small_disk, tmp_path, model_floats, extra_floats, size, inodes, problem):
    ckpt = small_disk.mount(layout.checkpoints_dir(tmp_path), size, inodes)
    proc = subprocess.run([sys.executable, PROGRAM, str(tmp_path), str(model_floats), str(extra_floats)],
                          env=mpi_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world"] == 1 and report["threaded_commit"], report  # a real comm, commit on its Dup
    error = report["error"]
    print(error)
    assert error is not None and "\n" not in error and report["kind"] == "DiskFullError"
    inc = layout.incomplete_dir(ckpt, 2)
    for part in ("checkpoint step 2 was not committed", problem, f"Writing {inc}: ", "free of",
                 "Fix: free space on that filesystem", "--run-dir", "it resumes from step 1"):
        assert part in error, (part, error)
    if inodes:
        assert "no inodes (files) are left" in error
    else:
        assert "checkpoint step 1 takes" in error and "checkpoint.keep_last=2" in error

    # nothing half-committed: step 1 is the latest and verifies; step 2 is only a leftover
    assert [(s.step, s.committed) for s in layout.list_steps(ckpt)] == [(1, True)]
    assert find_latest(ckpt) == (1, [])
    assert inc.is_dir() and not layout.step_dir(ckpt, 2).exists()

    small_disk.grow(ckpt, "8m", 1000)  # make room; a restart cleans up, resumes and saves again
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        assert not inc.exists()
        restored = mgr.load_latest(IDENTITY)
        assert restored.step == 1 and restored.data_position == {"next": 16}
        assert torch.equal(restored.model["w"], torch.full((model_floats,), 1.0))
        mgr.save(2, RankState(IDENTITY, {"dp": 0, "tp": 0, "pp": 0}, model={"w": torch.full((model_floats,), 2.0)}),
                 SharedState({"step": 2}))
    assert find_latest(ckpt) == (2, [])


SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"


def _chained() -> BaseException:
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize("err, want", [
    pytest.param(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "disk full (No space left on device)", id="oserror"),
    pytest.param(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), "disk full (Disk quota exceeded)", id="quota"),
    pytest.param(Exception(SAFETENSORS_ENOSPC), "disk full (No space left on device)", id="safetensors-text"),
    pytest.param(_chained(), "disk full (No space left on device)", id="caused-by-enospc"),
    pytest.param(OSError(errno.EIO, "Can't write\n, errno = 5"), "OSError: [Errno 5] Can't write , errno = 5",
                 id="other-error-on-one-line"),
])
def test_write_errors_are_one_line_and_a_full_disk_is_named(err, want):
    assert describe_write_error(err) == want


def test_free_space_of_a_path_not_yet_created_is_that_of_its_filesystem(tmp_path):
    assert " free of " in free_space(tmp_path / "checkpoints" / "step-3.incomplete")
