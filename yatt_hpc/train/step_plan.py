"""How one RL step's samples become optimizer steps: mini-batches, their global counts, the loss mask.

    plan = plan_update(batch, cfg.train, max_new_tokens, gather=..., reduce=...)
    plan.minibatches[j]      # this replica's sample indices in mini-batch j (possibly none)
    plan.totals[j]           # tokens and sequences of mini-batch j over the whole global batch
    plan.keep                # 1.0 per sample in the loss, 0.0 for a truncated one under train.mask_truncated
    plan = whole_batch_plan(batch, cfg.train)      # one process holding the whole batch (tests, benchmarks)

and the train config's other per-step choices, each read here from `cfg.train` (so a test of these
functions shows each field's effect): `step_advantages`, `reward_kl`, `step_lr`, `kl_controller`.

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
import torch

from yatt_hpc.algos.advantages import Advantages, estimate
from yatt_hpc.algos.aggregate import Totals
from yatt_hpc.algos.kl import AdaptiveKL, kl_estimate
from yatt_hpc.algos.schedule import learning_rate
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


def step_advantages(batch: SampleBatch, cfg, token_penalties: list[np.ndarray] | None = None,
                    reduce: Callable[[np.ndarray], np.ndarray] = lambda values: values) -> Advantages:
    """The advantages of `cfg.adv_estimator` with its options (`yatt_hpc/algos/advantages.py`)."""
    return estimate(cfg.adv_estimator, batch.reward, batch.prompt_id, batch.response_len,
                    token_penalties=token_penalties, eps=cfg.adv_eps, norm_by_std=cfg.norm_adv_by_std,
                    std=cfg.adv_std, gamma=cfg.gamma, reduce=reduce)


def reward_kl(batch: SampleBatch, ref_logprobs: list[np.ndarray], cfg, coef: float) -> tuple[list[np.ndarray], float]:
    """`train.kl_in_reward`: per sample, coef x the `cfg.kl_estimator` KL of each token of the sampling policy
    (the rollout's log-probabilities) to the reference; and the KL's sum over the tokens."""
    kl = [kl_estimate(cfg.kl_estimator, torch.from_numpy(np.asarray(old, np.float32)),
                      torch.from_numpy(np.asarray(ref, np.float32))).numpy().astype(np.float64)
          for old, ref in zip(batch.ragged("logprobs"), ref_logprobs)]
    return [coef * k for k in kl], float(sum(k.sum() for k in kl))


def step_lr(step: int, cfg) -> float:
    """The learning rate of RL step `step` under `cfg`'s warmup and decay."""
    return learning_rate(step, base=cfg.lr, warmup_steps=cfg.lr_warmup_steps, decay=cfg.lr_decay,
                         decay_steps=cfg.lr_decay_steps or cfg.steps, min_lr=cfg.min_lr)


def kl_controller(cfg) -> AdaptiveKL:
    """The KL weight: `cfg.kl_coef`, adapted toward `cfg.kl_target` over `cfg.kl_horizon` samples if set."""
    return AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
