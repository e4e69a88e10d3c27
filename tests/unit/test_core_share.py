"""On CPU the cores are the devices: in full colocation the rank whose phase holds the devices also
takes the node's cores, and gives them back when it releases (yatt_hpc/roles/colocation.py)."""
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO
from yatt_hpc.config import load_config
from yatt_hpc.placement import plan
from yatt_hpc.roles import colocation


def world_of(group: str, *sets: str):
    return SimpleNamespace(plan=plan(load_config(REPO / "configs/demo_cpu.yaml", list(sets))), group=group)


@pytest.mark.parametrize("group, cores, expect", [
    ("trainer", 2, (1, 1)),   # two trainer ranks on two cores: one each, in and out of their phase
    ("rollout", 2, (1, 2)),   # the one rollout rank takes both cores while it generates
    ("genrm", 2, (1, 2)),
    ("trainer", 16, (1, 8)),
    ("rollout", 16, (1, 16)),
])
def test_full_colocation_gives_the_active_phase_the_nodes_cores(group, cores, expect):
    share = colocation.core_share(world_of(group), {}, usable_cores=cores, on_cpu=True)
    assert (share.idle, share.active) == expect


def test_slurm_cpus_on_node_and_the_process_affinity_bound_the_share():
    w = world_of("rollout")
    assert colocation.core_share(w, {"SLURM_CPUS_ON_NODE": "4"}, usable_cores=16, on_cpu=True).active == 4
    assert colocation.core_share(w, {"SLURM_CPUS_ON_NODE": "64"}, usable_cores=8, on_cpu=True).active == 8


@pytest.mark.parametrize("sets, on_cpu", [
    (("placement.mode=partial",), True),
    (("placement.mode=disjoint",), True),
    ((), False),
])
def test_other_placements_and_gpus_keep_the_plans_cpus_per_task(sets, on_cpu):
    w = world_of("rollout", *sets, "placement.rollout.cpus_per_task=3")
    assert colocation.core_share(w, {}, usable_cores=16, on_cpu=on_cpu) == colocation.CoreShare(3, 3)


def test_resume_takes_the_cores_and_release_gives_them_back(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(colocation, "_SHARE", colocation.CoreShare(idle=1, active=2))
    stats = SimpleNamespace(phase=lambda name: __import__("contextlib").nullcontext())
    engine = SimpleNamespace(resume_memory=lambda: None, release_memory=lambda: None)
    try:
        torch.set_num_threads(1)
        with colocation.holding_devices(stats, engine, enabled=True):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with colocation.holding_devices(stats, engine, enabled=False):  # not colocated: nothing moves
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
