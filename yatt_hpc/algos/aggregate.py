"""Loss aggregation over the GLOBAL batch, however its samples are split over ranks and micro-batches.

    loss = aggregate(loss_tok, mask, "token-mean", Totals(tokens=N, sequences=B), norm_len=L)

`totals` are the counts of the whole optimizer step's batch (all data-parallel ranks, all
micro-batches): the tokens and the sequences that carry a loss token. Each micro-batch's return
value is then its exact share: the shares summed over micro-batches and ranks (gradient
accumulation, then the data-parallel all-reduce SUM) are the formula over the whole batch. A
per-rank or per-micro-batch mean would weight samples by how they happened to be split.

| mode (verl `loss_agg_mode`) | formula                           | TRL `loss_type` |
| token-mean                  | sum_{i,t} l m / N                 | dapo            |
| seq-mean-token-mean         | (1/B) sum_i sum_t l m / |o_i|     | grpo            |
| seq-mean-token-sum          | (1/B) sum_i sum_t l m             | -               |
| seq-mean-token-sum-norm     | sum_{i,t} l m / (B L), L constant | dr_grpo         |

A batch whose tokens were all masked (N = 0 or B = 0) gives a loss of 0 with a zero gradient, not 0/0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Totals:
    """Counts of the whole global batch of one optimizer step."""

    tokens: float
    sequences: float


def aggregate(loss_tok: torch.Tensor, mask: torch.Tensor, mode: str, totals: Totals,
              norm_len: float = 1.0) -> torch.Tensor:
    """This micro-batch's share of the global aggregate of `loss_tok` [B, T] over `mask` (`mode` in AGG_MODES;
    `norm_len` is seq-mean-token-sum-norm's L, Dr.GRPO's constant generation budget)."""
    mask = mask.to(loss_tok.dtype)
    masked = loss_tok * mask
    if mode == "token-mean":
        denominator = totals.tokens
        total = masked.sum()
    elif mode == "seq-mean-token-mean":
        denominator = totals.sequences
        total = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    elif mode == "seq-mean-token-sum":
        denominator = totals.sequences
        total = masked.sum()
    elif mode == "seq-mean-token-sum-norm":
        denominator = totals.sequences * norm_len
        total = masked.sum()
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")
    return total / denominator if denominator > 0 else total * 0.0
