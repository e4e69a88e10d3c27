"""Sampling for the HF engine: per-request uniforms and one inverse-CDF draw per row, batch-independent.

    uniforms = draw_uniforms(requests, engine_seed)          # [rows, steps], each row from its own seed
    tokens, logprobs = sample_next_tokens(logits, temperature, top_p, uniforms[:, step])

A row's token depends only on its own logits, parameters and uniform, never on which other rows share
its micro-batch (hf_engine.py's docstring has the measurements behind the design).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from yatt_hpc.rollout.engine import GenerationRequest


def sample_next_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor,
    plain: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; return (tokens [B], their logprobs [B]).

    Row i uses only its own logits, parameters and ``uniform[i]`` in [0, 1), so a row's token does
    not depend on the other rows. temperature 0 means greedy. ``plain``: the caller knows every row
    is at temperature 1 without top-p (the engine decides once per micro-batch); the same arithmetic
    without the greedy, scaling and nucleus steps (a decode step of few rows is mostly per-op cost).
    """
    if plain:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = _inverse_cdf(logprobs.exp(), uniform)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
    greedy = temperature == 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logprobs = torch.log_softmax(logits.float() / scale[:, None], dim=-1)
    probs = logprobs.exp()
    tokens = _inverse_cdf(probs, uniform)
    nucleus = (top_p < 1) & ~greedy
    if nucleus.any():
        # Only nucleus rows pay for the sort; a top_p=1 row draws from the unsorted CDF whatever its
        # neighbours ask for, which keeps its token independent of them.
        rows = nucleus.nonzero().squeeze(1)
        sorted_probs, order = probs[rows].sort(dim=-1, descending=True, stable=True)
        kept = sorted_probs * ((sorted_probs.cumsum(-1) - sorted_probs) < top_p[rows, None])
        tokens[rows] = order.gather(1, _inverse_cdf(kept, uniform[rows])[:, None]).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index drawn from unnormalised non-negative ``weights`` [B, V] by one uniform per row."""
    cdf = weights.cumsum(-1)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    # u * total can round up to total: searchsorted then says V, past the end; such a row takes the last
    # token that has weight. Any other pick already has weight (cdf rises there), so the three passes
    # over [B, V] are paid only when some row rounded up.
    if bool((picked == weights.shape[-1]).any()):
        positions = torch.arange(weights.shape[-1], device=weights.device)
        last_with_weight = torch.where(weights > 0, positions, 0).amax(-1)
        picked = torch.minimum(picked, last_with_weight)
    return picked


def draw_uniforms(requests: Sequence[GenerationRequest], engine_seed: int) -> torch.Tensor:
    """[rows, max max_new_tokens] uniforms: each request draws exactly its max_new_tokens numbers from its
    own generator, so its stream never depends on the batch it lands in."""
    steps = max(r.max_new_tokens for r in requests)
    uniforms = torch.zeros(len(requests), steps, dtype=torch.float32)
    for row, request in enumerate(requests):
        generator = torch.Generator().manual_seed(request.effective_seed(engine_seed))
        uniforms[row, : request.max_new_tokens] = torch.rand(request.max_new_tokens, generator=generator)
    return uniforms
