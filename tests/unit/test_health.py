"""Stall detection: the leader's rule on hand-made views, and the beat encoding (no MPI here)."""
import pytest

from tests.conftest import REPO
from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.metrics.activity import Activity
from yatt_hpc.runtime.health import decode_label, encode_beat
from yatt_hpc.sched.stall import RankView, find_stall

T = 120.0


def views(**kw):
    """rank -> RankView(last_heard, last_progress, waiting, label); the clock reads 1000 below."""
    return {int(k[1:]): RankView(heard, progress, waiting=waiting, label=label)
            for k, (heard, progress, waiting, label) in kw.items()}


@pytest.mark.parametrize("ranks, expect", [
    pytest.param(views(r0=(999, 990, False, "step 3"), r1=(998, 995, True, "recv tag 5")), None, id="healthy"),
    pytest.param(views(r0=(999, 990, False, "step 3"), r1=(870, 860, False, "decode"), r2=(999, 999, True, "x")),
                 (1, "silent", 130), id="one-rank-silent"),
    pytest.param(views(r0=(999, 870, True, "recv tag 5"), r1=(999, 850, False, "decode"), r2=(999, 860, True, "y")),
                 (1, "stuck", 150), id="busy-rank-without-progress-while-the-others-wait"),
    pytest.param(views(r0=(999, 870, True, "agree stop"), r1=(999, 860, True, "recv tag 5"),
                       r2=(999, 875, True, "step report")), (1, "deadlock", 140), id="everyone-waits"),
    pytest.param(views(r0=(999, 870, True, "a"), r1=(999, 990, False, "decode"), r2=(999, 860, True, "b")),
                 None, id="one-rank-still-moving"),
])
def test_the_leader_names_the_stalled_rank(ranks, expect):
    stall = find_stall(1000.0, ranks, T)
    got = None if stall is None else (stall.rank, stall.kind, round(stall.seconds))
    assert got == expect, stall


def test_a_silent_rank_is_named_before_a_stuck_world():
    ranks = views(r0=(999, 800, False, "train"), r1=(850, 850, False, "decode"))
    stall = find_stall(1000.0, ranks, T)
    assert (stall.rank, stall.kind) == (1, "silent") and "SIGSTOP" in stall.cause and "'decode'" in stall.cause


def test_a_beat_carries_progress_wait_state_and_label():
    a = Activity()
    a.progress("step 7")
    with a.waiting("recv tag 12 from the rollout ranks, a long label that is cut at 64 bytes ......"):
        beat = encode_beat(5, a)
    assert list(beat[:4]) == [5, 1, 1, 0]
    assert decode_label(beat).startswith("recv tag 12") and len(decode_label(beat)) == 64
    assert not a.is_waiting and a.label.startswith("recv tag 12") and a.count == 2  # leaving a wait is progress


def test_the_timeout_must_leave_room_for_late_beats():
    with pytest.raises(ConfigError, match="health.heartbeat_s=50 must be at most a third"):
        load_config(REPO / "configs/demo_cpu.yaml", ["health.heartbeat_s=50"])
    assert load_config(REPO / "configs/demo_cpu.yaml", ["health.stall_timeout_s=null"]).health.stall_timeout_s is None
