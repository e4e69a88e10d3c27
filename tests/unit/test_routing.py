"""Routing is pure and total: every trainer replica has exactly one rollout and one GenRM rank."""
from pathlib import Path

import pytest

from yatt_hpc.config import load_config
from yatt_hpc.placement import plan
from yatt_hpc.sched.routing import Routes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, overrides", [
    pytest.param("demo_cpu.yaml", (), id="demo"),
    pytest.param("disjoint_cpu.yaml", ("placement.rollout.tasks_per_node=3",), id="disjoint-tp2-3-rollouts"),
    pytest.param("qwen2_7b_disjoint_1024gpu.yaml", (), id="1024-gpu"),
])
def test_every_replica_is_served_once(name, overrides):
    p = plan(load_config(REPO / "configs" / name, overrides))
    r = Routes(p)
    rollout, genrm = p.group("rollout"), p.group("genrm")
    served = sorted(d for w in range(rollout.rank_start, rollout.rank_stop) for d in r.replicas_of_rollout(w))
    scored = sorted(d for w in range(genrm.rank_start, genrm.rank_stop) for d in r.replicas_of_genrm(w))
    assert served == scored == list(range(r.dp))
    owners = [r.trainer_owner(d) for d in range(r.dp)]
    assert owners[0] == 0 and len(set(owners)) == r.dp
    assert all(r.trainer_coords(o)["tp"] == 0 and r.trainer_coords(o)["dp"] == d for d, o in enumerate(owners))
    # every rollout rank gets weights from exactly one replica
    targets = sorted(w for d in range(r.dp) for w in r.weight_targets_of(d))
    assert targets == list(range(rollout.rank_start, rollout.rank_stop))


def test_1024_gpu_weight_sync_spreads_over_replicas():
    r = Routes(plan(load_config(REPO / "configs/qwen2_7b_disjoint_1024gpu.yaml")))
    loads = [len(r.weight_targets_of(d)) for d in range(r.dp)]
    # 192 rollout replicas over 128 trainer replicas: each sends to one or two, every rollout rank gets one
    assert (min(loads), max(loads), sum(loads)) == (1, 2, 192)


def test_an_engine_takes_its_replicas_weights_then_each_expert_parallel_peers_experts():
    """ep 2 over dp 4: replicas {0, 1} and {2, 3} are expert groups (Megatron's order: tp, ep, expert dp); an engine
    fed by replica 3 takes replica 3's owner first (dense layers and its experts), then replica 2's (its experts)."""
    p = plan(load_config(REPO / "configs/demo_cpu.yaml", ["placement.trainer={nodes: 1, tasks_per_node: 4, dp: 4, ep: 2}",
                                                          "placement.rollout.tasks_per_node=4"]))
    r = Routes(p)
    assert p.group("trainer").ep == 2
    assert [r.expert_peers(d) for d in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r.weight_senders(d) for d in range(4)] == [[0, 1], [1, 0], [2, 3], [3, 2]]
    assert Routes(plan(load_config(REPO / "configs/demo_cpu.yaml"))).weight_senders(1) == [1]
