"""Per-token log-probabilities and entropies from (possibly vocab-parallel) logits, differentiably.

    logits = megatron_model.forward_logits(model, input_ids)          # [B, T, V / tp]
    logp, entropy = token_logprobs_and_entropy(
        logits[:, :-1], input_ids[:, 1:], tp_group=parallel_state.get_tensor_model_parallel_group(),
        vocab_size=hf_config.vocab_size)

With ``parallel_output=True`` a Megatron GPTModel returns each TP rank's slice of the vocab; the
softmax normaliser and the entropy sum therefore need an all-reduce across the TP group. The sums go
through Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity
backward) because every TP rank computes the same loss from the reduced values: the gradient of
that replicated loss w.r.t. a rank's local partial sum is the gradient w.r.t. the total.
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
)


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: Any = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(targets)`` and the entropy of each position's distribution, both [B, T] in fp32.

    Args:
        logits: [B, T, V_local]; this rank's contiguous vocab slice (rank r holds ids
            ``[r * V_local, (r + 1) * V_local)``), or the full vocab when ``tp_group`` is None.
        targets: [B, T] global token ids.
        tp_group: the tensor-parallel group the vocab is split over; None for unsplit logits.
        vocab_size: the real vocab; columns at or past it are padding and are excluded.
        temperature: the sampling temperature of the rollout, so that ``logp`` scores the
            distribution the tokens were actually drawn from.
    """
    tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
    width = logits.shape[-1]
    vocab_start = tp_rank * width
    valid = width if vocab_size is None else min(width, vocab_size - vocab_start)
    assert valid > 0, f"TP rank {tp_rank} holds only vocab padding ({vocab_start=}, {vocab_size=})"
    # Slicing (not -inf masking) keeps padded columns out of exp/entropy and their gradient zero.
    logits = logits[..., :valid].float() / temperature

    def tp_sum(t: torch.Tensor) -> torch.Tensor:
        return t if tp_size == 1 else reduce_from_tensor_model_parallel_region(t, tp_group)

    # Shift by the global max for stability; the shift cancels analytically, so it carries no grad.
    global_max = logits.detach().amax(dim=-1)
    if tp_size > 1:
        torch.distributed.all_reduce(global_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    shifted = logits - global_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = tp_sum(exp.sum(dim=-1))
    log_z = sum_exp.log()

    local_ids = targets - vocab_start
    owned = (local_ids >= 0) & (local_ids < valid)
    picked = shifted.gather(-1, local_ids.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = tp_sum(torch.where(owned, picked, torch.zeros_like(picked)))

    # H = log Z - E_p[shifted] = log Z - sum(exp * shifted) / Z
    expected = tp_sum((exp * shifted).sum(dim=-1)) / sum_exp
    return target_logit - log_z, log_z - expected
