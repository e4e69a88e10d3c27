"""GRPO math against hand-computed values."""
import math

import numpy as np
import pytest
import torch

from yatt_hpc.train.grpo import group_advantages, k3_kl, policy_loss


def test_group_advantages_normalize_within_each_group():
    rewards = np.array([1.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    groups = np.array([7, 7, 7, 7, 9, 9])
    adv = group_advantages(rewards, groups, eps=0.0)
    # group 7: mean 0.5, population std 0.5 -> +1 / -1 ; group 9: zero variance -> 0
    np.testing.assert_allclose(adv, [1, -1, 1, -1, 0, 0], atol=1e-6)


def test_group_advantages_hand_computed_uneven_group():
    adv = group_advantages(np.array([1.0, 0.0, 0.0]), np.array([0, 0, 0]), eps=0.0)
    mean, std = 1 / 3, math.sqrt(2 / 9)
    np.testing.assert_allclose(adv, [(1 - mean) / std, -mean / std, -mean / std], rtol=1e-6)


def test_k3_kl_values():
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.25)])
    # delta = ref - logp = [-log 2, 0]: exp(-log2) - (-log2) - 1 = 0.5 + log 2 - 1
    torch.testing.assert_close(k3_kl(logp, ref), torch.tensor([0.5 + math.log(2) - 1, 0.0]))


@pytest.mark.parametrize("ratio, adv, expected", [
    pytest.param(1.5, 1.0, -1.28, id="pos-adv-clipped-high"),
    pytest.param(0.5, 1.0, -0.5, id="pos-adv-below-range-unclipped"),
    pytest.param(0.5, -1.0, 0.8, id="neg-adv-clipped-low"),
    pytest.param(1.5, -1.0, 1.5, id="neg-adv-above-range-unclipped"),
    pytest.param(1.1, 2.0, -2.2, id="inside-range"),
])
def test_clipped_loss_per_token(ratio, adv, expected):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio), requires_grad=True)
    loss, stats = policy_loss(logp, old, torch.full((1, 1), adv), torch.ones(1, 1),
                              clip_low=0.2, clip_high=0.28, token_count=1.0)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    clipped = expected in (-1.28, 0.8)
    # a clipped token contributes no gradient
    assert (logp.grad.abs().item() == 0.0) == clipped
    assert stats.clip_frac == (1.0 if clipped else 0.0)


def test_token_mean_uses_global_token_count_and_mask():
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = policy_loss(logp, torch.zeros(2, 3), adv, mask, clip_low=0.2, clip_high=0.2, token_count=6.0)
    # ratio 1 everywhere: per-token -adv; masked sum = -1 -1 +2 = 0 ... over 6 global tokens
    assert loss.item() == pytest.approx(0.0)
    assert stats.tokens == 3.0
    loss2, _ = policy_loss(logp, torch.zeros(2, 3), torch.ones(2, 3), mask, clip_low=0.2, clip_high=0.2, token_count=6.0)
    assert loss2.item() == pytest.approx(-3 / 6)


def test_kl_and_entropy_terms_enter_the_loss():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    ent = torch.tensor([[0.7]])
    loss, stats = policy_loss(logp, logp, torch.zeros(1, 1), torch.ones(1, 1), clip_low=0.2, clip_high=0.2,
                              token_count=1.0, ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01)
    kl = 0.5 + math.log(2) - 1
    assert loss.item() == pytest.approx(0.1 * kl - 0.01 * 0.7, abs=1e-6)
    assert stats.kl == pytest.approx(kl, abs=1e-6) and stats.entropy == pytest.approx(0.7)
