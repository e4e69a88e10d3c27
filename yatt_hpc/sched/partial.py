"""Partial rollouts (`rollout.partial_rollouts`): the pure decisions, no MPI, no torch.

    todo = needs_generation(finish, response_len)                # fresh rows and paused ones
    budget = segment_budget(response_len, segment, max_new)      # this segment's new tokens per row
    done = complete_groups(prompt_id, todo)                      # groups with every sample finished
    kept = kept_groups(prompt_id, todo, keep)                    # the step's groups: the `keep` lowest complete
    may_continue(oldest_version, version, max_staleness)         # a paused group is continued, or dropped
    seed = continuation_seed(engine_seed, sample_id, done_tokens)

A wave generates in segments of `segment` new tokens per unfinished sample. After each segment the rollout
ranks add up, per trainer replica, its complete groups; a replica with at least `keep` complete groups is
satisfied and its unfinished samples pause at that segment boundary (they keep their tokens, log-probs and
versions, and are continued in a later wave under newer weights). Where a sample pauses is a function of the
sampled tokens, never of timing. A replica keeps the `keep` lowest complete groups; the others (paused, or
complete but surplus) go back to it and are dispatched first in its next wave.
"""
from __future__ import annotations

import numpy as np

PAUSED = 3
"""`SampleBatch.finish` of a sample paused at a segment boundary (0 stop, 1 length, 2 abort)."""
_SEED_LIMIT = 2**63


def needs_generation(finish: np.ndarray, response_len: np.ndarray) -> np.ndarray:
    """Rows still to generate: no response yet (a fresh prompt; every response has at least one token) or paused."""
    return (np.asarray(response_len) == 0) | (np.asarray(finish) == PAUSED)


def segment_budget(response_len: np.ndarray, segment: int, max_new_tokens: int) -> np.ndarray:
    """New tokens each row may sample in this segment: `segment`, less near the response cap."""
    return np.minimum(segment, max_new_tokens - np.asarray(response_len, np.int64))


def segment_finish(reason: str, response_len: int, max_new_tokens: int) -> int:
    """A row's finish code after a segment: 0 stop (eos), 1 length (the response cap), else PAUSED (the
    segment's budget ran out first)."""
    if reason == "stop":
        return 0
    assert reason == "length", reason  # partial rollouts never abort the engine
    return 1 if response_len >= max_new_tokens else PAUSED


def complete_groups(prompt_id: np.ndarray, todo: np.ndarray) -> np.ndarray:
    """The prompt ids (ascending) whose every sample is finished."""
    groups = np.unique(prompt_id)
    open_groups = np.unique(np.asarray(prompt_id)[np.asarray(todo, bool)])
    return np.setdiff1d(groups, open_groups)


def kept_groups(prompt_id: np.ndarray, todo: np.ndarray, keep: int) -> np.ndarray:
    """The `keep` lowest complete prompt ids: the groups a replica's step takes (the same on GenRM and the owner)."""
    return complete_groups(prompt_id, todo)[:keep]


def may_continue(oldest_version: int, version: int, max_staleness: int) -> bool:
    """A paused group is continued under weights `version` only while its oldest token is at most
    `max_staleness` versions older; otherwise it is dropped and its prompt generated afresh."""
    return version - oldest_version <= max_staleness


def continuation_seed(engine_seed: int, sample_id: int, done_tokens: int) -> int | None:
    """The sampling seed of a sample's next segment: None (the engine's own, from the sample id) for its first,
    else one mixed from (engine seed, sample id, tokens so far), so each segment draws fresh uniforms and a
    continued sample is still a function of its id and its tokens alone."""
    if done_tokens == 0:
        return None
    mixed = np.random.SeedSequence([int(engine_seed) & 0xFFFFFFFF, int(sample_id) & 0xFFFFFFFF, int(done_tokens)])
    return int(mixed.generate_state(1, dtype=np.uint64)[0] % _SEED_LIMIT)


def version_spans(token_version: np.ndarray, response_len: np.ndarray) -> np.ndarray:
    """Per sample, max - min of its tokens' weight versions (0 for a sample generated under one version)."""
    lengths = np.asarray(response_len, np.int64)
    spans = np.zeros(len(lengths), np.int64)
    starts = np.cumsum(lengths) - lengths
    nonempty = lengths > 0
    if nonempty.any():
        versions = np.asarray(token_version, np.int64)
        spans[nonempty] = (np.maximum.reduceat(versions, starts[nonempty])
                           - np.minimum.reduceat(versions, starts[nonempty]))
    return spans
