"""The batch launcher does not trust srun to return: per-rank exit records and the bounded wait after them."""
import json
import os
import subprocess
import sys
import threading

import pytest

from tests.conftest import REPO
from yatt_hpc.config import load_config
from yatt_hpc.launch.failures import record_failure
from yatt_hpc.launch.rank_group import EXIT_DIR_ENV, write_exit_record
from yatt_hpc.launch.step_watch import StepWatch, ranks_exit_code
from yatt_hpc.placement import plan


def _shim(tmp_path, rank: int, child_code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PMIX_RANK=str(rank), **{EXIT_DIR_ENV: str(tmp_path / "exits")})
    env["PYTHONPATH"] = str(REPO)
    # the child sees the --group the shim appends and exits as told
    child = [sys.executable, "-c", f"import os, signal, sys; assert sys.argv[-2:] == ['--group', 'rollout']; {child_code}"]
    return subprocess.run([sys.executable, "-m", "yatt_hpc.launch.rank_group", "trainer=0-1,rollout=2-2,genrm=3-3",
                           "--", *child], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("code, expect", [
    pytest.param("sys.exit(3)", {"code": 3, "signal": None}, id="exit-code"),
    pytest.param("os.kill(os.getpid(), signal.SIGKILL)", {"code": None, "signal": 9}, id="sigkill"),
])
def test_the_shim_records_how_its_rank_ended_and_leaves_the_same_way(tmp_path, code, expect):
    done = _shim(tmp_path, 2, code)
    assert done.returncode == (3 if expect["code"] else -9), done.stderr
    rec = json.loads((tmp_path / "exits" / "rank-0002.json").read_text())
    assert {k: rec[k] for k in ("rank", "group", "code", "signal")} == {"rank": 2, "group": "rollout", **expect}
    assert not list((tmp_path / "exits").glob("*.tmp")), "records are renamed into place"


def _records(directory, codes: dict[int, int]) -> None:
    for rank, status in codes.items():
        write_exit_record(str(directory), rank, "trainer", status, pid=1000 + rank)


def test_a_srun_that_never_returns_is_ended_once_every_rank_has_exited(tmp_path):
    hung = subprocess.Popen(["sleep", "600"])  # stands for the srun that waits forever
    watch = StepWatch(tmp_path, world_size=3, timeout_s=0.5, poll_s=0.05)
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("code", watch.wait(hung)))
    waiter.start()
    _records(tmp_path, {0: 0, 1: 0})
    assert waiter.is_alive(), "two of three records: keep waiting for srun"
    _records(tmp_path, {2: -9})
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert result["code"] == 128 + 9, "the ranks' code (rank 2 killed), not srun's"
    assert watch.ended_srun and hung.poll() is not None, "srun was ended"


def test_a_srun_that_returns_keeps_its_own_code(tmp_path):
    quick = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    watch = StepWatch(tmp_path, world_size=2, timeout_s=600, poll_s=0.05)
    assert watch.wait(quick) == 5 and not watch.ended_srun


def test_the_step_code_and_failure_come_from_the_lowest_failing_rank(tmp_path):
    _records(tmp_path, {0: 0, 1: 0, 2: 7, 3: -15})
    records = StepWatch(tmp_path, 4, 1.0).records()
    assert ranks_exit_code(records) == 7
    assert ranks_exit_code(records[:2]) == 0
    p = plan(load_config(REPO / "configs/demo_cpu.yaml"))
    assert record_failure(records, p).startswith("rollout (world rank 2) on ")  # written before rank 3's
    assert record_failure(records, p).endswith("exit code 7")


class _Clock:
    """Stands for the step watch's `time.monotonic`: time passes only while srun is polled."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _SrunThatNeverReturns:
    """A `Popen` whose every timed wait times out (advancing the clock by the timeout) until it is killed."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.killed_at = clock, None

    def wait(self, timeout=None):
        if self.killed_at is not None:
            return -9
        self.clock.now += timeout
        raise subprocess.TimeoutExpired("srun", timeout)

    def kill(self) -> None:
        self.killed_at = self.clock.now


@pytest.mark.parametrize("timeout_s", [5.0, 30.0])
def test_step_exit_timeout_s_is_how_long_the_launcher_waits_for_srun_after_the_last_exit(tmp_path, monkeypatch,
                                                                                         timeout_s):
    """The launcher's watch, built from `slurm.step_exit_timeout_s` of the config, ends a srun that never
    returns that long (on a fake clock: no real waiting) after the last rank's exit record appeared."""
    import types

    from yatt_hpc.launch import step_watch

    cfg = load_config(REPO / "configs/demo_cpu.yaml", [f"slurm.step_exit_timeout_s={timeout_s}"])
    p = plan(cfg)
    _records(tmp_path, {rank: 0 for rank in range(p.world_size)})  # every rank has exited
    clock = _Clock()
    monkeypatch.setattr(step_watch, "time", types.SimpleNamespace(monotonic=clock))
    srun = _SrunThatNeverReturns(clock)
    watch = step_watch.step_watch_for(cfg, p, tmp_path)
    assert watch.wait(srun) == 0 and watch.ended_srun
    # the records are seen at the first poll; srun is ended at the first poll timeout_s after that
    assert timeout_s <= srun.killed_at - watch.poll_s < timeout_s + watch.poll_s, srun.killed_at


class _Steps:
    """Stands for `SlurmSteps`: Slurm runs the step for the first `alive_polls` questions, then no longer."""

    def __init__(self, alive_polls: int) -> None:
        self.asked, self.alive_polls = 0, alive_polls

    def alive(self) -> bool:
        self.asked += 1
        return self.asked <= self.alive_polls


@pytest.mark.parametrize("codes, expect", [
    pytest.param({}, 1, id="no-record-at-all"),
    pytest.param({0: 0, 1: 3}, 3, id="some-records"),
])
def test_a_srun_that_outlives_a_step_slurm_cancelled_is_ended_with_a_failing_code(tmp_path, monkeypatch, codes, expect):
    """MPI_Abort -> Slurm cancels the step and SIGKILLs every task, shims included: no full set of exit
    records ever comes, and srun can still hang (SchedMD 16817). Slurm's own step list ends the wait."""
    import types

    from yatt_hpc.launch import step_watch

    _records(tmp_path, codes)
    clock = _Clock()
    monkeypatch.setattr(step_watch, "time", types.SimpleNamespace(monotonic=clock))
    srun = _SrunThatNeverReturns(clock)
    watch = StepWatch(tmp_path, world_size=4, timeout_s=20.0, poll_s=0.5, steps=_Steps(alive_polls=10))
    assert watch.wait(srun) == expect and watch.ended_srun
    assert 10 * 0.5 + 20.0 <= srun.killed_at <= 10 * 0.5 + 20.0 + 1.0, srun.killed_at


def test_slurm_steps_reads_squeue_and_knows_nothing_before_the_step_appears(tmp_path, monkeypatch):
    from yatt_hpc.launch.step_watch import SlurmSteps

    listing = tmp_path / "steps"
    fake = tmp_path / "bin" / "squeue"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncat {listing}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    steps = SlurmSteps(["474", "475"], poll_s=0)
    listing.write_text("474.batch\n474.extern\n")
    assert steps.alive() is None, "no step of ours seen yet: srun may not have registered it"
    listing.write_text("474.batch\n474.0\n475.0\n")
    assert steps.alive() is True
    assert (tmp_path / "args").read_text().split() == ["-h", "--steps", "-j", "474,475", "-o", "%i"]
    listing.write_text("474.batch\n")
    assert steps.alive() is False
