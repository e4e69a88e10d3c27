"""How one RL step's samples become optimizer steps: mini-batches, their global counts, the loss mask.

    plan = plan_update(batch, cfg.train, max_new_tokens, gather=..., reduce=...)
    plan.minibatches[j]      # this replica's sample indices in mini-batch j (possibly none)
    plan.totals[j]           # tokens and sequences of mini-batch j over the whole global batch
    plan.keep                # 1.0 per sample in the loss, 0.0 for a truncated one under train.mask_truncated
    plan = whole_batch_plan(batch, cfg.train)      # one process holding the whole batch (tests, benchmarks)

A mini-batch is a set of whole prompt groups of the GLOBAL batch: the step's prompt ids over every
data-parallel replica, sorted, cut into `train.mini_batches` nearly equal parts (`np.array_split`). So
which samples share an optimizer step does not depend on how the balancer spread the groups over
replicas, and neither do the loss's normalisers (`algos/aggregate.py`). `gather(list)` concatenates a
list over the replicas and `reduce(array)` sums over them; both are given by the trainer (its
communicator, with only each replica's owner contributing), so this module holds no MPI.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from yatt_hpc.algos.aggregate import Totals
from yatt_hpc.batch import SampleBatch

LENGTH_FINISH = 1  # SampleBatch.finish of a response cut at max_new_tokens


@dataclass
class UpdatePlan:
    minibatches: list[np.ndarray]
    totals: list[Totals]
    keep: np.ndarray
    epochs: int = 1
    kl_coef: float = 0.0
    """The KL term's weight in the loss (0 when the KL is in the reward or off)."""
    norm_len: float = 1.0
    """seq-mean-token-sum-norm's constant L (rollout.max_new_tokens)."""

    @property
    def truncated_masked(self) -> int:
        return int((self.keep == 0).sum())


def plan_update(batch: SampleBatch, cfg, norm_len: int, gather: Callable[[list], list],
                reduce: Callable[[np.ndarray], np.ndarray], kl_coef: float = 0.0) -> UpdatePlan:
    """The plan of this replica's `batch` under train config `cfg` (`epochs`, `mini_batches`, `mask_truncated`)."""
    keep = np.ones(len(batch), np.float32)
    if cfg.mask_truncated:
        keep[batch.finish == LENGTH_FINISH] = 0.0
    groups = np.unique(np.asarray(gather(np.unique(batch.prompt_id).tolist()), np.int64))
    parts = np.array_split(groups, cfg.mini_batches)
    minibatches = [np.flatnonzero(np.isin(batch.prompt_id, part)) for part in parts]
    counted = keep * (batch.response_len > 0)
    local = np.array([[float((batch.response_len[idx] * keep[idx]).sum()), float(counted[idx].sum())]
                      for idx in minibatches], np.float64)
    sums = reduce(local.reshape(-1)).reshape(local.shape)
    return UpdatePlan(minibatches, [Totals(tokens=float(t), sequences=float(s)) for t, s in sums], keep,
                      epochs=cfg.epochs, kl_coef=kl_coef, norm_len=float(norm_len))


def whole_batch_plan(batch: SampleBatch, cfg, norm_len: int = 1) -> UpdatePlan:
    """`plan_update` for one process that holds the whole global batch (tests, benchmarks); the KL weight
    in the loss is `cfg.kl_coef` unless the KL is in the reward."""
    return plan_update(batch, cfg, norm_len, gather=lambda items: items, reduce=lambda values: values,
                       kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef)
