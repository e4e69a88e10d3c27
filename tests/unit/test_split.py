"""The dynamic rollout/GenRM split: the decision rule, its state across steps, and the routes it makes."""
from pathlib import Path

import pytest

from yatt_hpc.config import load_config
from yatt_hpc.placement import PlanError, plan
from yatt_hpc.sched.routing import RoleSplit, Routes
from yatt_hpc.sched.split import SplitSchedule, decide_split, predicted_busy_s, role_busy_s

REPO = Path(__file__).resolve().parents[2]


def split_cfg(*overrides):
    return load_config(REPO / "configs/partial_cpu.yaml",
                       ["placement.dynamic_split.enabled=true", "placement.rollout.tasks_per_node=2", *overrides])


@pytest.mark.parametrize("current, rollout_s, genrm_s, replicas, pool, want", [
    pytest.param(2, 1.0, 6.0, 2, 3, 1, id="scoring-heavy-gets-more-genrm"),
    pytest.param(1, 6.0, 1.0, 2, 3, 2, id="generation-heavy-gets-more-rollout"),
    pytest.param(4, 1.0, 3.0, 16, 8, 2, id="proportional-share-of-8"),
    pytest.param(4, 1.0, 3.0, 8, 8, 4, id="unless-trainer-replicas-are-too-few-to-gain"),
    pytest.param(2, 1.0, 1.0, 8, 4, 2, id="balanced-stays"),
    pytest.param(2, 1.0, 9.0, 2, 4, 2, id="a-third-genrm-rank-would-idle-with-2-trainer-replicas"),
    pytest.param(3, 1.0, 9.0, 3, 4, 1, id="but-not-with-3-trainer-replicas"),
])
def test_split_follows_the_load(current, rollout_s, genrm_s, replicas, pool, want):
    assert decide_split(current, pool, replicas, rollout_s, genrm_s).rollout == want


MANY = 840  # trainer replicas divisible by every role size of a pool of 8: work divides evenly


def test_each_role_keeps_min_replicas():
    assert decide_split(4, 8, MANY, 0.1, 100.0, min_replicas=1).rollout == 1
    assert decide_split(4, 8, MANY, 0.1, 100.0, min_replicas=3).rollout == 3
    assert decide_split(4, 8, MANY, 100.0, 0.1, min_replicas=3).rollout == 5
    assert decide_split(4, 8, MANY, 100.0, 0.0, min_replicas=1).rollout == 7


def test_hysteresis_keeps_a_split_that_is_nearly_as_good():
    # 4 of 8 rollout replicas: 5 predicts the busiest replica 20% less busy
    now, better = predicted_busy_s(4, 8, MANY, 5.0, 3.0), predicted_busy_s(5, 8, MANY, 5.0, 3.0)
    assert better == pytest.approx(0.8 * now)
    assert decide_split(4, 8, MANY, 5.0, 3.0, hysteresis=0.25).rollout == 4
    assert "within hysteresis" in decide_split(4, 8, MANY, 5.0, 3.0, hysteresis=0.25).reason
    assert decide_split(4, 8, MANY, 5.0, 3.0, hysteresis=0.1).rollout == 5


def test_no_measured_load_keeps_the_split_and_ties_prefer_no_switch():
    assert decide_split(3, 8, 8, 0.0, 0.0).rollout == 3
    # with 2 trainer replicas and a pool of 6, any 2..4 rollout ranks predict the same: stay
    for current in (2, 3, 4):
        assert decide_split(current, 6, 2, 1.0, 1.0, hysteresis=0.0).rollout == current


def test_decision_is_deterministic_and_stable_under_repetition():
    runs = {decide_split(5, 16, 16, 3.7, 9.1) for _ in range(5)}
    assert len(runs) == 1
    # applying the rule again to the same load does not move further (no oscillation)
    first = decide_split(8, 16, 16, 3.7, 9.1).rollout
    assert decide_split(first, 16, 16, 3.7, 9.1).rollout == first


def report(group, **times):
    return {"group": group, "times": times, "values": {}, "peak_held": 0, "peak_rss_mb": 1.0}


def test_load_is_summed_per_served_role():
    reports = [report("trainer", train=5.0), report("rollout", rollout=1.0, weight_sync=9.0),
               report("rollout", rollout=2.0), report("genrm", reward=4.0, release=1.0)]
    assert role_busy_s(reports) == (3.0, 4.0)


def test_schedule_decides_two_steps_ahead_and_round_trips_through_counters():
    s = SplitSchedule(pool=3, replicas=2, min_replicas=1, hysteresis=0.1, current=2, pending=2)
    assert s.agreed(2) == RoleSplit(2, 2)
    s.end_step([report("rollout", rollout=1.0), report("rollout", rollout=1.0), report("genrm", reward=12.0)])
    assert (s.ran, s.current, s.pending) == (2, 2, 1)  # step 1 keeps 2 (its weights went out), step 2 gets 1
    assert s.scalars()["placement/genrm_replicas"] == 1 and s.scalars()["placement/decided_rollout_replicas"] == 1
    follower = SplitSchedule(pool=3, replicas=2, min_replicas=1, hysteresis=0.1, current=2, pending=2)
    follower.end_step(None)  # not the leader: learns `pending` at the next agreement
    assert follower.agreed(s.pending) == s.agreed(s.pending) == RoleSplit(2, 1)
    resumed = SplitSchedule(pool=3, replicas=2, min_replicas=1, hysteresis=0.1, current=2, pending=2)
    assert resumed.restore(s.counters()) and (resumed.current, resumed.pending) == (2, 1)
    assert not resumed.restore({"step": 4})  # a checkpoint without a split keeps the configured one
    assert not resumed.restore({"split_rollout": 3, "split_rollout_next": 1})  # no GenRM rank left


def test_routes_of_a_split_cover_the_pool_and_send_weights_to_next_generators():
    p = plan(split_cfg())
    assert p.dynamic_split and list(p.pool_ranks) == [2, 3, 4]
    r = Routes(p, RoleSplit(rollout=2, next_rollout=1))
    assert r.rollout_ranks() == [2, 3] and r.genrm_ranks() == [4] and r.next_rollout_ranks() == [2]
    assert sorted(w for d in range(r.dp) for w in r.weight_targets_of(d)) == [2]
    served = sorted(d for w in r.rollout_ranks() for d in r.replicas_of_rollout(w))
    scored = sorted(d for w in r.genrm_ranks() for d in r.replicas_of_genrm(w))
    assert served == scored == [0, 1]
    r = Routes(p, RoleSplit(rollout=1, next_rollout=2))
    assert r.genrm_ranks() == [3, 4] and sorted(w for d in range(r.dp) for w in r.weight_targets_of(d)) == [2, 3]
    # without a split: the plan's groups, as always
    static = Routes(p)
    assert static.rollout_ranks() == [2, 3] and static.genrm_ranks() == [4] == static.genrm_ranks()


@pytest.mark.parametrize("overrides, needle", [
    pytest.param(("placement.mode=colocate",), "needs placement.mode=partial", id="not-partial"),
    pytest.param(("placement.genrm.cpus_per_task=2",), "placement.rollout.cpus_per_task=1 != placement.genrm.cpus_per_task=2",
                 id="shape-mismatch"),
    pytest.param(("placement.dynamic_split.min_replicas=2",), "placement.genrm starts with 1 replicas", id="min-replicas"),
])
def test_impossible_dynamic_split_names_field_and_fix(overrides, needle):
    with pytest.raises(PlanError) as err:
        plan(split_cfg(*overrides))
    assert needle in str(err.value) and "set " in str(err.value)
