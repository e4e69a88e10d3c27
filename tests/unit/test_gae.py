"""GAE, the clipped value loss and explained variance (`yatt_hpc/algos/gae.py`): by hand, and against the peers'
formula (verl `compute_gae_advantage_return` + `masked_whiten`, which TRL's PPOTrainer computes the same way) on
padded rows.

    .venv/bin/python -m pytest tests/unit/test_gae.py -q
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.batches import random_update_batch
from yatt_hpc.algos.gae import (
    estimate_gae,
    explained_variance,
    gae_one,
    turn_spans,
    value_loss,
    value_positions,
    value_sums,
)
from yatt_hpc.config.schema import TrainConfig
from yatt_hpc.train.step_plan import critic_lr, step_gae


def test_gae_of_one_response_by_hand():
    # reward 1 on the last of 3 tokens, V = (0.5, 0.2, 0.6), gamma 0.9, lambda 0.8 (gamma lambda = 0.72)
    adv, ret = gae_one(np.array([0.0, 0.0, 1.0]), np.array([0.5, 0.2, 0.6]), gamma=0.9, lam=0.8)
    # t=2: delta = 1 - 0.6 = 0.4                        A = 0.4
    # t=1: delta = 0.9 * 0.6 - 0.2 = 0.34               A = 0.34 + 0.72 * 0.4 = 0.628
    # t=0: delta = 0.9 * 0.2 - 0.5 = -0.32              A = -0.32 + 0.72 * 0.628 = 0.13216
    np.testing.assert_allclose(adv, [0.13216, 0.628, 0.4], atol=1e-12)
    np.testing.assert_allclose(ret, [0.63216, 0.828, 1.0], atol=1e-12)


def test_per_token_penalties_are_token_rewards_and_the_reward_sits_on_the_last_token():
    # KL in the reward: r = (-0.1, 0, 1 - 0.2)
    gae = estimate_gae(np.array([1.0]), [np.array([0.5, 0.2, 0.6])], gamma=0.9, lam=0.8,
                       token_penalties=[np.array([0.1, 0.0, 0.2])], whiten_advantages=False)
    # t=2: 0.8 - 0.6 = 0.2; t=1: 0.34 + 0.72 * 0.2 = 0.484; t=0: -0.1 + 0.18 - 0.5 + 0.72 * 0.484 = -0.07152
    np.testing.assert_allclose(gae.advantages[0], [-0.07152, 0.484, 0.2], atol=1e-6)
    np.testing.assert_allclose(gae.returns[0], [0.42848, 0.684, 0.8], atol=1e-6)


def test_gamma_and_lambda_one_give_the_return_less_the_value():
    values = [np.array([0.1, 0.4, -0.3, 0.9])]
    gae = estimate_gae(np.array([2.0]), values, gamma=1.0, lam=1.0, whiten_advantages=False)
    np.testing.assert_allclose(gae.advantages[0], 2.0 - values[0], atol=1e-6)
    np.testing.assert_allclose(gae.returns[0], [2.0] * 4, atol=1e-6)


def _verl_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """verl's `compute_gae_advantage_return` (core_algos.py) as written there for right-padded rows: the
    recursion over the padded width with the mask carrying values and advantages past the padding, then
    `masked_whiten` (masked mean, unbiased masked variance, (x - mean) * rsqrt(var + 1e-8))."""
    width = token_rewards.shape[1]
    last, next_values, out = torch.zeros(len(values), dtype=torch.float64), torch.zeros(len(values), dtype=torch.float64), []
    for t in reversed(range(width)):
        delta = token_rewards[:, t] + gamma * next_values - values[:, t]
        new_last = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = new_last * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    returns = adv + values
    mean = (adv * mask).sum() / mask.sum()
    var = ((adv - mean) ** 2 * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (adv - mean) * torch.rsqrt(var + 1e-8) * mask, returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_equals_verls_padded_formula(gamma, lam):
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 9, 12)
    rewards = rng.random(12)
    values = [rng.normal(size=n) for n in lens]
    penalties = [0.05 * rng.random(n) for n in lens]
    ours = estimate_gae(rewards, values, gamma=gamma, lam=lam, token_penalties=penalties)
    width = int(lens.max())
    tok, val, mask = (torch.zeros(12, width, dtype=torch.float64) for _ in range(3))
    for i, n in enumerate(lens):
        tok[i, :n] = -torch.from_numpy(penalties[i])
        tok[i, n - 1] += rewards[i]
        val[i, :n] = torch.from_numpy(values[i])
        val[i, n:] = -0.47  # verl leaves the critic's output on padded positions; the mask must keep it out
        mask[i, :n] = 1.0
    adv, ret = _verl_gae(tok, val, mask, gamma, lam)
    for i, n in enumerate(lens):
        np.testing.assert_allclose(ours.advantages[i], adv[i, :n].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours.returns[i], ret[i, :n].numpy(), rtol=1e-5, atol=1e-6)


def test_multi_turn_gae_skips_the_tokens_the_model_did_not_sample():
    # model, tool result, tool result, model: the recursion sees two tokens, V = (0.5, 0.6), reward 1 on the last
    values = np.array([0.5, 9.0, -9.0, 0.6])  # the tool tokens' values must not enter anything
    sampled = np.array([1, 0, 0, 1])
    adv, ret = gae_one(np.array([0.0, 0.0, 0.0, 1.0]), values, gamma=0.9, lam=0.8, sampled=sampled)
    # t=3: delta = 1 - 0.6 = 0.4                        A = 0.4
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04               A = 0.04 + 0.72 * 0.4 = 0.328
    np.testing.assert_allclose(adv, [0.328, 0.0, 0.0, 0.4], atol=1e-12)
    np.testing.assert_allclose(ret, [0.828, 9.0, -9.0, 1.0], atol=1e-12)  # skipped tokens: R = V, no error
    compressed, _ = gae_one(np.array([0.0, 1.0]), np.array([0.5, 0.6]), gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv[sampled > 0], compressed, atol=1e-12)


def test_a_trajectory_cut_after_a_tool_result_rewards_the_model_s_last_token():
    gae = estimate_gae(np.array([1.0]), [np.array([0.5, 0.6, 0.1, 0.2])], gamma=1.0, lam=1.0,
                       whiten_advantages=False, sampled=[np.array([1, 1, 0, 0])])
    np.testing.assert_allclose(gae.advantages[0], [0.5, 0.4, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5)])
def test_multi_turn_gae_equals_verls_masked_recursion(gamma, lam):
    """verl's recursion carries `nextvalues` and `lastgaelam` over masked positions; with the response mask as its
    mask (tool results 0, the last token the model's) it is our multi-turn GAE, whitening over the model's tokens."""
    rng = np.random.default_rng(11)
    lens = rng.integers(2, 10, 12)
    rewards = rng.random(12)
    values = [rng.normal(size=n) for n in lens]
    sampled = [np.r_[rng.integers(0, 2, n - 1), 1] for n in lens]
    for m in sampled:
        m[0] = 1
    ours = estimate_gae(rewards, values, gamma=gamma, lam=lam, sampled=sampled)
    width = int(lens.max())
    tok, val, mask = (torch.zeros(12, width, dtype=torch.float64) for _ in range(3))
    for i, n in enumerate(lens):
        tok[i, n - 1] = rewards[i]
        val[i, :n] = torch.from_numpy(values[i])
        mask[i, :n] = torch.from_numpy(sampled[i].astype(np.float64))
    adv, ret = _verl_gae(tok, val, mask, gamma, lam)
    for i, n in enumerate(lens):
        m = sampled[i] > 0
        np.testing.assert_allclose(ours.advantages[i][m], adv[i, :n].numpy()[m], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours.returns[i][m], ret[i, :n].numpy()[m], rtol=1e-5, atol=1e-6)
        assert not ours.advantages[i][~m].any()


def test_turn_level_gae_by_hand():
    # turns: tokens 0-1, tool result 2-3, tokens 4-6; V at the turns' first tokens 0.5 and 0.6
    values = np.array([0.5, 7.0, 9.0, -9.0, 0.6, 3.0, 4.0])
    sampled = np.array([1, 1, 0, 0, 1, 1, 1])
    assert turn_spans(sampled) == [(0, 2), (4, 7)]
    assert value_positions(sampled, "turn").tolist() == [True, False, False, False, True, False, False]
    assert value_positions(sampled, "token").tolist() == (sampled > 0).tolist()
    # penalties 0.1 on token 1 and 0.05 on token 5, reward 1: turn rewards (-0.1, 0.95); gamma 0.9, lambda 0.8
    gae = estimate_gae(np.array([1.0]), [values], gamma=0.9, lam=0.8, whiten_advantages=False,
                       token_penalties=[np.array([0, 0.1, 0, 0, 0, 0.05, 0])], sampled=[sampled], level="turn")
    # turn 1: delta = 0.95 - 0.6 = 0.35                   A = 0.35
    # turn 0: delta = -0.1 + 0.9 * 0.6 - 0.5 = -0.06      A = -0.06 + 0.72 * 0.35 = 0.192
    np.testing.assert_allclose(gae.advantages[0], [0.192, 0.192, 0, 0, 0.35, 0.35, 0.35], atol=1e-6)
    np.testing.assert_allclose(gae.returns[0], [0.692, 7.0, 9.0, -9.0, 0.95, 3.0, 4.0], atol=1e-6)


def test_a_single_turn_response_at_turn_level_is_one_action():
    gae = estimate_gae(np.array([1.0]), [np.array([0.25, 0.5, 0.75])], gamma=0.9, lam=0.8, whiten_advantages=False,
                       level="turn")
    np.testing.assert_allclose(gae.advantages[0], [0.75] * 3, atol=1e-6)  # R - V at the first token
    np.testing.assert_allclose(gae.returns[0], [1.0, 0.5, 0.75], atol=1e-6)


def test_value_sums_count_the_model_s_tokens_only():
    values, returns = [np.array([1.0, 5.0, 2.0])], [np.array([1.5, -5.0, 2.5])]
    sums = value_sums(values, returns, [np.array([1, 0, 1])])
    np.testing.assert_allclose(sums, [2, 3.0, 4.0, 1.5 ** 2 + 2.5 ** 2, 1.0, 0.5])


def test_whitening_is_over_the_global_batch_however_it_is_split():
    rng = np.random.default_rng(3)
    lens = rng.integers(1, 7, 10)
    rewards, values = rng.random(10), [rng.normal(size=n) for n in lens]
    whole = estimate_gae(rewards, values, gamma=1.0, lam=0.9)
    # two replicas in lockstep, each `reduce` the sum of both (as the trainer's sum over replicas)
    parts, barrier, slots, out = [slice(0, 4), slice(4, 10)], threading.Barrier(2), [None, None], [None, None]

    def replica(k):
        def reduce(x):
            slots[k] = x
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        out[k] = estimate_gae(rewards[parts[k]], values[parts[k]], gamma=1.0, lam=0.9, reduce=reduce)

    threads = [threading.Thread(target=replica, args=(k,)) for k in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    split = out[0].advantages + out[1].advantages
    np.testing.assert_allclose(np.concatenate(split), np.concatenate(whole.advantages), atol=1e-6)


def test_the_value_loss_by_hand_and_its_clip():
    v_new, v_old = torch.tensor([1.0, 1.0, 0.3]), torch.tensor([0.5, 0.5, 0.5])
    returns = torch.tensor([2.0, 0.0, 0.4])
    loss, clipped = value_loss(v_new, v_old, returns, clip=0.2)
    # 1: plain (1 - 2)^2 = 1, clipped V = 0.7: (0.7 - 2)^2 = 1.69 -> 0.845, clipped
    # 2: plain 1, clipped (0.7 - 0)^2 = 0.49 -> 0.5, not clipped
    # 3: within the clip: (0.3 - 0.4)^2 / 2 = 0.005
    torch.testing.assert_close(loss, torch.tensor([0.845, 0.5, 0.005]))
    assert clipped.tolist() == [True, False, False]
    plain, none = value_loss(v_new, v_old, returns, clip=None)
    torch.testing.assert_close(plain, torch.tensor([0.5, 0.5, 0.005]))
    assert not none.any()


def test_explained_variance_of_a_perfect_a_constant_and_a_noisy_critic():
    rng = np.random.default_rng(0)
    returns = [rng.normal(size=5), rng.normal(size=3)]
    assert explained_variance(value_sums(returns, returns)) == pytest.approx(1.0)
    mean = np.concatenate(returns).mean()
    assert explained_variance(value_sums([np.full(5, mean), np.full(3, mean)], returns)) == pytest.approx(0.0, abs=1e-12)
    noisy = [r + rng.normal(scale=0.5, size=r.shape) for r in returns]
    flat_r, flat_v = np.concatenate(returns), np.concatenate(noisy)
    assert explained_variance(value_sums(noisy, returns)) == pytest.approx(1 - np.var(flat_r - flat_v) / np.var(flat_r))
    # two replicas' sums add up to the whole batch's
    assert explained_variance(value_sums(noisy[:1], returns[:1]) + value_sums(noisy[1:], returns[1:])) == \
        pytest.approx(explained_variance(value_sums(noisy, returns)))


def test_the_train_config_chooses_gamma_lambda_and_whitening():
    batch, _ = random_update_batch(50, samples=6)
    values = [np.linspace(0, 1, n) for n in batch.response_len]
    plain = step_gae(batch, values, TrainConfig(adv_estimator="gae", critic={"whiten_advantages": False}))
    np.testing.assert_allclose(plain.advantages[0], batch.reward[0] - values[0], atol=1e-6)  # gamma = lambda = 1
    lam = step_gae(batch, values, TrainConfig(adv_estimator="gae", critic={"lam": 0.5, "whiten_advantages": False}))
    expected, _ = gae_one(np.r_[np.zeros(len(values[0]) - 1), batch.reward[0]], values[0], 1.0, 0.5)
    np.testing.assert_allclose(lam.advantages[0], expected, atol=1e-6)
    gamma = step_gae(batch, values, TrainConfig(adv_estimator="gae", gamma=0.9, critic={"whiten_advantages": False}))
    expected, _ = gae_one(np.r_[np.zeros(len(values[0]) - 1), batch.reward[0]], values[0], 0.9, 1.0)
    np.testing.assert_allclose(gamma.advantages[0], expected, atol=1e-6)
    white = np.concatenate(step_gae(batch, values, TrainConfig(adv_estimator="gae")).advantages)
    assert abs(white.mean()) < 1e-6 and white.std(ddof=1) == pytest.approx(1.0, abs=1e-4)


def test_the_train_config_chooses_the_gae_level():
    batch, _ = random_update_batch(50, samples=6)
    batch.response_mask = np.tile([1, 1, 0], batch.response_mask.size)[:batch.response_mask.size].astype(np.uint8)
    values = [np.linspace(0, 1, n) for n in batch.response_len]
    token = step_gae(batch, values, TrainConfig(adv_estimator="gae", critic={"whiten_advantages": False}))
    turn = step_gae(batch, values, TrainConfig(adv_estimator="gae", critic={"whiten_advantages": False,
                                                                            "level": "turn"}))
    masks = batch.ragged("response_mask")
    for i, m in enumerate(masks):
        spans = turn_spans(m)
        expected = estimate_gae(batch.reward[i:i + 1], [values[i]], gamma=1.0, lam=1.0, whiten_advantages=False,
                                sampled=[m], level="turn").advantages[0]
        np.testing.assert_allclose(turn.advantages[i], expected, atol=1e-6)
        for a, b in spans:  # one advantage per turn at turn level, per token at token level
            assert len(set(turn.advantages[i][a:b].tolist())) == 1
    assert any(len(set(t[a:b].tolist())) > 1 for t, m in zip(token.advantages, masks) for a, b in turn_spans(m))


def test_the_critics_learning_rate_follows_its_own_schedule():
    cfg = TrainConfig(adv_estimator="gae", steps=10, lr=1.0, critic={
        "lr": 1e-3, "lr_warmup_steps": 2, "lr_decay": "linear", "lr_decay_steps": 6, "min_lr": 1e-4})
    rates = [critic_lr(s, cfg) for s in range(8)]
    assert rates[:2] == pytest.approx([5e-4, 1e-3])                   # warmup: lr (s + 1) / 2
    assert rates[2:7] == pytest.approx([1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4])  # linear from 2 to 6
    assert rates[7] == pytest.approx(1e-4)                             # the floor after decay_steps
    cosine = TrainConfig(adv_estimator="gae", steps=4, critic={"lr": 1e-3, "lr_decay": "cosine"})
    assert critic_lr(2, cosine) == pytest.approx(5e-4)                 # halfway through a decay to 0 over 4 steps


@pytest.mark.parametrize("sets, needles", [
    pytest.param({"critic": {"lam": 0.9}}, ["train.critic.lam=0.9", "adv_estimator=gae"], id="critic-without-gae"),
    pytest.param({"critic": {"value_clip": None}}, ["train.critic.value_clip=None"], id="clip-without-gae"),
    pytest.param({"adv_estimator": "gae", "critic": {"min_lr": 1e-6}}, ["train.critic.min_lr", "lr_decay"],
                 id="floor-without-decay"),
    pytest.param({"adv_estimator": "gae", "critic": {"lr_decay_steps": 5}}, ["train.critic.lr_decay_steps"],
                 id="decay-steps-without-decay"),
    pytest.param({"adv_estimator": "gae", "critic": {"lr": 1e-5, "min_lr": 1e-4, "lr_decay": "linear"}},
                 ["train.critic.min_lr", "above"], id="floor-above-peak"),
    pytest.param({"adv_estimator": "gae", "critic": {"adam_betas": (0.9, 1.0)}}, ["train.critic.adam_betas"],
                 id="beta-one"),
    pytest.param({"adv_estimator": "gae", "steps": 5, "critic": {"warmup_steps": 5}},
                 ["train.critic.warmup_steps=5", "never train"], id="warmup-covers-the-run"),
    pytest.param({"adv_estimator": "gae", "lora": {"rank": 8}}, ["train.lora.rank=8", "value model"],
                 id="lora"),
    pytest.param({"gamma": 0.9}, ["train.gamma=0.9", "gae"], id="gamma-with-grpo"),
])
def test_critic_settings_that_cannot_act_are_refused_at_load(sets, needles):
    with pytest.raises(ValueError) as err:
        TrainConfig(**sets)
    assert all(n in str(err.value) for n in needles), str(err.value)
