"""Partial rollouts' pure decisions (`sched/partial.py`) and the HF engine continuing a paused sample from its
prompt and partial response (a real tiny GPT-2 on CPU).

Run: .venv/bin/python -m pytest tests/unit/test_partial_rollouts.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from yatt_hpc.batch import SampleBatch, batch_columns, batch_from_columns
from yatt_hpc.rollout import GenerationRequest, build_engine
from yatt_hpc.sched.partial import (
    PAUSED,
    complete_groups,
    continuation_seed,
    kept_groups,
    may_continue,
    needs_generation,
    segment_budget,
    segment_finish,
    version_spans,
)


def test_fresh_and_paused_rows_need_generation_finished_ones_do_not():
    finish = np.array([0, 0, 1, PAUSED, 0], np.int8)
    lens = np.array([0, 5, 12, 4, 3])
    assert needs_generation(finish, lens).tolist() == [True, False, False, True, False]


def test_a_segment_takes_its_budget_less_near_the_cap_and_pauses_only_below_the_cap():
    assert segment_budget(np.array([0, 8, 10, 11]), 4, 12).tolist() == [4, 4, 2, 1]
    assert segment_finish("stop", 3, 12) == 0
    assert segment_finish("length", 12, 12) == 1
    assert segment_finish("length", 8, 12) == PAUSED


def test_the_kept_groups_are_the_lowest_complete_ones_whatever_the_row_order():
    # groups of 2: 5 complete, 3 has a paused sample, 9 complete, 1 complete
    prompt_id = np.array([9, 5, 3, 1, 9, 5, 3, 1])
    todo = np.array([0, 0, 1, 0, 0, 0, 0, 0], bool)
    assert complete_groups(prompt_id, todo).tolist() == [1, 5, 9]
    assert kept_groups(prompt_id, todo, 2).tolist() == [1, 5]
    order = np.random.default_rng(0).permutation(8)
    assert kept_groups(prompt_id[order], todo[order], 2).tolist() == [1, 5]


@pytest.mark.parametrize(("oldest", "version", "s", "ok"), [
    pytest.param(3, 3, 1, True, id="same-version"),
    pytest.param(3, 4, 1, True, id="one-newer-s1"),
    pytest.param(3, 5, 1, False, id="two-newer-s1-dropped"),
    pytest.param(3, 5, 2, True, id="two-newer-s2"),
])
def test_a_paused_group_continues_only_within_max_staleness_versions(oldest, version, s, ok):
    assert may_continue(oldest, version, s) is ok


def test_a_continuation_draws_a_seed_of_its_own_from_the_sample_and_its_tokens():
    assert continuation_seed(0, 17, 0) is None  # the first segment: the engine's own seed for the sample
    a, b, c = continuation_seed(0, 17, 4), continuation_seed(0, 17, 8), continuation_seed(0, 18, 4)
    assert len({a, b, c}) == 3 and continuation_seed(0, 17, 4) == a and 0 <= a < 2**63


def test_version_span_is_max_minus_min_per_sample_and_zero_without_tokens():
    versions = np.array([2, 2, 3, 5, 5, 4], np.int32)
    assert version_spans(versions, np.array([3, 0, 2, 1])).tolist() == [1, 0, 0, 0]
    assert version_spans(np.array([1, 3, 7], np.int32), np.array([1, 2])).tolist() == [0, 4]


def test_paused_samples_survive_the_checkpoint_columns_with_their_versions():
    batch = SampleBatch(sample_id=np.array([4, 5]), prompt_id=np.array([2, 2]), owner=np.zeros(2, np.int32),
                        prompt_len=np.array([2, 2], np.int32), prompt_tokens=np.arange(4, dtype=np.int32),
                        response_len=np.array([3, 1], np.int32), response_tokens=np.arange(4, dtype=np.int32),
                        logprobs=-np.arange(4, dtype=np.float32), token_version=np.array([1, 1, 2, 2], np.int32),
                        finish=np.array([PAUSED, 0], np.int8))
    back = batch_from_columns({k: np.array(v) for k, v in batch_columns(batch).items()})
    assert back.token_version.tolist() == [1, 1, 2, 2] and back.finish.tolist() == [PAUSED, 0]
    assert [v.tolist() for v in back.ragged("token_version")] == [[1, 1, 2], [2]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(config).save_pretrained(path, safe_serialization=True)
    with build_engine("hf", str(path), device="cpu", tp_size=1, seed=0) as eng:
        yield eng


def test_the_hf_engine_continues_a_paused_sample_from_prompt_and_partial_response(engine):
    """Greedy: three segments of 4 tokens, each continuing from the prompt and the tokens so far, sample the
    response one call of 12 samples, with the same log-probabilities (the prefix is recomputed, not cached)."""
    prompts = [np.array([5, 9, 11, 3]), np.array([7, 7, 20])]
    whole = engine.generate([GenerationRequest(sample_id=i, prompt_ids=p, max_new_tokens=12, temperature=0.0)
                             for i, p in enumerate(prompts)])
    tokens = [np.zeros(0, np.int32) for _ in prompts]
    logprobs = [np.zeros(0, np.float32) for _ in prompts]
    for _ in range(3):
        going = [i for i in range(len(prompts)) if len(tokens[i]) < 12 and 2 not in tokens[i]]
        got = engine.generate([GenerationRequest(sample_id=i, prompt_ids=np.concatenate([prompts[i], tokens[i]]),
                                                 max_new_tokens=min(4, 12 - len(tokens[i])), temperature=0.0)
                               for i in going])
        for r in got:
            tokens[r.sample_id] = np.concatenate([tokens[r.sample_id], r.response_ids])
            logprobs[r.sample_id] = np.concatenate([logprobs[r.sample_id], r.logprobs])
    for r in whole:
        assert tokens[r.sample_id].tolist() == r.response_ids.tolist()
        np.testing.assert_allclose(logprobs[r.sample_id], r.logprobs, atol=1e-5)


def test_a_sampled_continuation_is_a_function_of_its_seed_and_prefix(engine):
    """Temperature 1: the same continuation request (prefix, seed) gives the same tokens alone or in a batch
    (log-probabilities to float rounding: the engine is bitwise for the same batch, which a step fixes)."""
    prefix = np.array([5, 9, 11, 3, 40, 41])
    seed = continuation_seed(0, 3, 2)
    alone = engine.generate([GenerationRequest(sample_id=3, prompt_ids=prefix, max_new_tokens=6, seed=seed)])[0]
    mixed = engine.generate([GenerationRequest(sample_id=9, prompt_ids=np.array([8, 8]), max_new_tokens=6),
                             GenerationRequest(sample_id=3, prompt_ids=prefix, max_new_tokens=6, seed=seed)])
    again = {r.sample_id: r for r in mixed}[3]
    assert alone.response_ids.tolist() == again.response_ids.tolist()
    np.testing.assert_allclose(alone.logprobs, again.logprobs, atol=1e-5)
