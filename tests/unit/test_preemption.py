"""Stop decisions are pure: the wall-time deadline and whether to requeue, with the reason."""
import pytest

from yatt_hpc.sched.requeue import DEADLINE, SIGNAL, decide_requeue, past_deadline


@pytest.mark.parametrize("now, end, step, save, expected", [
    pytest.param(1000.0, None, 10.0, 1.0, False, id="no-end-time"),
    pytest.param(1000.0, 1100.0, 10.0, 1.0, False, id="plenty-of-time"),
    pytest.param(1000.0, 1016.0, 10.0, 1.0, True, id="one-more-step-would-not-fit"),
    pytest.param(1000.0, 1017.0, 10.0, 1.0, False, id="fits-with-margin"),
    pytest.param(1000.0, 1001.0, 0.0, 0.0, False, id="no-step-measured-yet"),
])
def test_past_deadline(now, end, step, save, expected):
    assert past_deadline(now, end, step, save) is expected


def test_requeue_decisions_name_their_reason():
    local = decide_requeue(SIGNAL, 0, 3, in_slurm=False)
    assert not local.requeue and "run the same command again" in local.reason
    yes = decide_requeue(SIGNAL, 1, 3, in_slurm=True)
    assert yes.requeue and "requeue 2 of at most 3" in yes.reason
    no = decide_requeue(DEADLINE, 3, 3, in_slurm=True)
    assert not no.requeue and "slurm.max_requeues=3" in no.reason and "wall-time deadline" in no.reason
