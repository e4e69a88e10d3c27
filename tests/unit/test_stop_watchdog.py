"""The stop watchdog's state machine, one rank, real threads: the step boundary first, or the grace first.

The loop thread here is a plain thread playing StepLoop's part (begin_step, a long step, an optimizer
step announced with enter_mutation, end_step); the watchdog is the real one with its communicator
left out (a job of one rank), and an `exit` that records instead of ending the test process.
"""
import threading
import time

import pytest

from yatt_hpc.runtime.signals import StopFlag
from yatt_hpc.runtime.stop_watchdog import StepGuard, StepRecord, StopWatchdog, should_abandon
from yatt_hpc.sched.requeue import SIGNAL


class Run:
    """A watchdog over a guard, with what it abandoned and when it exited."""

    def __init__(self, grace_s: float):
        self.guard, self.flag = StepGuard(), StopFlag()
        self.calls: list[tuple[StepRecord, float, bool]] = []
        self.exited = threading.Event()
        self.dog = StopWatchdog(None, self.guard, self.flag, grace_s, self._abandon, poll_s=0.01,
                                exit=lambda code: self.exited.set())

    def _abandon(self, record: StepRecord, waited: float) -> None:
        self.calls.append((record, waited, self.guard.frozen))

    def signal(self) -> float:
        self.flag.note(SIGNAL)
        return time.monotonic()


def record(step: int) -> StepRecord:
    return StepRecord(step, {"data_position": {"next_index": step * 4}}, saved=False)


def test_step_that_ends_within_the_grace_stops_at_its_boundary():
    run = Run(grace_s=1.5)
    run.guard.begin_step(record(3))
    run.signal()
    time.sleep(0.1)
    run.guard.enter_mutation()  # the optimizer step
    run.guard.end_step()        # the boundary: the loop's own stop path saves from here
    time.sleep(2.0)             # well past the grace
    run.dog.close()
    assert run.calls == [] and not run.exited.is_set() and not run.guard.frozen


def test_step_that_outlasts_the_grace_is_given_up_and_the_last_step_committed():
    run = Run(grace_s=0.3)
    run.guard.begin_step(record(3))
    sent = run.signal()
    assert run.exited.wait(5), "the watchdog did not give up the step"
    took = time.monotonic() - sent
    (rec, waited, frozen), = run.calls
    assert rec.step == 3 and rec.light == {"data_position": {"next_index": 12}}
    assert frozen, "the loop was not parked while the checkpoint was taken"
    assert waited >= 0.3 and took < 0.3 + 2.0, f"gave up after {took:.2f}s, grace 0.3s"
    assert run.dog.abandoned == rec


def test_a_frozen_loop_parks_before_its_optimizer_step():
    run = Run(grace_s=60)
    run.guard.begin_step(record(1))
    assert run.guard.freeze(in_step=True) == record(1)
    reached = threading.Event()

    def loop():
        run.guard.enter_mutation()
        reached.set()

    threading.Thread(target=loop, daemon=True).start()
    assert not reached.wait(0.3), "the optimizer step ran while the state was being saved"
    run.guard.release()
    assert reached.wait(2)
    assert run.guard.freeze() is None, "a guard past its optimizer step must not freeze"
    run.dog.close()


@pytest.mark.parametrize("mutate, end, in_step, step, ok", [
    pytest.param(False, False, True, None, True, id="clean-in-step"),
    pytest.param(True, False, True, None, False, id="optimizer-step-started"),
    pytest.param(False, True, True, None, False, id="leader-past-its-step-end"),
    pytest.param(False, True, False, 2, True, id="follower-clean-at-boundary"),
    pytest.param(False, False, False, 1, False, id="follower-asked-for-another-step"),
])
def test_freeze_only_while_the_state_is_still_the_step_start(mutate, end, in_step, step, ok):
    guard = StepGuard()
    assert guard.freeze() is None  # no step yet
    guard.begin_step(record(2))
    if mutate:
        guard.enter_mutation()
    if end:
        guard.end_step()
    assert (guard.freeze(step, in_step=in_step) is not None) is ok


def test_optimizer_step_before_the_grace_runs_out_leaves_the_stop_to_the_boundary():
    run = Run(grace_s=1.0)
    run.guard.begin_step(record(5))
    run.signal()
    run.guard.enter_mutation()  # long optimizer phase: past the step start, nothing to save early
    time.sleep(1.5)
    assert run.calls == []
    run.guard.end_step()
    run.dog.close()


@pytest.mark.parametrize("now, since, grace, expected", [
    pytest.param(10.0, None, 1.0, False, id="no-signal"),
    pytest.param(10.0, 9.5, 1.0, False, id="within-grace"),
    pytest.param(10.0, 9.0, 1.0, True, id="grace-spent"),
])
def test_should_abandon(now, since, grace, expected):
    assert should_abandon(now, since, grace) is expected
