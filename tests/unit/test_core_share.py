"""On CPU the cores are the devices: in full colocation the group whose phase runs takes the node's cores
as torch threads (`placement.node_cpus`) and gives them back when the phase ends
(yatt_hpc/placement/plan.py `Plan.phase_threads`, yatt_hpc/roles/colocation.py)."""
import os
import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import NO_EVAL, REPO
from yatt_hpc.config import load_config
from yatt_hpc.placement import PlanError, plan
from yatt_hpc.roles import colocation


def plan_of(*sets: str):
    return plan(load_config(REPO / "configs/demo_cpu.yaml", list(sets)))


@pytest.mark.parametrize("sets, expect", [
    # the demo (null): 2 trainer ranks x 1 cpu are the most any group asks of the node
    ((), {"trainer": (1, 1), "rollout": (1, 2), "genrm": (1, 2)}),
    (("placement.node_cpus=16",), {"trainer": (1, 8), "rollout": (1, 16), "genrm": (1, 16)}),
    (("placement.rollout.cpus_per_task=3",), {"trainer": (1, 1), "rollout": (3, 3), "genrm": (1, 3)}),
    (("placement.node_cpus=1",), {"trainer": (1, 1), "rollout": (1, 1), "genrm": (1, 1)}),  # never below cpus_per_task
])
def test_node_cpus_gives_the_running_phase_the_nodes_cores(sets, expect):
    p = plan_of(*sets)
    assert {g: p.phase_threads(g) for g in expect} == expect


@pytest.mark.parametrize("mode", ["partial", "disjoint"])
def test_other_placements_keep_cpus_per_task_and_refuse_node_cpus(mode):
    p = plan_of(f"placement.mode={mode}", "placement.rollout.cpus_per_task=3")
    assert p.node_cpus is None and p.phase_threads("rollout") == (3, 3) and p.phase_threads("trainer") == (1, 1)
    with pytest.raises(PlanError, match=rf"placement.node_cpus=2 is set but placement.mode={mode}.*remove"):
        plan_of(f"placement.mode={mode}", "placement.node_cpus=2")


@pytest.mark.parametrize("sets, in_turns", [
    ((), True),
    (("placement.host_memory=kept",), False),
    (("placement.mode=partial", "placement.dynamic_split.enabled=true", *NO_EVAL, "placement.host_memory=kept"), False),
])
def test_host_memory_kept_where_phases_take_the_devices_in_turn(sets, in_turns):
    assert plan_of(*sets).host_memory_in_turns is in_turns


@pytest.mark.parametrize("mode", ["partial", "disjoint"])
def test_host_memory_kept_is_refused_where_no_rank_hands_memory_over(mode):
    assert plan_of(f"placement.mode={mode}").host_memory_in_turns  # the default: nothing to refuse
    with pytest.raises(PlanError, match=rf"placement.host_memory=kept is set but placement.mode={mode}.*remove"):
        plan_of(f"placement.mode={mode}", "placement.host_memory=kept")


def test_resume_takes_the_phases_threads_and_release_gives_them_back():
    before = torch.get_num_threads()
    stats = SimpleNamespace(phase=lambda name: nullcontext(), add=lambda key, value: None)
    engine = SimpleNamespace(resume_memory=lambda: None, release_memory=lambda: None)
    try:
        colocation.set_phase_threads(1, 2)
        assert torch.get_num_threads() == 1
        with colocation.holding_devices(stats, engine, enabled=True):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with colocation.holding_devices(stats, engine, enabled=False):  # not colocated: nothing moves
            assert torch.get_num_threads() == 1
        with colocation.holding_devices(stats, None, enabled=True):  # no judge (rule only): nothing to take
            assert torch.get_num_threads() == 1
    finally:
        colocation.set_phase_threads(0, 0)
        torch.set_num_threads(before)


def test_threads_set_before_torch_loads_are_the_ones_torch_starts_with():
    """The worker sets the idle threads before a controller imports torch (a rule-only GenRM rank never
    does): torch then starts with them, and a phase still takes the active count."""
    code = ("import os, sys; from types import SimpleNamespace; from contextlib import nullcontext; "
            "from yatt_hpc.roles import colocation; colocation.set_phase_threads(1, 2); "
            "assert 'torch' not in sys.modules; import torch; idle = torch.get_num_threads(); "
            "stats = SimpleNamespace(phase=lambda name: nullcontext()); "
            "engine = SimpleNamespace(resume_memory=lambda: None, release_memory=lambda: None); "
            "colocation.resume(stats, engine); active = torch.get_num_threads(); "
            "print(os.environ['OMP_NUM_THREADS'], idle, active)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "1", "2"]


# A phase that ends with 48 MiB free in its heap: kept (placement.host_memory=kept), the memory stays resident and
# nothing is counted; in turns, it leaves the process and the rank's stats count what left (memory/given_back_mb).
PHASE_END = """
import numpy as np, psutil
from yatt_hpc.roles import colocation
from yatt_hpc.runtime.allocator import keep_freed_memory
class Stats:
    values = {}
    def add(self, key, value):
        self.values[key] = self.values.get(key, 0.0) + value
keep_freed_memory()
blocks = [np.ones(6 << 17) for _ in range(8)]  # 48 MiB from the heap, every page written
del blocks
stats, rss = Stats(), lambda: psutil.Process().memory_info().rss
colocation.set_host_memory(in_turns=False)
before = rss()
kept = colocation.give_back_phase_memory(stats, at_least=32 << 20)
kept_drop, kept_counted = (before - rss()) >> 20, dict(stats.values)
colocation.set_host_memory(in_turns=True)
given = colocation.give_back_phase_memory(stats, at_least=32 << 20)
print(kept, kept_drop, len(kept_counted), given >> 20, (before - rss()) >> 20, int(stats.values["given_back_bytes"]) >> 20)
"""


def test_a_phase_end_gives_its_free_heap_back_in_turns_and_keeps_it_when_kept():
    done = subprocess.run([sys.executable, "-c", PHASE_END], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    kept, kept_drop, kept_counted, given_mb, dropped_mb, counted_mb = map(int, done.stdout.split())
    assert kept == 0 and kept_drop < 8 and kept_counted == 0, done.stdout  # kept: still resident, nothing counted
    assert given_mb >= 40 and dropped_mb >= 40 and abs(counted_mb - dropped_mb) <= 1, done.stdout  # what left
