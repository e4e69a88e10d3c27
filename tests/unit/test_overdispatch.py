"""Long-tail control, pure parts: least-loaded assignment, the prompt queue, GenRM's and the rollout
rank's abort bookkeeping. Hand-computed cases; no MPI."""
from pathlib import Path

import numpy as np
import pytest

from yatt_hpc.comm.prompt_routing import assign_least_loaded, rank_loads, spread
from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.sched.overdispatch import PromptQueue, ReplicaWave, RolloutWork, dispatch_count, keep_lowest

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ least-loaded assignment


def test_lpt_puts_each_group_on_the_least_loaded_rank():
    loads = [[10, 1, 1], [7, 6, 3]]          # replica 0: groups 0..2, replica 1: groups 0..2
    got = assign_least_loaded(loads, 2)
    # heaviest first: 10 -> r0; 7 -> r1; 6 -> r1 (7 < 10); 3 -> r0 (10 < 13); 1 -> r0 (tie 13/13: lower rank); 1 -> r1
    assert got == [[0, 0, 1], [1, 1, 0]]
    assert rank_loads(loads, got, 2).tolist() == [14.0, 14.0]
    assert spread(rank_loads(loads, got, 2)) == 1.0


def test_lpt_is_deterministic_and_total_and_never_splits_a_group():
    rng = np.random.default_rng(0)
    loads = [list(rng.integers(1, 100, size=k).astype(float)) for k in (5, 0, 7, 3)]
    a, b = assign_least_loaded(loads, 3), assign_least_loaded([list(r) for r in loads], 3)
    assert a == b
    assert [len(r) for r in a] == [len(r) for r in loads]          # one rank per group: a group stays whole
    assert all(0 <= r < 3 for row in a for r in row)
    totals = rank_loads(loads, a, 3)
    assert totals.sum() == sum(map(sum, loads))
    assert totals.max() - totals.min() <= max(max(r) for r in loads if r)   # LPT's bound: within one item


def test_lpt_with_more_ranks_than_groups_and_with_nothing():
    assert assign_least_loaded([[5.0], [4.0]], 4) == [[0], [1]]
    assert assign_least_loaded([[], []], 2) == [[], []]
    assert spread(np.zeros(3)) == 1.0


# ------------------------------------------------------------------ dispatch count and the queue


@pytest.mark.parametrize("keep, ratio, want", [
    pytest.param(4, 1.0, 4, id="off"), pytest.param(4, 1.5, 6, id="half-more"),
    pytest.param(10, 1.1, 11, id="no-float-creep"), pytest.param(1, 1.01, 2, id="at-least-one-more"),
    pytest.param(0, 2.0, 0, id="nothing-needed"),
])
def test_dispatch_count_is_ceil_of_keep_times_ratio(keep, ratio, want):
    assert dispatch_count(keep, ratio) == want


def test_queue_hands_out_returned_positions_first_then_fresh_ones():
    q = PromptQueue(stride=2, offset=1)
    got, reused = q.take(3)
    assert got.tolist() == [1, 3, 5] and reused == 0
    q.give_back([5, 1])                      # any order in, ascending out, before anything fresh
    got, reused = q.take(3)
    assert got.tolist() == [1, 5, 7] and reused == 2
    q.give_back([7])
    q.give_back([1])                         # a later return goes in front of an earlier one
    assert q.state() == {"next_index": 4, "returned": [1, 7], "base": 0}
    got, reused = q.take(1)
    assert got.tolist() == [1] and reused == 1 and list(q.returned) == [7]
    r = PromptQueue(stride=2, offset=1)
    r.load_state(**q.state())
    assert r.take(2)[0].tolist() == q.take(2)[0].tolist() == [7, 9]


def test_queue_refuses_positions_it_never_handed_out():
    q = PromptQueue(stride=2, offset=0)
    q.take(2)
    with pytest.raises(AssertionError):
        q.give_back([4])
    with pytest.raises(AssertionError):
        q.give_back([1])


def test_keep_lowest_ignores_arrival_order():
    assert keep_lowest([9, 3, 7, 1], 2) == ([1, 3], [7, 9])
    assert keep_lowest({5}, 3) == ([5], [])


# ------------------------------------------------------------------ GenRM's bookkeeping


def test_wave_without_over_dispatch_ends_when_every_counted_sample_arrived():
    w = ReplicaWave(keep=2, n=2, expected={10: 2, 11: 2, 12: 0}, handshake=False)
    assert w.expected == {10: 2, 11: 2}      # ranks without work are not waited for
    assert w.on_samples(10, 2) and not w.finished
    w.on_scored([4, 4])
    assert not w.target_reached and not w.should_stop()
    assert w.on_samples(11, 2)
    w.on_scored([6, 6])
    assert w.target_reached and w.finished and w.kept() == [4, 6] and not w.should_stop()


def test_over_dispatched_wave_stops_once_then_drains_by_the_sent_counts():
    w = ReplicaWave(keep=2, n=2, expected={10: 4, 11: 2}, handshake=True)   # 3 groups for 2
    assert w.on_samples(11, 2)
    w.on_scored([8, 8])
    assert not w.should_stop()
    assert w.on_samples(10, 2)
    w.on_scored([2, 2])
    assert w.target_reached and w.should_stop()
    assert w.stop_targets() == [10, 11] and not w.should_stop()    # STOP goes out once
    assert w.kept() == [2, 8]
    w.on_end(11, 2)
    assert not w.finished
    w.on_end(10, 4)                          # rank 10 had sent its second group before STOP
    assert not w.finished                    # ... which is still in flight
    assert not w.on_samples(10, 2)           # a straggler after the target: not scored
    assert w.finished


def test_over_dispatched_wave_with_an_aborted_rank_finishes_on_its_end():
    w = ReplicaWave(keep=1, n=1, expected={10: 3}, handshake=True)
    w.on_samples(10, 1)
    w.on_scored([5])
    w.stop_targets()
    w.on_end(10, 1)                          # two samples aborted: never come
    assert w.finished and w.kept() == [5]


def test_wave_rejects_impossible_counts():
    with pytest.raises(AssertionError):
        ReplicaWave(keep=2, n=2, expected={1: 3}, handshake=True)      # not whole groups
    with pytest.raises(AssertionError):
        ReplicaWave(keep=3, n=2, expected={1: 4}, handshake=True)      # keeps more than sent
    w = ReplicaWave(keep=1, n=1, expected={1: 1}, handshake=True)
    with pytest.raises(AssertionError):
        w.on_end(1, 1)                       # END without a STOP
    with pytest.raises(AssertionError):
        w.on_samples(2, 1)                   # a rank that got no work


def test_empty_wave_is_finished_and_target_met_at_once():
    w = ReplicaWave(keep=0, n=4, expected={}, handshake=True)
    assert w.target_reached and w.should_stop() and w.stop_targets() == [] and w.finished


# ------------------------------------------------------------------ a rollout rank's work


def test_rollout_work_cuts_chunks_on_group_boundaries_and_drops_stopped_owners():
    owners = np.array([0, 0, 1, 1, 0, 0, 1, 1])       # groups: p0 (o0), p1 (o1), p2 (o0), p3 (o1)
    prompts = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    work = RolloutWork(owners, prompts, chunk_groups=1)
    assert work.next_chunk().tolist() == [0, 1]
    work.mark_sent(0, 2)
    assert work.stop(0) == 2                           # p2 never generated: aborted
    assert work.next_chunk().tolist() == [2, 3]        # o1's p1
    work.mark_sent(1, 2)
    assert work.next_chunk().tolist() == [6, 7]        # o0's p2 skipped
    work.mark_sent(1, 2)
    assert work.next_chunk() is None
    assert work.awaiting_stop() == [1]
    assert work.stop(1) == 0 and work.awaiting_stop() == []
    with pytest.raises(AssertionError):
        work.stop(1)                                   # a second STOP for the same wave is a bug


def test_rollout_work_chunks_of_several_groups_and_empty_work():
    work = RolloutWork(np.array([3] * 6), np.array([0, 0, 1, 1, 2, 2]), chunk_groups=2)
    assert work.next_chunk().tolist() == [0, 1, 2, 3] and work.next_chunk().tolist() == [4, 5]
    empty = RolloutWork(np.zeros(0, np.int32), np.zeros(0, np.int64), chunk_groups=2)
    assert empty.next_chunk() is None and empty.awaiting_stop() == []


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("value, needle", [
    pytest.param("0.5", "greater than or equal to 1", id="below-one"),
    pytest.param("9", "less than or equal to 4", id="too-large"),
])
def test_over_dispatch_ratio_out_of_range_names_field_and_value(value, needle):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/demo_cpu.yaml", [f"rollout.over_dispatch_ratio={value}"])
    assert "rollout.over_dispatch_ratio" in str(err.value) and value in str(err.value) and needle in str(err.value)


def test_routing_knob_lists_its_choices():
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/demo_cpu.yaml", ["rollout.routing=random"])
    assert "rollout.routing" in str(err.value) and "'static' or 'least_loaded'" in str(err.value)


def test_genrm_scores_only_the_groups_the_target_still_needs():
    w = ReplicaWave(keep=2, n=2, expected={10: 8}, handshake=True)
    prompts = np.array([7, 7, 3, 3, 9, 9, 5, 5])
    assert w.on_samples(10, 8)
    assert w.wanted(prompts).tolist() == [2, 3, 6, 7]      # groups 3 and 5, the lowest two
    w.on_scored([3, 3])
    assert w.wanted(prompts).tolist() == [2, 3]
    w.on_scored([5, 5])
    assert w.wanted(prompts).tolist() == []


def test_samples_streamed_one_by_one_complete_their_groups_before_new_groups_are_taken():
    # rollout.streaming=finished_samples: a group arrives in pieces; it counts as scored once all n
    # of its samples are, and a group begun is always finished before the target takes new ones
    w = ReplicaWave(keep=2, n=3, expected={10: 6}, handshake=False)
    assert w.on_samples(10, 2)
    assert w.wanted(np.array([4, 7])).tolist() == [0, 1]
    w.on_scored([4, 7])
    assert w.scored_groups == set() and not w.target_reached
    assert w.wanted(np.array([9, 4, 4, 7])).tolist() == [1, 2, 3]   # group 9 would be a third
    w.on_scored([4, 4, 7])
    assert w.scored_groups == {4} and not w.target_reached
    w.on_scored([7])
    assert w.target_reached and w.kept() == [4, 7]
    with pytest.raises(AssertionError):
        w.on_scored([7])                     # more samples than the group has
