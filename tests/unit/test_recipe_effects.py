"""Each recipe setting of `train:` and `reward:` through the config: the advantage estimator and its options,
the loss mode and aggregation, the dual clip, the KL (estimator, in the reward, adaptive), overlong filtering
and shaping, mini-batches, the lr schedule and AdamW's betas and eps (tests/unit/test_algos.py holds the
formulas themselves to hand computations).

    .venv/bin/python -m pytest tests/unit/test_recipe_effects.py -q
"""
from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from tests.conftest import REPO
from yatt_hpc.batch import SampleBatch
from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.config.schema import TrainConfig
from yatt_hpc.train.step_plan import kl_controller, plan_update, reward_kl, step_advantages, step_lr, whole_batch_plan

DEMO = REPO / "models" / "demo"
needs_demo_models = pytest.mark.skipif(not (DEMO / "policy" / "model.safetensors").is_file(),
                                       reason="no models/demo; run .venv/bin/python tools/make_demo_models.py")


def _groups(rewards, groups, lens=None) -> SampleBatch:
    n = len(rewards)
    lens = np.full(n, 2) if lens is None else np.asarray(lens)
    return SampleBatch(sample_id=np.arange(n), prompt_id=np.asarray(groups, np.int64),
                       response_len=lens.astype(np.int32), reward=np.asarray(rewards, np.float32),
                       response_tokens=np.ones(int(lens.sum()), np.int32), logprobs=np.zeros(int(lens.sum()), np.float32))


# ------------------------------------------------------------------ advantages (train.adv_estimator and options)


def test_adv_estimator_and_its_options_choose_the_advantages():
    batch = _groups([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    sample_std = 0.5 / (math.sqrt(1 / 3) + 1e-6)

    def first(**train):
        return float(step_advantages(batch, TrainConfig(**train)).values[0][0])

    assert first() == pytest.approx(sample_std)                                   # grpo, sample std
    assert first(adv_std="population") == pytest.approx(0.5 / (0.5 + 1e-6))
    assert first(adv_eps=0.5) == pytest.approx(0.5 / (math.sqrt(1 / 3) + 0.5))
    assert first(norm_adv_by_std=False) == pytest.approx(0.5)                     # Dr.GRPO
    assert first(adv_estimator="rloo") == pytest.approx(2 / 3)
    # reinforce_plus_plus: returns [1, 1, 0, 0, 0, 0, 1, 1] whitened; gamma 0.5 discounts the first token
    rpp = step_advantages(batch, TrainConfig(adv_estimator="reinforce_plus_plus")).values[0]
    assert rpp[0] == pytest.approx(rpp[1]) and rpp[0] > 0
    discounted = step_advantages(batch, TrainConfig(adv_estimator="reinforce_plus_plus", gamma=0.5)).values[0]
    assert discounted[0] < discounted[1]
    baseline = step_advantages(_groups([1.0, 0.0, 5.0, 5.0], [0, 0, 1, 1]),
                               TrainConfig(adv_estimator="reinforce_plus_plus_baseline"))
    assert baseline.values[2].tolist() == [0.0, 0.0] and baseline.no_signal == 2


# ------------------------------------------------------------------ KL in the reward, the adaptive controller


def test_kl_in_reward_subtracts_coef_times_the_chosen_estimate_per_token():
    batch = _groups([1.0, 0.0], [0, 0], lens=[2, 1])
    batch.logprobs = np.array([-1.0, -2.0, -1.0], np.float32)
    ref = [np.array([-1.5, -2.0], np.float32), np.array([-0.5], np.float32)]
    cfg = TrainConfig(kl_coef=0.1, kl_in_reward=True, kl_estimator="k1")
    penalties, total = reward_kl(batch, ref, cfg, coef=0.1)
    assert np.concatenate(penalties) == pytest.approx([0.05, 0.0, -0.05]) and total == pytest.approx(0.0)
    k2, _ = reward_kl(batch, ref, TrainConfig(kl_coef=0.1, kl_in_reward=True, kl_estimator="k2"), coef=0.1)
    assert np.concatenate(k2) == pytest.approx([0.1 * 0.125, 0.0, 0.1 * 0.125])
    # Dr.GRPO on r - sum(penalties): [1 - 0.05, 0 + 0.05] -> +-0.45
    adv = step_advantages(batch, TrainConfig(kl_coef=0.1, kl_in_reward=True, norm_adv_by_std=False), penalties)
    assert adv.values[0] == pytest.approx([0.45, 0.45]) and adv.values[1] == pytest.approx([-0.45])


def test_kl_target_and_horizon_adapt_the_coefficient():
    fixed = kl_controller(TrainConfig(kl_coef=0.1))
    assert fixed.update(1.0, 100) == 0.1
    adaptive = kl_controller(TrainConfig(kl_coef=0.1, kl_target=0.01, kl_horizon=100))
    assert adaptive.update(0.02, 10) == pytest.approx(0.102)
    slow = kl_controller(TrainConfig(kl_coef=0.1, kl_target=0.01, kl_horizon=1000))
    assert slow.update(0.02, 10) == pytest.approx(0.1002)


# ------------------------------------------------------------------ lr schedule


def test_lr_warmup_decay_steps_and_floor_shape_the_rate_of_each_step():
    cfg = TrainConfig(lr=1.0, steps=20, lr_warmup_steps=4, lr_decay="cosine", lr_decay_steps=12, min_lr=0.1)
    assert [step_lr(s, cfg) for s in (0, 3, 8, 12, 19)] == pytest.approx([0.25, 1.0, 0.55, 0.1, 0.1])
    linear = TrainConfig(lr=1.0, steps=20, lr_decay="linear")  # decay_steps null: train.steps
    assert [step_lr(s, linear) for s in (0, 10, 20)] == pytest.approx([1.0, 0.5, 0.0])
    assert step_lr(7, TrainConfig(lr=0.3)) == 0.3


# ------------------------------------------------------------------ the plan: mini-batches, overlong filtering


def test_mini_batches_cut_the_global_groups_and_count_each_part():
    batch = _groups([1, 0, 1, 0, 1, 0], [5, 5, 9, 9, 7, 7], lens=[1, 2, 3, 4, 5, 6])
    plan = whole_batch_plan(batch, TrainConfig(prompts_per_step=3, mini_batches=2))
    assert [idx.tolist() for idx in plan.minibatches] == [[0, 1, 4, 5], [2, 3]]  # groups 5, 7 | 9
    assert [(t.tokens, t.sequences) for t in plan.totals] == [(14.0, 4.0), (7.0, 2.0)]
    # two replicas holding halves see the same global cut (what they hold does not decide it)
    halves = [batch.select(np.array([0, 1, 2, 3])), batch.select(np.array([4, 5]))]
    ids = [np.unique(h.prompt_id).tolist() for h in halves]
    local = [plan_update(h, TrainConfig(prompts_per_step=3, mini_batches=2), 1, gather=lambda _: ids[0] + ids[1],
                         reduce=lambda v: v) for h in halves]
    assert [idx.tolist() for idx in local[0].minibatches] == [[0, 1], [2, 3]]
    assert [idx.tolist() for idx in local[1].minibatches] == [[0, 1], []]


def test_mask_truncated_takes_length_cut_samples_out_of_the_loss_counts():
    batch = _groups([1, 0, 1, 0], [0, 0, 0, 0], lens=[1, 2, 3, 4])
    batch.finish = np.array([0, 1, 0, 1], np.int8)  # 1: cut at max_new_tokens
    kept = whole_batch_plan(batch, TrainConfig(mask_truncated=True))
    assert kept.keep.tolist() == [1, 0, 1, 0] and kept.truncated_masked == 2
    assert (kept.totals[0].tokens, kept.totals[0].sequences) == (4.0, 2.0)
    plain = whole_batch_plan(batch, TrainConfig())
    assert plain.truncated_masked == 0 and plain.totals[0].tokens == 10.0


# ------------------------------------------------------------------ the policy's update (demo model)


def _policy(**train):
    from yatt_hpc.train.policy import MegatronPolicy

    torch.manual_seed(0)
    return MegatronPolicy.from_hf(DEMO / "policy", 0, 1, TrainConfig(**train))


def _scored_batch(policy, shift, samples: int = 8) -> SampleBatch:
    """8 samples whose rollout logprobs are the current policy's plus `shift(token index)` (log rho = -shift)."""
    rng = np.random.default_rng(0)
    vocab = policy.hf_config.vocab_size
    plen, rlen = rng.integers(4, 8, samples), rng.integers(4, 9, samples)
    batch = SampleBatch(
        sample_id=np.arange(samples, dtype=np.int64), prompt_id=np.arange(samples, dtype=np.int64) // 4,
        prompt_len=plen.astype(np.int32), prompt_tokens=rng.integers(3, vocab, plen.sum()).astype(np.int32),
        response_len=rlen.astype(np.int32), response_tokens=rng.integers(3, vocab, rlen.sum()).astype(np.int32),
        logprobs=np.zeros(rlen.sum(), np.float32))
    current, _ = _scores(policy, batch)
    batch.logprobs = np.concatenate([c + np.array([shift(t) for t in range(len(c))], np.float32) for c in current])
    return batch


def _alternating(t: int) -> float:
    return 0.5 if t % 2 else -0.5  # token ratios e^-0.5, e^+0.5, ... whose mean log ratio is ~0


@needs_demo_models
def test_loss_mode_gspo_clips_whole_sequences_and_cispo_weights_every_token(one_rank_world):
    # vanilla, A = +1: the tokens with rho = e^0.5 > 1.28 are clipped; rho = e^-0.5 is not (A > 0)
    # gspo: each sequence's ratio is exp(mean log rho), inside the interval for these (nearly) balanced sequences
    # cispo: every weight is clipped (e^0.5 above 1.28, e^-0.5 below 0.8)
    got = {}
    for mode in ("vanilla", "gspo", "cispo"):
        policy = _policy(kl_coef=1e-9, loss_mode=mode)
        batch = _scored_batch(policy, _alternating)
        stats = policy.update(batch, np.ones(len(batch), np.float32))
        got[mode] = stats.clip_frac / stats.tokens
    odd = sum(n // 2 for n in batch.response_len) / batch.response_len.sum()
    assert got["vanilla"] == pytest.approx(1 - odd)  # the even tokens: log rho = +0.5
    assert got["gspo"] < got["vanilla"]
    assert got["cispo"] == 1.0


@needs_demo_models
@pytest.mark.parametrize("c, clipped", [pytest.param(None, False, id="off"), pytest.param(3.0, True, id="c3")])
def test_clip_ratio_c_caps_negative_advantages_far_above_the_ratio(one_rank_world, c, clipped):
    policy = _policy(kl_coef=1e-9, clip_ratio_c=c)
    batch = _scored_batch(policy, lambda t: -2.0)  # rho = e^2 = 7.4: beyond the dual clip's 3
    stats = policy.update(batch, -np.ones(len(batch), np.float32))
    assert stats.clip_frac == (stats.tokens if clipped else 0.0)


@needs_demo_models
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_loss_agg_mode_is_the_normaliser_of_the_loss(one_rank_world, mode):
    # zero advantages: the loss is -entropy_coef x the aggregated entropy
    policy = _policy(entropy_coef=0.1, loss_agg_mode=mode)
    batch = _scored_batch(policy, lambda t: 0.0)
    plan = whole_batch_plan(batch, policy.cfg, norm_len=16)
    _, ent = _scores(policy, batch)
    stats = policy.update(batch, np.zeros(len(batch), np.float32), plan)
    n, b = float(batch.response_len.sum()), len(batch)
    expected = {"token-mean": sum(e.sum() for e in ent) / n, "seq-mean-token-mean": sum(e.mean() for e in ent) / b,
                "seq-mean-token-sum": sum(e.sum() for e in ent) / b,
                "seq-mean-token-sum-norm": sum(e.sum() for e in ent) / (b * 16)}[mode]
    assert stats.loss == pytest.approx(-0.1 * expected, rel=1e-4)


def _scores(policy, batch) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each sample's per-token log-probabilities and entropies under the policy as it is now."""
    from yatt_hpc.train import megatron_model
    from yatt_hpc.train.logprobs import token_logprobs_and_entropy
    from yatt_hpc.train.step_plan import pack_micro_batch

    tokens, _, _ = pack_micro_batch(batch)
    with torch.no_grad():
        logits = megatron_model.forward_logits(policy.model, tokens[:, :-1])
        logp, ent = token_logprobs_and_entropy(logits, tokens[:, 1:], policy.tp_group, policy.vocab_size, 1.0)
    spans = [(p - 1, p - 1 + n) for p, n in zip(batch.prompt_len, batch.response_len)]
    return [logp[i, a:b].numpy() for i, (a, b) in enumerate(spans)], [ent[i, a:b].numpy() for i, (a, b) in enumerate(spans)]


@needs_demo_models
def test_kl_estimator_decides_the_kl_term(one_rank_world):
    kls = {}
    for kind in ("k1", "k2", "k3"):
        policy = _policy(kl_coef=0.5, kl_estimator=kind, epochs=2, lr=1e-2)
        stats = policy.update(_scored_batch(policy, lambda t: 0.0), np.full(8, 1.0, np.float32))
        kls[kind] = stats.kl
    assert kls["k2"] > 0 and kls["k3"] > 0  # never negative per token
    assert len({round(v, 3) for v in kls.values()}) == 3, kls  # the second pass scores a moved policy three ways


@needs_demo_models
def test_kl_in_reward_leaves_the_loss_without_a_kl_term(one_rank_world):
    policy = _policy(kl_coef=0.5, kl_in_reward=True, epochs=2, lr=1e-2)
    stats = policy.update(_scored_batch(policy, lambda t: 0.0), np.full(8, 1.0, np.float32))
    assert policy.reference is not None and stats.kl == 0.0


@needs_demo_models
@pytest.mark.parametrize("mini_batches, epochs", [(1, 1), (2, 1), (2, 2)])
def test_mini_batches_and_epochs_are_the_optimizer_steps(one_rank_world, mini_batches, epochs):
    policy = _policy(mini_batches=mini_batches, epochs=epochs, prompts_per_step=2)
    stats = policy.update(_scored_batch(policy, lambda t: 0.0), np.tile([1.0, -1.0], 4).astype(np.float32))
    assert stats.optimizer_steps == mini_batches * epochs
    assert {int(s["step"]) for s in policy.optimizer.state.values()} == {mini_batches * epochs}


@needs_demo_models
def test_mask_truncated_samples_carry_no_gradient(one_rank_world):
    policy = _policy(mask_truncated=True, lr=1e-2)
    batch = _scored_batch(policy, lambda t: 0.0)
    batch.finish = np.ones(len(batch), np.int8)  # every sample cut at the cap: nothing left to train on
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    stats = policy.update(batch, np.tile([1.0, -1.0], 4).astype(np.float32))
    assert stats.tokens == 0 and stats.grad_norm == 0.0 and math.isfinite(stats.loss)
    assert all(torch.equal(p.detach(), before[n]) for n, p in policy.model.named_parameters())


@needs_demo_models
def test_adam_betas_and_eps_reach_the_optimizer(one_rank_world):
    policy = _policy(adam_betas=(0.5, 0.9), adam_eps=10.0, lr=1e-2)
    assert policy.optimizer.param_groups[0]["betas"] == (0.5, 0.9) and policy.optimizer.param_groups[0]["eps"] == 10.0
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy.update(_scored_batch(policy, lambda t: 0.0), np.tile([1.0, -1.0], 4).astype(np.float32))
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in policy.model.named_parameters())
    assert moved < 1e-2 / 5  # eps 10 dwarfs sqrt(v): the step is far below lr (eps 1e-8 moves ~lr)


# ------------------------------------------------------------------ DAPO overlong shaping (reward.overlong_*)


@needs_demo_models
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_buffer_penalises_responses_near_the_cap(factor):
    from yatt_hpc.placement import plan
    from yatt_hpc.roles.genrm import GenRMController
    from yatt_hpc.runtime.rank_stats import RankStats

    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", overrides=[
        "reward.mode=rule_only", "reward.overlong_buffer_len=4", f"reward.overlong_penalty_factor={factor}"])
    p = plan(cfg)
    world = types.SimpleNamespace(plan=p, rank=p.group("genrm").rank_start, group="genrm", group_rank=0, comm=None,
                                  is_leader=False)
    ctl = GenRMController(world, cfg, RankStats("genrm"), None)
    lens = np.array([4, 8, 9, 12], np.int32)  # cap 12, buffer 4: 0, 0, -1/4, -1 (x factor)
    batch = SampleBatch(sample_id=np.arange(4), prompt_id=np.zeros(4, np.int64), prompt_len=np.full(4, 2, np.int32),
                        prompt_tokens=np.full(8, 5, np.int32), response_len=lens,
                        response_tokens=np.full(int(lens.sum()), 5, np.int32), answer_len=np.full(4, 1, np.int32),
                        answer=np.frombuffer(b"zzzz", np.uint8).copy())
    scored = ctl.score(batch)
    assert (scored.reward - scored.rule_score).tolist() == pytest.approx([0, 0, -0.25 * factor, -factor])
    assert ctl.stats.values["reward_term/overlong"] == pytest.approx(-1.25 * factor)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("sets, words", [
    (["train.adv_estimator=gae", "train.lora.rank=8"], ["train.adv_estimator=gae", "train.lora.rank=8", "value model"]),
    (["train.loss_mode=gspo", "train.loss_agg_mode=token-mean"], ["gspo", "seq-mean-token-mean"]),
    (["train.loss_mode=cispo", "train.clip_ratio_c=3"], ["train.clip_ratio_c=3", "drop"]),
    (["train.adv_estimator=rloo", "train.adv_std=population"], ["train.adv_std=population", "grpo"]),
    (["train.norm_adv_by_std=false", "train.adv_eps=0.1"], ["train.adv_eps=0.1", "norm_adv_by_std=false"]),
    (["train.gamma=0.9"], ["train.gamma=0.9", "reinforce_plus_plus"]),
    (["train.kl_coef=0", "train.kl_in_reward=true"], ["train.kl_in_reward", "kl_coef"]),
    (["train.kl_coef=0", "train.kl_estimator=k1"], ["train.kl_estimator", "kl_coef"]),
    (["train.kl_horizon=5"], ["train.kl_horizon=5", "kl_target"]),
    (["train.min_lr=1e-6"], ["train.min_lr", "lr_decay"]),
    (["train.lr_decay_steps=5"], ["train.lr_decay_steps=5", "lr_decay"]),
    (["train.lr_decay=cosine", "train.min_lr=1"], ["train.min_lr=1", "above"]),
    (["train.mini_batches=17"], ["train.mini_batches=17", "prompts_per_step"]),
    (["train.adam_betas=[0.9,1.0]"], ["beta2=1"]),
    (["train.clip_ratio_c=0.5"], ["clip_ratio_c"]),
    (["reward.overlong_buffer_len=12"], ["reward.overlong_buffer_len=12", "max_new_tokens"]),
    (["reward.overlong_penalty_factor=2"], ["overlong_penalty_factor=2", "overlong_buffer_len"]),
    (["eval.sources=[]", "eval.every=3"], ["eval.every", "eval.sources"]),
    (["eval.sources=[demo:heldout]", "eval.temperature=0", "eval.samples_per_prompt=4"], ["greedy", "samples_per_prompt"]),
    (["eval.sources=[demo:heldout, demo:heldout]"], ["same metric name"]),
])
def test_refused_recipe_settings_name_the_field_and_the_fix(sets, words):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "demo_cpu.yaml", overrides=sets)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


# ------------------------------------------------------------------ validation's sampling (eval.temperature)


def test_eval_temperature_and_samples_are_what_the_engines_are_asked_for():
    from yatt_hpc.roles.base import eval_round, training_round
    from yatt_hpc.roles.rollout import RolloutController

    prompts = SampleBatch(sample_id=np.arange(2), prompt_id=np.zeros(2, np.int64), prompt_len=np.full(2, 3, np.int32),
                          prompt_tokens=np.full(6, 5, np.int32))

    def temperatures(cfg, rnd):
        fake = types.SimpleNamespace(cfg=cfg, round=rnd)
        return [r.temperature for r in RolloutController.requests(fake, prompts)]

    greedy = load_config(REPO / "configs" / "demo_cpu.yaml", overrides=["eval.sources=[demo:heldout]",
                                                                         "eval.samples_per_prompt=1",
                                                                         "eval.temperature=0"])
    assert (eval_round(greedy).n, temperatures(greedy, eval_round(greedy))) == (1, [0.0, 0.0])
    assert temperatures(greedy, training_round(greedy)) == [1.0, 1.0]  # training keeps rollout.temperature
    sampled = load_config(REPO / "configs" / "demo_cpu.yaml", overrides=["eval.sources=[demo:heldout]",
                                                                          "eval.samples_per_prompt=4",
                                                                          "rollout.temperature=0.7"])
    assert (eval_round(sampled).n, temperatures(sampled, eval_round(sampled))) == (4, [0.7, 0.7])  # null: rollout's
