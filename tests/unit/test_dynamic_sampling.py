"""Dynamic sampling state machine: wave sizes, EMA, padding, state roundtrip (hand-computed)."""
import math

from yatt_hpc.sched.dynamic_sampling import DynamicSampler, has_signal


def test_valid_group_needs_reward_variance():
    assert has_signal([0, 1, 0]) and not has_signal([1, 1, 1]) and not has_signal([0.5, 0.5])


def test_refill_waves_follow_gap_times_ema_times_oversampling():
    ds = DynamicSampler(target_groups=16, oversampling=1.2, ema_expansion=2.0, max_waves=3)
    assert ds.first_wave() == 16
    ds.observe(total=16, valid=6)                 # gap 10
    assert ds.next_wave() == math.ceil(10 * 2.0 * 1.2) == 24
    ds.observe(total=24, valid=9)                 # gap 1
    assert ds.next_wave() == math.ceil(1 * 2.0 * 1.2) == 3
    ds.observe(total=3, valid=1)                  # target met
    assert ds.next_wave() == 0 and ds.padded_groups() == 0 and ds.waves == 2


def test_waves_are_bounded_then_padded():
    ds = DynamicSampler(target_groups=8, max_waves=2)
    ds.first_wave()
    ds.observe(8, 1)
    assert ds.next_wave() > 0
    ds.observe(9, 1)
    assert ds.next_wave() > 0
    ds.observe(9, 1)
    assert ds.next_wave() == 0
    assert ds.padded_groups() == 5


def test_ema_update_decay_and_cap():
    ds = DynamicSampler(target_groups=4, ema_decay=0.9, ema_cap=10.0)
    ds.end_step(3.0)
    assert abs(ds.ema_expansion - (0.9 * 1.0 + 0.1 * 3.0)) < 1e-12
    for _ in range(500):
        ds.end_step(50.0)
    assert ds.ema_expansion == 10.0
    ds.first_wave()
    ds.observe(4, 0)
    assert ds.step_expansion() == 10.0


def test_state_roundtrip():
    a = DynamicSampler(target_groups=4)
    a.end_step(4.0)
    b = DynamicSampler(target_groups=4)
    b.load_state(a.state())
    assert b.ema_expansion == a.ema_expansion
