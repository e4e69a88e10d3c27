"""How the samples of a mini-batch become micro-batches: a fixed number of samples, or packed to a token budget.

    for micro in micro_batches(batch, index, cfg.train):    # sample indices of one forward/backward each
        ...
    forward_tokens(prompt_len, response_len, prompt_id, share_prompts)   # what one forward over them costs

`train.max_tokens_per_micro_batch: 0` cuts `index` in order into runs of `train.micro_batch_size` samples.
A budget B packs them so that every micro-batch's forward processes at most B tokens (`forward_tokens`) and
holds at most `micro_batch_size` samples; a sample that alone costs more than B gets a micro-batch of its own
(it is never dropped). One long response then costs memory in its own micro-batch only, instead of padding
every row of a fixed-size micro-batch to its length.

The packing is first-fit decreasing: items, longest first (ties in index order), each into the first
micro-batch it fits, a new one when none does. Deterministic (a function of the lengths alone), within 11/9 of
the fewest micro-batches for additive costs, and with padded rows the first item of a micro-batch is its
longest, so the cost of every later row is known when it is placed. An item is one sample on padded rows;
with the shared-prompt forward (`train.share_prompts`) it is a whole prompt group, so the group's prompt is
computed once, and a group that does not fit the budget (or `micro_batch_size`) alone is cut into the fewest
first-fit pieces that do, each piece paying for the prompt again.

The loss does not depend on the packing: every micro-batch's share is divided by the mini-batch's global
counts (`algos/aggregate.py`), so the gradient is the same sum over other partitions, equal up to the order
of float additions (`tests/unit/test_micro_batches.py` measures it).
"""
from __future__ import annotations

import numpy as np

from yatt_hpc.batch import SampleBatch


def micro_batches(batch: SampleBatch, index: np.ndarray, cfg) -> list[np.ndarray]:
    """The micro-batches (arrays of `batch` indices, each in index order) of the samples `index` under train
    config `cfg` (`micro_batch_size`, `max_tokens_per_micro_batch`, `share_prompts`)."""
    index = np.asarray(index, np.int64)
    size = cfg.micro_batch_size
    if not cfg.max_tokens_per_micro_batch:
        return [index[start:start + size] for start in range(0, len(index), size)]
    return pack(batch.prompt_len[index], batch.response_len[index], batch.prompt_id[index],
                budget=cfg.max_tokens_per_micro_batch, max_samples=size, share_prompts=cfg.share_prompts,
                index=index)


def forward_tokens(prompt_len: np.ndarray, response_len: np.ndarray, prompt_id: np.ndarray,
                   share_prompts: bool) -> int:
    """Tokens one forward over these samples processes: with the shared-prompt forward, each distinct prompt
    once plus each sample's response tokens but its last (`shared_prompt.build_layout`'s stream); on padded
    rows, the rows times the longest row's inputs (`policy.pack_micro_batch`, inputs = tokens[:, :-1])."""
    prompt_len, response_len = np.asarray(prompt_len, np.int64), np.asarray(response_len, np.int64)
    if not len(prompt_len):
        return 0
    if share_prompts:
        _, first = np.unique(np.asarray(prompt_id), return_index=True)
        return int(prompt_len[first].sum() + np.maximum(response_len - 1, 0).sum())
    return int(len(prompt_len) * (int((prompt_len + response_len).max()) - 1))


def pack(prompt_len: np.ndarray, response_len: np.ndarray, prompt_id: np.ndarray, *, budget: int,
         max_samples: int, share_prompts: bool, index: np.ndarray | None = None) -> list[np.ndarray]:
    """First-fit-decreasing micro-batches of the samples (positions 0..n-1, or `index` of them), each costing at
    most `budget` forward tokens and holding at most `max_samples` samples unless one sample alone exceeds it."""
    prompt_len, response_len = np.asarray(prompt_len, np.int64), np.asarray(response_len, np.int64)
    index = np.arange(len(prompt_len)) if index is None else np.asarray(index, np.int64)
    if share_prompts:
        items = _group_pieces(prompt_len, response_len, np.asarray(prompt_id), budget, max_samples)
    else:
        items = [(np.array([i]), int(prompt_len[i] + response_len[i] - 1)) for i in range(len(prompt_len))]
    bins: list[tuple[list[np.ndarray], int, int]] = []  # (items, cost, samples)
    for members, cost in sorted(items, key=lambda item: (-item[1], int(item[0][0]))):
        for b, (held, used, count) in enumerate(bins):
            # padded rows: the micro-batch's first row is its longest, so every row costs that row's inputs
            grown = used + cost if share_prompts else (count + 1) * (used // count)
            if grown <= budget and count + len(members) <= max_samples:
                bins[b] = (held + [members], grown, count + len(members))
                break
        else:
            bins.append(([members], cost, len(members)))
    return [index[np.sort(np.concatenate(held))] for held, _, _ in bins]


def _group_pieces(prompt_len: np.ndarray, response_len: np.ndarray, prompt_id: np.ndarray, budget: int,
                  max_samples: int) -> list[tuple[np.ndarray, int]]:
    """(samples, cost) of each prompt group, or of the first-fit pieces of a group too large for one micro-batch."""
    inputs = np.maximum(response_len - 1, 0)
    items = []
    for group in np.unique(prompt_id):
        members = np.flatnonzero(prompt_id == group)
        prompt = int(prompt_len[members[0]])
        if prompt + inputs[members].sum() <= budget and len(members) <= max_samples:
            items.append((members, prompt + int(inputs[members].sum())))
            continue
        pieces: list[tuple[list[int], int]] = []
        for i in members[np.argsort(-inputs[members], kind="stable")]:
            for p, (held, used) in enumerate(pieces):
                if used + inputs[i] <= budget and len(held) < max_samples:
                    pieces[p] = (held + [int(i)], used + int(inputs[i]))
                    break
            else:
                pieces.append(([int(i)], prompt + int(inputs[i])))
        items.extend((np.array(held), used) for held, used in pieces)
    return items
