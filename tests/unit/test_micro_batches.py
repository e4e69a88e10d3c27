"""Token-budget micro-batches (`train.max_tokens_per_micro_batch`, train/step_plan.py): every sample in
exactly one micro-batch, each within the budget (or alone), groups kept whole where they fit, the same
packing on every run; and the update's gradient and the reference's log-probabilities those of fixed
micro-batches, for every loss aggregation, with and without the shared-prompt forward."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.programs.dp_update import global_batch
from yatt_hpc.config.schema import TrainConfig
from yatt_hpc.train.step_plan import forward_tokens, micro_batches, pack

DEMO_POLICY = Path(__file__).resolve().parents[2] / "models" / "demo" / "policy"


def _cost(batch, micro, share: bool) -> int:
    return forward_tokens(batch.prompt_len[micro], batch.response_len[micro], batch.prompt_id[micro], share)


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(1, 30), st.lists(st.integers(0, 80), min_size=1, max_size=6)),
                       min_size=1, max_size=8),
       budget=st.integers(1, 300), max_samples=st.integers(1, 9), share=st.booleans())
def test_every_sample_lands_once_within_the_budget_or_alone(groups, budget, max_samples, share):
    prompt_len = np.array([p for p, lengths in groups for _ in lengths])
    response_len = np.array([r for _, lengths in groups for r in lengths])
    prompt_id = np.array([g for g, (_, lengths) in enumerate(groups) for _ in lengths])
    index = np.arange(100, 100 + len(prompt_len))  # a mini-batch's indices into its batch
    micros = pack(prompt_len, response_len, prompt_id, budget=budget, max_samples=max_samples,
                  share_prompts=share, index=index)
    assert sorted(np.concatenate(micros).tolist()) == index.tolist()
    for micro in micros:
        at = micro - 100
        assert len(micro) <= max_samples
        cost = forward_tokens(prompt_len[at], response_len[at], prompt_id[at], share)
        alone = [forward_tokens(prompt_len[[i]], response_len[[i]], prompt_id[[i]], share) for i in at]
        assert cost <= budget or (len(micro) == 1 and alone[0] > budget), (micro, cost)
    # deterministic: the same lengths give the same micro-batches
    again = pack(prompt_len, response_len, prompt_id, budget=budget, max_samples=max_samples, share_prompts=share,
                 index=index)
    assert [m.tolist() for m in again] == [m.tolist() for m in micros]
    if share:  # a group that fits the budget and the sample cap alone is never split
        for g in range(len(groups)):
            members = index[prompt_id == g]
            if forward_tokens(prompt_len[prompt_id == g], response_len[prompt_id == g], prompt_id[prompt_id == g],
                              True) <= budget and len(members) <= max_samples:
                assert sum(np.isin(members, m).any() for m in micros) == 1, g


def test_the_budget_packs_short_samples_together_and_a_long_one_alone():
    batch = global_batch()  # 6 groups of 4, prompts of 4-8 tokens, responses of 1-11: rows of 5-18 inputs
    cfg = TrainConfig(micro_batch_size=24, max_tokens_per_micro_batch=12, share_prompts=False)
    micros = [m.tolist() for m in micro_batches(batch, np.arange(len(batch)), cfg)]
    too_long = [i for i in range(len(batch)) if _cost(batch, np.array([i]), False) > 12]
    assert too_long and all([i] in micros for i in too_long)  # each in a micro-batch of its own, not dropped
    assert any(len(m) > 1 for m in micros)
    assert all(_cost(batch, np.array(m), False) <= 12 for m in micros if len(m) > 1)
    # off: runs of micro_batch_size samples in order, today's fixed path
    fixed = micro_batches(batch, np.arange(24), TrainConfig(micro_batch_size=5))
    assert [m.tolist() for m in fixed] == [list(range(s, min(s + 5, 24))) for s in range(0, 24, 5)]


def _policy(share: bool, budget: int, agg: str, micro_batch_size: int):
    from yatt_hpc.train.policy import MegatronPolicy

    torch.manual_seed(0)
    fields = {"norm_adv_by_std": False} if agg == "seq-mean-token-sum-norm" else {}
    cfg = TrainConfig(lr=0.1, micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=budget, kl_coef=0.01,
                      entropy_coef=0.01, grad_clip=0.0, share_prompts=share, loss_agg_mode=agg, **fields)
    return MegatronPolicy.from_hf(DEMO_POLICY, 0, 1, cfg)


def _update(policy, batch) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The gradient of one update (grad_clip 0: the loss's own), and the tokens each training forward embedded."""
    from yatt_hpc.train.step_plan import step_advantages, whole_batch_plan

    fed: list[int] = []
    hook = policy.model.embedding.register_forward_pre_hook(
        lambda _m, _a, kwargs: fed.append(kwargs["input_ids"].numel()), with_kwargs=True)
    adv = step_advantages(batch, policy.cfg)
    policy.update(batch, adv.values, whole_batch_plan(batch, policy.cfg, norm_len=12))
    hook.remove()
    return {name: p.grad.clone() for name, p in policy.named_params.items()}, fed


AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
BUDGET = 40
"""Tokens per micro-batch in the comparison: fewer than one fixed micro-batch of 8 samples holds, more than
the longest sample, so the packing differs from the fixed path's in every case."""


@pytest.mark.parametrize("share", [pytest.param(True, id="shared-prompts"), pytest.param(False, id="padded")])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_the_budget_gives_the_fixed_micro_batches_gradient(one_rank_world, share, agg):
    batch = global_batch()
    fixed_grad, fixed_fed = _update(_policy(share, 0, agg, 8), batch)
    budget_grad, budget_fed = _update(_policy(share, BUDGET, agg, 24), batch)
    # the setting took effect: more, smaller forwards, each within the budget (one sample alone never exceeds it here)
    assert max(budget_fed) <= BUDGET < max(fixed_fed) and len(budget_fed) > len(fixed_fed)
    if not share:  # and less padding: fewer tokens in all
        assert sum(budget_fed) < sum(fixed_fed)
    # the same gradient: other micro-batches add the per-sample terms in another order (and a padded row's
    # matmuls run at another width), so equal to float rounding of the sum, not bitwise
    for name, grad in fixed_grad.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(budget_grad[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("share", [pytest.param(True, id="shared-prompts"), pytest.param(False, id="padded")])
def test_the_reference_scores_every_sample_in_its_place_under_the_budget(one_rank_world, share):
    batch = global_batch()
    fixed = _policy(share, 0, "token-mean", 8).reference_logprobs(batch)
    budget = _policy(share, BUDGET, "token-mean", 24).reference_logprobs(batch)
    assert [len(x) for x in budget] == batch.response_len.tolist()
    for a, b in zip(budget, fixed):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("share", [pytest.param(True, id="shared-prompts"), pytest.param(False, id="padded")])
def test_a_budget_that_packs_the_fixed_micro_batches_gives_bitwise_their_gradient(one_rank_world, share):
    """Where the packing makes the fixed path's micro-batch (here the whole batch in one), the sums run in the
    same order: the budget's own bookkeeping changes no bit."""
    batch = global_batch()
    whole = _cost(batch, np.arange(len(batch)), share)
    fixed_grad, fixed_fed = _update(_policy(share, 0, "token-mean", 24), batch)
    budget_grad, budget_fed = _update(_policy(share, whole, "token-mean", 24), batch)
    assert budget_fed == fixed_fed == [whole]  # forward_tokens counts what the forward embeds
    for name, grad in fixed_grad.items():
        assert torch.equal(budget_grad[name], grad), name


@pytest.mark.parametrize("value, needles", [
    pytest.param("-5", ["train.max_tokens_per_micro_batch", "invalid value -5", "greater than or equal to 0"],
                 id="negative"),
    pytest.param("1.5", ["train.max_tokens_per_micro_batch", "invalid value 1.5", "integer"], id="fraction"),
    pytest.param("lots", ["train.max_tokens_per_micro_batch", "invalid value 'lots'", "integer"], id="text"),
])
def test_nonsense_budgets_are_refused_at_load_naming_the_field_value_and_fix(value, needles):
    from yatt_hpc.config import load_config
    from yatt_hpc.config.load import ConfigError

    config = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(config, [f"train.max_tokens_per_micro_batch={value}"])
    for needle in needles + ["--set train.max_tokens_per_micro_batch="]:
        assert needle in str(err.value), str(err.value)
    assert load_config(config, ["train.max_tokens_per_micro_batch=0"]).train.max_tokens_per_micro_batch == 0
