"""The dev cluster itself: a controller that died with its jobs (a machine reset, a killed CI run)
must come back with idle nodes, not recover jobs that nothing runs any more and hold the nodes
"allocated" forever (a CI run failed so: `nodes not idle after 90s`)."""
import contextlib
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, wait_for_file
from tests.slurm.jobs import sbatch
from yatt_hpc.launch.jobs import wait_job

SCRIPT = str(REPO / "tools/slurm-dev-cluster.sh")

# three het components on three nodes, each task and the batch shell and srun writing their pid
HELD = """#!/bin/bash
#SBATCH --job-name=yatt-test-reset
#SBATCH --nodes=1 --ntasks=1 --time=5 --output=slurm-%j.out
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
echo $$ > pid.batch
srun --het-group=0,1,2 bash -c 'f=pid.task$SLURM_PROCID; echo $$ > $f.tmp && mv $f.tmp $f; exec sleep 600' &
echo $! > pid.srun
wait
"""


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _reset_machine(workdir) -> None:
    """What a machine reset leaves: no Slurm process and no job process; pid and state files stay.
    The controller first saves its state (it does so on its own within a while; a reset right after
    a submit could otherwise find the job not yet saved, and nothing to recover)."""
    subprocess.run(["scontrol", "shutdown", "slurmctld"], check=True, timeout=30)
    _wait_gone(["slurmctld"], "slurmctld did not shut down within 60 s")
    daemons = ["slurmd", "slurmstepd"]
    for daemon in daemons:
        subprocess.run(["pkill", "-KILL", "-x", daemon], timeout=30)
    for pidfile in workdir.glob("pid.*"):
        _kill(int(pidfile.read_text()))
    _wait_gone(daemons, "Slurm daemons outlived SIGKILL for 60 s")


def _wait_gone(names: list[str], why: str) -> None:
    deadline = time.monotonic() + 60
    while any(subprocess.run(["pgrep", "-x", n], capture_output=True).returncode == 0 for n in names):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)  # polling for the event (the processes gone), bounded


@pytest.mark.skipif(os.geteuid() != 0, reason="the dev cluster script needs root")
def test_a_controller_killed_with_running_jobs_restarts_with_idle_nodes(slurm_cluster, tmp_path):
    if slurm_cluster != "yattdev":  # it kills every Slurm daemon on this machine: never a real site's
        pytest.skip(f"needs the dev cluster (tools/slurm-dev-cluster.sh), not cluster {slurm_cluster!r}")
    old = sbatch(HELD, tmp_path)
    for i in range(3):
        wait_for_file(tmp_path / f"pid.task{i}", timeout_s=120)
    wait_for_file(tmp_path / "pid.srun", timeout_s=30)
    _reset_machine(tmp_path)

    env = {**os.environ, "YATT_DEV_TIMEOUT": "60"}
    start = subprocess.run(["bash", SCRIPT, "start"], capture_output=True, text=True, timeout=300, env=env)
    assert start.returncode == 0, start.stdout + start.stderr
    assert "starting slurmctld clean" in start.stdout, start.stdout
    queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30)
    assert queue.stdout.strip() == "", f"jobs recovered from before the reset: {queue.stdout}"

    # the cluster runs jobs again, and ids go on past the old job's (sacct never mixes the two)
    new = sbatch("#!/bin/bash\n#SBATCH --time=2 --output=slurm-%j.out\ntrue\n", tmp_path)
    assert int(new) > int(old) + 2, (old, new)
    assert set(wait_job(new, poll_s=1, timeout_s=120).values()) == {"COMPLETED"}
