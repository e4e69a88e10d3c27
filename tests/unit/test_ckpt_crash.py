"""A process SIGKILLed during its async checkpoint write leaves only `.incomplete`, ignored then cleaned.

    .venv/bin/python -m pytest tests/unit/test_ckpt_crash.py -q

The victim is a real process (tests/programs/ckpt_kill_writer.py) killed with SIGKILL while its
background writer is writing step 2; step 1 was committed before. Its manager runs on LocalComm or
on a real one-rank MPI communicator (commit collectives on the writer thread). The restart resumes
from step 1 and commits step 2 again, over the leftover's name.
"""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, mpi_env
from yatt_hpc.ckpt import CheckpointManager, RankState, find_latest, layout

PROGRAM = str(REPO / "tests/programs/ckpt_kill_writer.py")


@pytest.mark.parametrize("comm", ["local", "mpi"])
def test_sigkill_mid_async_write_leaves_only_incomplete_which_is_ignored_and_cleaned(tmp_path, comm):
    proc = subprocess.Popen([sys.executable, PROGRAM, str(tmp_path), comm], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=mpi_env())
    try:
        line = proc.stdout.readline()
        assert line.strip() == "MID-WRITE", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    ckpt = layout.checkpoints_dir(tmp_path)
    assert [s.step for s in layout.list_steps(ckpt)] == [1]
    assert [p.name for p in layout.list_incomplete(ckpt)] == ["step-2.incomplete"]
    assert find_latest(ckpt) == (1, [])
    mgr = CheckpointManager(tmp_path)  # a restart
    assert layout.list_incomplete(ckpt) == []
    restored = mgr.load_latest("trainer/dp0/tp0/pp0")
    assert restored.step == 1 and torch.equal(restored.model["w"], torch.ones(16))
    mgr.save(2, RankState("trainer/dp0/tp0/pp0", restored.coords, model={"w": torch.full((16,), 2.0)}))
    mgr.close()
    assert find_latest(ckpt) == (2, []) and layout.list_incomplete(ckpt) == []
