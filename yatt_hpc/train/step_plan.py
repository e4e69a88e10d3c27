"""How one RL step's samples become optimizer steps: mini-batches, their global counts, the loss mask, micro-batches.

    plan = plan_update(batch, cfg.train, max_new_tokens, gather=..., reduce=...)
    plan.minibatches[j]      # this replica's sample indices in mini-batch j (possibly none)
    plan.totals[j]           # tokens and sequences of mini-batch j over the whole global batch
    plan.keep                # 1.0 per sample in the loss, 0.0 for a truncated one under train.mask_truncated
    plan = whole_batch_plan(batch, cfg.train)      # one process holding the whole batch (tests, benchmarks)
    for micro in micro_batches(batch, plan.minibatches[j], cfg.train):   # one forward/backward each

and the train config's other per-step choices, each read here from `cfg.train` (so a test of these
functions shows each field's effect): `step_advantages`, `step_gae` (with a critic), `reward_kl`, `step_lr`,
`critic_lr`, `kl_controller`.

A mini-batch is a set of whole prompt groups of the GLOBAL batch: the step's prompt ids over every
data-parallel replica, sorted, cut into `train.mini_batches` nearly equal parts (`np.array_split`). So
which samples share an optimizer step does not depend on how the balancer spread the groups over
replicas, and neither do the loss's normalisers (`algos/aggregate.py`). `gather(list)` concatenates a
list over the replicas and `reduce(array)` sums over them; both are given by the trainer (its
communicator, with only each replica's owner contributing), so this module holds no MPI.

Micro-batches. `train.max_tokens_per_micro_batch: 0` cuts a mini-batch's samples in order into runs of
`train.micro_batch_size`. A budget B packs them so that every micro-batch's forward processes at most B
tokens (`forward_tokens`) and holds at most `micro_batch_size` samples; a sample that alone costs more than B
gets a micro-batch of its own (it is never dropped). One long response then costs memory in its own
micro-batch only, instead of padding every row of a fixed-size micro-batch to its length. The packing is
first-fit decreasing: items, longest first (ties in index order), each into the first micro-batch it fits,
a new one when none does. Deterministic (a function of the lengths alone), within 11/9 of the fewest
micro-batches for additive costs, and with padded rows the first item of a micro-batch is its longest, so
the cost of every later row is known when it is placed. An item is one sample on padded rows; with the
shared-prompt forward (`train.share_prompts`) it is a whole prompt group, so the group's prompt is computed
once, and a group that does not fit the budget (or `micro_batch_size`) alone is cut, longest responses first,
into first-fit pieces that do, each piece paying for the prompt again. The loss does not depend on the packing:
every micro-batch's share is divided by the mini-batch's global counts (`algos/aggregate.py`), so the
gradient is the same sum over another partition, equal up to the order of float additions
(`tests/unit/test_micro_batches.py` measures it).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from yatt_hpc.algos.advantages import Advantages, estimate
from yatt_hpc.algos.aggregate import Totals
from yatt_hpc.algos.gae import GAE, estimate_gae, value_positions
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
                reduce: Callable[[np.ndarray], np.ndarray], kl_coef: float = 0.0,
                tokens: np.ndarray | None = None) -> UpdatePlan:
    """The plan of this replica's `batch` under train config `cfg` (`epochs`, `mini_batches`, `mask_truncated`).
    `tokens`: per sample, the tokens its loss covers (default `sampled_tokens`; the critic's `value_tokens`)."""
    keep = np.ones(len(batch), np.float32)
    if cfg.mask_truncated:
        keep[batch.finish == LENGTH_FINISH] = 0.0
    groups = np.unique(np.asarray(gather(np.unique(batch.prompt_id).tolist()), np.int64))
    parts = np.array_split(groups, cfg.mini_batches)
    minibatches = [np.flatnonzero(np.isin(batch.prompt_id, part)) for part in parts]
    counted = keep * (batch.response_len > 0)
    sampled = sampled_tokens(batch) if tokens is None else tokens  # an agent's tool results are not in the loss
    local = np.array([[float((sampled[idx] * keep[idx]).sum()), float(counted[idx].sum())]
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


def step_gae(batch: SampleBatch, values: list[np.ndarray], cfg, token_penalties: list[np.ndarray] | None = None,
             reduce: Callable[[np.ndarray], np.ndarray] = lambda values: values) -> GAE:
    """`adv_estimator: gae`: GAE on the critic's `values` with `cfg.gamma`, `cfg.critic.lam` and
    `cfg.critic.whiten_advantages` (`yatt_hpc/algos/gae.py`), over the tokens the model sampled (`response_mask`:
    an agent's tool results are skipped), per token or per model turn (`cfg.critic.level`)."""
    return estimate_gae(batch.reward, values, gamma=cfg.gamma, lam=cfg.critic.lam, token_penalties=token_penalties,
                        whiten_advantages=cfg.critic.whiten_advantages, reduce=reduce,
                        sampled=batch.ragged("response_mask"), level=cfg.critic.level)


def reward_kl(batch: SampleBatch, ref_logprobs: list[np.ndarray], cfg, coef: float) -> tuple[list[np.ndarray], float]:
    """`train.kl_in_reward`: per sample, coef x the `cfg.kl_estimator` KL of each token of the sampling policy
    (the rollout's log-probabilities) to the reference; and the KL's sum over the tokens."""
    kl = [kl_estimate(cfg.kl_estimator, torch.from_numpy(np.asarray(old, np.float32)),
                      torch.from_numpy(np.asarray(ref, np.float32))).numpy().astype(np.float64) * sampled
          for old, ref, sampled in zip(batch.ragged("logprobs"), ref_logprobs, batch.ragged("response_mask"))]
    return [coef * k for k in kl], float(sum(k.sum() for k in kl))


def sampled_tokens(batch: SampleBatch) -> np.ndarray:
    """Per sample, how many response tokens the model sampled (`response_mask`; all of a single-turn response)."""
    owner = np.repeat(np.arange(len(batch)), batch.response_len)
    return np.bincount(owner, weights=batch.response_mask, minlength=len(batch)).astype(np.float64)


def value_tokens(batch: SampleBatch, level: str) -> np.ndarray:
    """Per sample, how many tokens carry the critic's value loss at `train.critic.level` (`algos.gae.value_positions`:
    the model's tokens, or each model turn's first)."""
    return np.array([value_positions(m, level).sum() for m in batch.ragged("response_mask")], np.float64)


def masked_behavior(batch: SampleBatch, proximal: list[np.ndarray]) -> list[np.ndarray]:
    """The engine's log-probabilities, with the proximal ones where the model did not sample the token (an
    agent's tool results: the engine has none there), so those tokens' importance weight is 1."""
    return [np.where(m > 0, b, p).astype(np.float32)
            for b, p, m in zip(batch.ragged("logprobs"), proximal, batch.ragged("response_mask"))]


def step_lr(step: int, cfg) -> float:
    """The learning rate of RL step `step` under `cfg`'s warmup and decay."""
    return learning_rate(step, base=cfg.lr, warmup_steps=cfg.lr_warmup_steps, decay=cfg.lr_decay,
                         decay_steps=cfg.lr_decay_steps or cfg.steps, min_lr=cfg.min_lr)


def critic_lr(step: int, cfg) -> float:
    """The critic's learning rate of RL step `step`: `cfg.critic`'s rate, warmup and decay (decay_steps default
    `cfg.steps`)."""
    c = cfg.critic
    return learning_rate(step, base=c.lr, warmup_steps=c.lr_warmup_steps, decay=c.lr_decay,
                         decay_steps=c.lr_decay_steps or cfg.steps, min_lr=c.min_lr)


def kl_controller(cfg) -> AdaptiveKL:
    """The KL weight: `cfg.kl_coef`, adapted toward `cfg.kl_target` over `cfg.kl_horizon` samples if set."""
    return AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)


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
    rows, the rows times the longest row's inputs (`pack_micro_batch`, inputs = tokens[:, :-1])."""
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


def response_aligned(prompt_lens: np.ndarray, values: list[np.ndarray], width: int) -> torch.Tensor:
    """[B, width] float32 with sample i's per-response-token `values` at its target positions P-1 .. P-1+R-1."""
    out = torch.zeros(len(values), width)
    for i, (p, v) in enumerate(zip(prompt_lens, values)):
        out[i, p - 1:p - 1 + len(v)] = torch.from_numpy(np.asarray(v, np.float32))
    return out


def pack_micro_batch(mb: SampleBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded token matrix [B, L], response mask and old logprobs aligned to targets [B, L-1].

    Target position t predicts token t+1, so response token j (at sequence index P+j) is scored at
    target position P+j-1.
    """
    prompts, responses, logps = mb.ragged("prompt_tokens"), mb.ragged("response_tokens"), mb.ragged("logprobs")
    sampled = mb.ragged("response_mask")  # an agent's tool results carry no loss
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    tokens = torch.zeros(len(mb), length, dtype=torch.long)
    mask = torch.zeros(len(mb), length - 1)
    old = torch.zeros(len(mb), length - 1)
    for i, (p, r, lp, m) in enumerate(zip(prompts, responses, logps, sampled)):
        seq = np.concatenate([p, r])
        tokens[i, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
        lo, hi = len(p) - 1, len(p) - 1 + len(r)
        mask[i, lo:hi] = torch.from_numpy(m.astype(np.float32))
        old[i, lo:hi] = torch.from_numpy(lp.astype(np.float32))
    return tokens, mask, old
