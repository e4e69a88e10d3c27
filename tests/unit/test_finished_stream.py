"""What a rollout rank streaming finished results sends, and when (yatt_hpc/sched/finished.py)."""
from __future__ import annotations

from types import SimpleNamespace

from yatt_hpc.sched.finished import SAMPLE_HOLD_S, FinishedResults


def _r(*ids):
    return [SimpleNamespace(sample_id=i) for i in ids]


def _ids(sends):
    return [[r.sample_id for r in s] for s in sends]


def test_finished_groups_go_out_whole_in_the_order_they_complete():
    stream = FinishedResults(lambda sid: sid // 3, n=3, by_sample=False, dest_of=lambda sid: 0)   # groups {0,1,2}, {3,4,5}, ...
    assert stream.take(_r(4, 0), now=0.0, ended=False) == []
    assert _ids(stream.take(_r(3, 5, 1), now=0.001, ended=False)) == [[4, 3, 5]]
    assert _ids(stream.take(_r(2), now=0.002, ended=True)) == [[0, 1, 2]]


def test_finished_samples_go_out_a_groups_worth_at_a_time():
    stream = FinishedResults(lambda sid: sid // 3, n=3, by_sample=True, dest_of=lambda sid: 0)
    assert stream.take(_r(7, 0), now=0.0, ended=False) == []               # two of three, from two groups
    assert _ids(stream.take(_r(4, 11), now=0.001, ended=False)) == [[7, 0, 4, 11]]
    assert stream.take([], now=0.002, ended=False) == []


def test_a_straggler_waits_no_longer_than_the_hold_and_the_end_flushes_the_rest():
    stream = FinishedResults(lambda sid: sid // 3, n=3, by_sample=True, dest_of=lambda sid: 0)
    assert stream.take(_r(5), now=10.0, ended=False) == []
    assert stream.take([], now=10.0 + SAMPLE_HOLD_S / 2, ended=False) == []
    assert _ids(stream.take([], now=10.0 + SAMPLE_HOLD_S * 1.01, ended=False)) == [[5]]
    assert stream.take(_r(8), now=20.0, ended=False) == []                 # the clock starts with the first waiting
    assert _ids(stream.take([], now=20.001, ended=True)) == [[8]]
    assert stream.take([], now=20.002, ended=True) == []                   # nothing left: nothing sent


def test_finished_samples_go_out_per_destination():
    """A message goes to one GenRM rank: the samples bound for each rank fill their own batch and
    wait on their own clock, whichever replicas they belong to."""
    stream = FinishedResults(lambda sid: sid // 3, n=3, by_sample=True, dest_of=lambda sid: sid // 6)  # ranks 0: 0-5, 1: 6-11
    assert stream.take(_r(0, 7, 1, 8), now=0.0, ended=False) == []          # two for each rank
    assert _ids(stream.take(_r(9), now=0.001, ended=False)) == [[7, 8, 9]]   # rank 1 has three
    assert stream.take(_r(10), now=0.015, ended=False) == []
    assert _ids(stream.take([], now=SAMPLE_HOLD_S * 1.01, ended=False)) == [[0, 1]]  # rank 0's waited its bound
    assert _ids(stream.take([], now=0.016 + SAMPLE_HOLD_S, ended=False)) == [[10]]


def test_samples_go_at_once_when_the_rest_of_the_wave_cannot_fill_a_message():
    """With what is still to come for a GenRM rank, a held batch could no longer reach a group's
    worth: waiting out the hold would only keep the judge idle during the long tail."""
    stream = FinishedResults(lambda sid: sid // 3, n=3, by_sample=True, dest_of=lambda sid: sid // 6,
                             expected={0: 6, 1: 5})
    assert stream.take(_r(0, 1), now=0.0, ended=False) == []                 # 4 more to come for rank 0: may fill
    assert _ids(stream.take(_r(2), now=0.001, ended=False)) == [[0, 1, 2]]  # a group's worth, as before
    assert stream.take(_r(3), now=0.002, ended=False) == []                  # 1 held + 2 to come: may still fill
    assert _ids(stream.take(_r(4, 5), now=0.003, ended=False)) == [[3, 4, 5]]
    assert stream.take(_r(6, 7), now=0.004, ended=False) == []               # rank 1: 2 held + 3 to come
    assert _ids(stream.take(_r(8), now=0.005, ended=False)) == [[6, 7, 8]]
    assert _ids(stream.take(_r(9), now=0.006, ended=False)) == [[9]]        # 1 held + 1 to come: cannot fill
    assert _ids(stream.take(_r(10), now=0.007, ended=False)) == [[10]]      # the last one: at once


def test_without_expected_counts_the_hold_applies_to_the_end():
    stream = FinishedResults(lambda sid: sid // 3, n=3, by_sample=True, dest_of=lambda sid: 0, expected={1: 1})
    assert stream.take(_r(5), now=0.0, ended=False) == []                    # rank 0's count unknown: held
    assert _ids(stream.take([], now=SAMPLE_HOLD_S * 1.01, ended=False)) == [[5]]
