"""The rows of a micro-batch as the HF engine decodes it (`hf_engine.HFEngine._generate_batch`).

    distinct, repeats = distinct_prompts(requests)   # prefill each distinct prompt once ...
    positions, logits, mask = shed(repeats, cache, positions, logits, mask)   # ... then a row per request
    keep = live_rows(~done)                          # finished rows out, the cache kept in place

`shed` keeps rows `keep` of everything per-row: the KV cache (its `batch_select_indices`), the
positions and any batch-first tensor. The prefill's expansion repeats rows; a shed during decoding
orders the live rows so that the cache can keep them without a new buffer (`native_gpt2.keep_rows`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from yatt_hpc.rollout.engine import GenerationRequest


def distinct_prompts(requests: Sequence[GenerationRequest]) -> tuple[list[int], torch.Tensor | None]:
    """The first request of each distinct prompt (tokens and images) and, when some repeat, the row of
    the distinct prompts each request takes (None when all differ)."""
    row_of: dict[tuple, int] = {}  # (prompt bytes, images) -> its row among the distinct prompts
    distinct, rows = [], []
    for i, r in enumerate(requests):  # prompt_ids are int32 already (GenerationRequest)
        key = (r.prompt_ids.tobytes(), tuple(r.images))
        if key not in row_of:
            row_of[key] = len(distinct)
            distinct.append(i)
        rows.append(row_of[key])
    return distinct, (torch.tensor(rows, dtype=torch.long) if len(distinct) < len(requests) else None)


def live_rows(live: torch.Tensor) -> torch.Tensor:
    """The rows to keep, the live ones, ordered so the cache can keep them in place: those already among
    the first `live.sum()` rows stay where they are, the live rows past them fill the holes there."""
    count = int(live.sum())
    keep = torch.arange(count, device=live.device)
    keep[(~live[:count]).nonzero().squeeze(1)] = live[count:].nonzero().squeeze(1) + count
    return keep


def shed(keep: torch.Tensor, cache, positions: torch.Tensor, *per_row: torch.Tensor) -> tuple:
    """Only the rows `keep` of a micro-batch (repeated: the prefill's rows expanded to one per request):
    its KV cache, its positions ([B, W], or M-RoPE's [3, B, W]) and each per-row tensor (batch first)."""
    cache.batch_select_indices(keep)
    return (positions.index_select(positions.dim() - 2, keep), *(t[keep] for t in per_row))

