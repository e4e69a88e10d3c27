"""Each formula of yatt_hpc/algos computed by hand on small cases, and named after the peer option it equals.

    .venv/bin/python -m pytest tests/unit/test_algos.py -q
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from yatt_hpc.algos.advantages import estimate, grpo, rloo, signal_mask, whiten
from yatt_hpc.algos.aggregate import Totals, aggregate
from yatt_hpc.algos.kl import AdaptiveKL, kl_estimate
from yatt_hpc.algos.overlong import overlong_penalty
from yatt_hpc.algos.passk import pass_at_k
from yatt_hpc.algos.policy_loss import token_loss
from yatt_hpc.algos.schedule import learning_rate

# ------------------------------------------------------------------ advantages


def test_grpo_uses_the_sample_std_with_eps_outside_like_verl():
    # verl adv_estimator=grpo: mean 0.5, sample std sqrt(1/3) -> +-0.5 / (0.57735 + 1e-6)
    adv = grpo(np.array([1.0, 0.0, 0.0, 1.0]), np.zeros(4, int))
    assert adv == pytest.approx([0.5 / (math.sqrt(1 / 3) + 1e-6)] * 1 + [-0.5 / (math.sqrt(1 / 3) + 1e-6)] * 2
                                + [0.5 / (math.sqrt(1 / 3) + 1e-6)], rel=1e-6)


def test_grpo_population_std_is_larger_by_sqrt_g_over_g_minus_1():
    sample = grpo(np.array([1.0, 0.0, 0.0, 1.0]), np.zeros(4, int), eps=1e-12)
    population = grpo(np.array([1.0, 0.0, 0.0, 1.0]), np.zeros(4, int), eps=1e-12, std="population")
    assert population == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-6)
    assert population / sample == pytest.approx([math.sqrt(4 / 3)] * 4, rel=1e-6)


def test_grpo_group_of_two():
    # mean 0.5, sample std sqrt(0.5): +-0.7071
    assert grpo(np.array([1.0, 0.0]), np.zeros(2, int), eps=0.0) == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)])


def test_dr_grpo_drops_the_std():
    # verl norm_adv_by_std_in_grpo=False, TRL scale_rewards="none": r - mean
    assert grpo(np.array([1.0, 0.0, 0.0]), np.zeros(3, int), norm_by_std=False) == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_rloo_is_the_leave_one_out_baseline():
    # A_0 = 1 - mean(0, 0, 1) = 2/3 = G/(G-1) (r - mean) = 4/3 x 0.5
    assert rloo(np.array([1.0, 0.0, 0.0, 1.0]), np.zeros(4, int)) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_groups_without_signal_give_exactly_zero_and_are_counted(name):
    # a singleton group, a constant group of a non-dyadic reward (verl's float32 grpo: |A| up to 0.056), a live group
    rewards = np.array([0.3] + [0.7] * 7 + [1.0, 0.0], np.float32)
    groups = np.array([0] + [1] * 7 + [2, 2])
    adv = estimate(name, rewards, groups, np.full(10, 3))
    for i in range(8):
        assert np.all(adv.values[i] == 0.0), (name, i, adv.values[i])
    assert adv.no_signal == 8
    assert np.all(adv.values[8] > 0) and np.all(adv.values[9] < 0)
    assert signal_mask(rewards, groups).tolist() == [False] * 8 + [True, True]


def test_reinforce_plus_plus_whitens_token_returns_over_the_batch():
    # returns: sample 0 (len 2) [1, 1], sample 1 (len 1) [0]; mean 2/3, unbiased var 1/3 (verl masked_whiten)
    adv = estimate("reinforce_plus_plus", np.array([1.0, 0.0]), np.array([0, 1]), np.array([2, 1]))
    scale = 1 / math.sqrt(1 / 3 + 1e-8)
    assert np.concatenate(adv.values) == pytest.approx([scale / 3, scale / 3, -2 * scale / 3], rel=1e-6)
    assert adv.no_signal == 0  # groups do not matter to it: each sample is compared with the batch


def test_reinforce_plus_plus_discounts_returns_with_per_token_penalties():
    # token rewards [-0.1, 1 - 0.2]: G_1 = 0.8, G_0 = -0.1 + 0.5 x 0.8 = 0.3; then whitened (two tokens)
    adv = estimate("reinforce_plus_plus", np.array([1.0]), np.array([0]), np.array([2]),
                   token_penalties=[np.array([0.1, 0.2])], gamma=0.5)
    mean, var = 0.55, (0.25 ** 2 * 2) / 1
    assert adv.values[0] == pytest.approx([(0.3 - mean) / math.sqrt(var + 1e-8), (0.8 - mean) / math.sqrt(var + 1e-8)])


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens_what_carries_signal():
    # group 0: [1, 0] (lens 1, 2) -> tokens [0.5], [-0.5, -0.5]; group 1 constant -> 0 and out of the moments
    adv = estimate("reinforce_plus_plus_baseline", np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1]),
                   np.array([1, 2, 1, 1]))
    # mean -1/6, deviations [2/3, -1/3, -1/3], unbiased var 1/3
    scale = 1 / math.sqrt(1 / 3 + 1e-8)
    assert np.concatenate(adv.values[:2]) == pytest.approx([2 * scale / 3, -scale / 3, -scale / 3], rel=1e-6)
    assert adv.values[2].tolist() == [0.0] and adv.values[3].tolist() == [0.0]


def test_whitening_an_all_equal_batch_gives_zero_not_noise():
    out = whiten([np.full(3, 0.7), np.full(2, 0.7)], np.array([True, True]))
    assert all(np.all(v == 0.0) for v in out)


def test_kl_in_the_reward_is_summed_over_the_sequence_for_group_estimators():
    # verl: token_level_rewards.sum(-1) -> scores; r' = [1 - 0.3, 0 - 0.1]
    adv = estimate("grpo", np.array([1.0, 0.0]), np.zeros(2, int), np.array([2, 1]),
                   token_penalties=[np.array([0.1, 0.2]), np.array([0.1])], norm_by_std=False)
    assert adv.values[0] == pytest.approx([0.4, 0.4]) and adv.values[1] == pytest.approx([-0.4])


def test_gae_is_refused_without_a_critic():
    with pytest.raises(ValueError, match="critic"):
        estimate("gae", np.array([1.0]), np.array([0]), np.array([1]))


# ------------------------------------------------------------------ policy losses


def _one(logp: float, old: float, adv: float, mode: str = "vanilla", **kw):
    lp = torch.tensor([[logp]], requires_grad=True)
    loss, hit = token_loss(mode, lp, torch.tensor([[old]]), torch.tensor([[adv]]), torch.ones(1, 1),
                           clip_low=kw.pop("clip_low", 0.2), clip_high=kw.pop("clip_high", 0.28), **kw)
    loss.sum().backward()
    return float(loss.detach()), bool(hit), float(lp.grad)


def test_vanilla_clips_the_ratio_above_for_positive_advantages():
    # verl loss_mode=vanilla: rho 1.5 > 1.28 -> -A x 1.28, no gradient
    loss, hit, grad = _one(math.log(1.5), 0.0, 1.0)
    assert (loss, hit, grad) == (pytest.approx(-1.28), True, 0.0)


def test_vanilla_clips_the_ratio_below_for_negative_advantages():
    loss, hit, grad = _one(math.log(0.5), 0.0, -1.0)
    assert (loss, hit, grad) == (pytest.approx(0.8), True, 0.0)
    loss, hit, grad = _one(math.log(1.1), 0.0, 1.0)  # inside the interval: -A rho, gradient -A rho
    assert (loss, hit, grad) == (pytest.approx(-1.1), False, pytest.approx(-1.1))


def test_dual_clip_caps_a_negative_advantages_loss_at_c():
    # verl clip_ratio_c=3: rho 4, A -1: max(4, 1.28) = 4 -> capped at 3, no gradient
    assert _one(math.log(4.0), 0.0, -1.0)[:2] == (pytest.approx(4.0), False)
    loss, hit, grad = _one(math.log(4.0), 0.0, -1.0, clip_ratio_c=3.0)
    assert (loss, hit, grad) == (pytest.approx(3.0), True, 0.0)
    assert _one(math.log(4.0), 0.0, 1.0, clip_ratio_c=3.0)[0] == pytest.approx(-1.28)  # positive A: untouched


def test_gspo_gives_every_token_the_sequence_ratio_and_its_own_gradient():
    # verl loss_mode=gspo, TRL importance_sampling_level="sequence": log s = mean(0.1, 0.3) = 0.2
    logp = torch.tensor([[0.1, 0.3, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, hit = token_loss("gspo", logp, torch.zeros(1, 3), torch.ones(1, 3), mask, clip_low=0.2, clip_high=0.28)
    (loss * mask).sum().backward()
    s = math.exp(0.2)
    assert loss[0, :2].tolist() == pytest.approx([-s, -s]) and not hit[0, :2].any()
    assert logp.grad[0, :2].tolist() == pytest.approx([-s, -s])  # d(sg(s) pi/sg(pi))/d log pi = s
    clipped, hit = token_loss("gspo", logp.detach(), torch.full((1, 3), -1.0), torch.ones(1, 3), mask,
                              clip_low=0.2, clip_high=0.28)
    assert clipped[0, :2].tolist() == pytest.approx([-1.28, -1.28]) and hit[0, :2].all()


def test_cispo_detaches_the_clipped_weight_and_keeps_every_gradient():
    # verl loss_mode=cispo: rho = e^0.5 = 1.65 -> weight 1.28 (detached); loss -A w log pi, gradient -A w
    loss, hit, grad = _one(0.5, 0.0, 2.0, mode="cispo")
    assert (loss, hit, grad) == (pytest.approx(-2 * 1.28 * 0.5), True, pytest.approx(-2 * 1.28))
    loss, hit, grad = _one(0.1, 0.0, 2.0, mode="cispo")
    assert (hit, grad) == (False, pytest.approx(-2 * math.exp(0.1)))


# ------------------------------------------------------------------ aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 10 / 4),                   # verl token-mean, TRL dapo
    ("seq-mean-token-mean", (6 / 3 + 4) / 2),  # TRL grpo
    ("seq-mean-token-sum", 10 / 2),
    ("seq-mean-token-sum-norm", 10 / (2 * 4)),  # TRL dr_grpo, L = 4
])
def test_aggregations_by_hand_and_split_in_any_way(mode, expected):
    totals = Totals(tokens=4, sequences=2)
    assert float(aggregate(LOSS, MASK, mode, totals, norm_len=4)) == pytest.approx(expected)
    # one sequence per micro-batch (or rank), each divided by the global counts: the shares add up exactly
    parts = sum(float(aggregate(LOSS[i:i + 1], MASK[i:i + 1], mode, totals, norm_len=4)) for i in range(2))
    assert parts == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_an_all_masked_batch_is_a_zero_loss_with_a_zero_gradient(mode):
    loss_tok = torch.ones(2, 3, requires_grad=True)
    loss = aggregate(loss_tok, torch.zeros(2, 3), mode, Totals(tokens=0, sequences=0), norm_len=4)
    loss.backward()
    assert float(loss) == 0.0 and torch.equal(loss_tok.grad, torch.zeros(2, 3))


# ------------------------------------------------------------------ KL


def test_kl_estimators_by_hand():
    logp = torch.tensor([0.5], requires_grad=True)
    values = {}
    for kind in ("k1", "k2", "k3", "k3+"):
        logp.grad = None
        kl = kl_estimate(kind, logp, torch.zeros(1))
        kl.sum().backward()
        values[kind] = (float(kl), float(logp.grad))
    assert values["k1"] == (pytest.approx(0.5), pytest.approx(1.0))          # verl kl / k1
    assert values["k2"] == (pytest.approx(0.125), pytest.approx(0.5))        # verl mse / k2
    k3 = math.exp(-0.5) + 0.5 - 1
    assert values["k3"] == (pytest.approx(k3), pytest.approx(1 - math.exp(-0.5)))  # verl low_var_kl
    assert values["k3+"] == (pytest.approx(k3), pytest.approx(0.5))         # verl k3+: k3's value, k2's gradient


def test_k3_is_clamped_like_verls_low_var_kl():
    assert float(kl_estimate("k3", torch.tensor([-30.0]), torch.zeros(1))) == 10.0


def test_adaptive_kl_moves_toward_the_target_at_most_20_percent_of_n_over_horizon():
    ctl = AdaptiveKL(coef=0.1, target=0.01, horizon=100)
    assert ctl.update(0.02, 10) == pytest.approx(0.1 * 1.02)     # error clipped to +0.2
    assert ctl.update(0.011, 10) == pytest.approx(0.1 * 1.02 * 1.01)
    assert AdaptiveKL(0.1, 0.01, 100).update(0.005, 10) == pytest.approx(0.098)


# ------------------------------------------------------------------ schedule, overlong, pass@k


def test_lr_warmup_then_cosine_and_linear_decay_to_the_floor():
    lr = [learning_rate(s, base=1.0, warmup_steps=4, decay="cosine", decay_steps=12, min_lr=0.1) for s in range(14)]
    assert lr[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr[8] == pytest.approx(0.55) and lr[12] == pytest.approx(0.1) and lr[13] == pytest.approx(0.1)
    assert learning_rate(6, base=1.0, warmup_steps=4, decay="linear", decay_steps=12, min_lr=0.1) == pytest.approx(0.775)
    assert learning_rate(100, base=2.0, warmup_steps=4) == 2.0


def test_overlong_penalty_ramps_over_the_buffer():
    # verl overlong_buffer {len: 5, penalty_factor: 1}, max 20: 15 -> 0, 16 -> -0.2, 20 -> -1
    assert overlong_penalty(np.array([3, 15, 16, 20]), max_len=20, buffer_len=5, factor=1.0).tolist() == \
        pytest.approx([0.0, 0.0, -0.2, -1.0])


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)         # 1 - C(3,2)/C(4,2)
    assert pass_at_k(8, 3, 4) == pytest.approx(1 - 5 / 70)        # 1 - C(5,4)/C(8,4)
    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 5, 4) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)             # pass@1 is the accuracy
    with pytest.raises(ValueError, match="k=9"):
        pass_at_k(8, 3, 9)
