"""runtime/collector.py: a rank's start-up runs without the cyclic collector, its objects frozen after."""
from __future__ import annotations

import subprocess
import sys

# each scenario runs in its own interpreter: freezing this test process's objects would outlive the test
SCENARIO = """
import gc, sys
from yatt_hpc.runtime import collector
if sys.argv[1] == "user-off":
    gc.disable()
collector.pause_during_startup()
paused = gc.isenabled()
cycles = []
for i in range(5000):  # start-up's objects, some of them in reference cycles
    node = {"i": i}
    node["self"] = node
    cycles.append(node)
said = collector.resume_after_startup()
print(paused, gc.isenabled(), gc.get_freeze_count() >= 5000)
print(said)
"""


def _run(mode: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_startup_runs_without_the_collector_and_its_objects_are_frozen_after():
    flags, said = _run("default")
    # off during start-up, on again after, start-up's objects frozen out of later collections
    assert flags == "False True True", flags
    assert said.startswith("start-up ran without the cyclic collector; its ") and "frozen" in said, said


def test_a_collector_the_user_turned_off_stays_off():
    flags, said = _run("user-off")
    assert flags == "False False True", flags
    assert "left off, as it was" in said, said
