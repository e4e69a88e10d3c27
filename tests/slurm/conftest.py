"""Every Slurm test leaves the dev cluster as it found it: a job the test started and left behind
(a failed assertion before its end) is cancelled, so it cannot hold the nodes the next test needs."""
import subprocess
import time

import pytest


def _queued_ids() -> set[int]:
    out = subprocess.run(["squeue", "-h", "-o", "%F"], capture_output=True, text=True, timeout=30)
    return {int(x) for x in out.stdout.split() if x.isdigit()} if out.returncode == 0 else set()


def _last_job_id() -> int:
    # the newest id Slurm has handed out: jobs submitted after this point are the test's own
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    for line in out.stdout.splitlines():
        if line.startswith("NEXT_JOB_ID"):
            return int(line.split("=", 1)[1]) - 1
    return max(_queued_ids(), default=0)


@pytest.fixture(autouse=True)
def cancel_the_tests_own_jobs(request):
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    before = _last_job_id()
    yield
    left = sorted(j for j in _queued_ids() if j > before)
    if not left:
        return
    print(f"cancelling jobs this test left behind: {left}")
    subprocess.run(["scancel", *map(str, left)], timeout=30)
    deadline = time.monotonic() + 120
    while _queued_ids() & set(left) and time.monotonic() < deadline:
        time.sleep(0.5)  # polling Slurm for the event (the jobs gone), bounded
