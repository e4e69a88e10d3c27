"""The trainer's critic: the value model's shard on this trainer rank, its AdamW, its values and its update.

    critic = MegatronCritic.from_run_config(cfg, tp_rank, tp_size)   # train.critic.path, else model.path
    values = critic.values(batch)                          # V_t per response token, one array per sample
    critic.set_lr(lr)
    stats = critic.update_values(batch, values, returns, plan)   # the clipped value loss, token-mean

It takes the policy's machinery for everything but the loss (`train/policy.MegatronPolicy`, whose optimizer
step, data-parallel all-reduce, clipping, bf16 masters, ZeRO-1 sharding, checkpoint tensors and host parking it
inherits) with the critic's own AdamW settings (`train.critic`): same tensor and data-parallel groups, same
micro-batches (`train/step_plan.py`), the shared-prompt forward when `train.share_prompts`. The value loss is
`algos/gae.value_loss` token-mean over each mini-batch's global token count (`algos/aggregate.py`), so the
gradient does not depend on how samples are spread over ranks and micro-batches. Pipeline parallelism is
refused (`placement.trainer.pp` must be 1 with a critic).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from yatt_hpc.algos.aggregate import aggregate
from yatt_hpc.algos.gae import value_loss
from yatt_hpc.batch import SampleBatch
from yatt_hpc.config.schema import TrainConfig
from yatt_hpc.critic.model import build_value_model, forward_values, value_shard
from yatt_hpc.metrics.activity import ACTIVITY
from yatt_hpc.models.hf_config import load_hf_config
from yatt_hpc.train import megatron_model, shared_prompt
from yatt_hpc.train.mcore import parallel_state
from yatt_hpc.train.policy import MegatronPolicy, load_hf_state_dict
from yatt_hpc.train.step_plan import UpdatePlan, micro_batches, pack_micro_batch


@dataclass
class CriticStats:
    loss: float = 0.0        # mean over optimizer steps of each mini-batch's value loss
    clipped: float = 0.0     # tokens whose clipped term was the larger (summed over epochs, / epochs)
    tokens: float = 0.0      # tokens in the loss (/ epochs)
    grad_norm: float = 0.0   # mean over optimizer steps, before clipping
    optimizer_steps: int = 0


def critic_train_config(train: TrainConfig) -> TrainConfig:
    """The policy's train settings with the critic's optimizer and schedule (`CriticConfig.optimizer_settings`):
    what the inherited optimizer step and `step_lr` read."""
    return train.model_copy(update=train.critic.optimizer_settings())


class MegatronCritic(MegatronPolicy):
    """The value model on this trainer rank (see the module docstring)."""

    @classmethod
    def from_run_config(cls, cfg, tp_rank: int, tp_size: int) -> MegatronCritic:
        """The value model a `RunConfig` asks for: from `train.critic.path`, else the policy's `model.path`, in
        `model.dtype`."""
        return cls.from_hf(cfg.train.critic.path or cfg.model.path, tp_rank, tp_size, cfg.train,
                           dtype=getattr(torch, cfg.model.dtype))

    @classmethod
    def from_hf(cls, model_dir: str | Path, tp_rank: int, tp_size: int, cfg: TrainConfig,
                dtype: torch.dtype = torch.float32, temperature: float = 1.0) -> MegatronCritic:
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("train.adv_estimator=gae with placement.trainer.pp > 1: the value model has no pipeline "
                             "schedule; set placement.trainer.pp=1 (tensor and data parallelism work)")
        model_dir = Path(model_dir)
        hf_config = load_hf_config(model_dir)
        if hasattr(hf_config, "vision_config"):
            raise ValueError(f"train.critic.path={str(model_dir)!r} is a vision-language model; the value model "
                             "reads text only: use a text model's directory")
        shard = value_shard(load_hf_state_dict(model_dir), hf_config, tp_rank, tp_size, cfg.seed,
                            cfg.critic.head_init_std, where=f"train.critic.path={str(model_dir)!r}")
        model = build_value_model(hf_config, tp_size, dtype, megatron_model.Recompute.of(cfg))
        megatron_model.load_megatron_shard(model, shard)
        return cls(model, hf_config, critic_train_config(cfg), share_prompts=cfg.share_prompts)

    def update(self, *args, **kwargs):
        raise TypeError("a critic trains with update_values, not the policy's update")

    @torch.no_grad()
    def values(self, batch: SampleBatch) -> list[np.ndarray]:
        """V_t of every response token (the value at the position that samples it), one array per sample."""
        self.model.eval()
        try:
            out: list[np.ndarray | None] = [None] * len(batch)
            for micro in micro_batches(batch, np.arange(len(batch)), self.cfg):
                mb = batch.select(micro)
                values, _, _ = self._micro_values(mb)
                rows = values.cpu().numpy()
                for i, row, n in zip(micro, rows, mb.response_len):
                    out[i] = row[:n].astype(np.float32)
                ACTIVITY.progress()
            return out
        finally:
            self.model.train()

    def _micro_values(self, mb: SampleBatch):
        """[N, R] values aligned to each sample's response tokens (left-aligned), their mask, and the
        shared-prompt layout the forward ran on (None on padded rows)."""
        if self.share_prompts:
            layout = shared_prompt.build_layout(mb.ragged("prompt_tokens"), mb.ragged("response_tokens"),
                                                mb.prompt_id).to(self.device)
            stream = shared_prompt.forward_shared(self.model, layout)
            return shared_prompt.gather_rows(stream, layout.source)[..., 0].float(), layout.mask, layout
        tokens, _, _ = pack_micro_batch(mb)
        values = forward_values(self.model, tokens[:, :-1].to(self.device))
        width = int(mb.response_len.max()) if len(mb) else 0
        index = torch.zeros(len(mb), width, dtype=torch.long)
        mask = torch.zeros(len(mb), width)
        for i, (p, n) in enumerate(zip(mb.prompt_len, mb.response_len)):
            index[i, :n] = torch.arange(p - 1, p - 1 + n)
            mask[i, :n] = 1.0
        return values.gather(1, index.to(values.device)), mask.to(values.device), None

    def update_values(self, batch: SampleBatch, old_values: list[np.ndarray], returns: list[np.ndarray],
                      plan: UpdatePlan) -> CriticStats:
        """`plan.epochs` passes, one optimizer step per mini-batch: the clipped value loss against `returns`,
        clipped within `train.critic.value_clip` of `old_values` (the values the advantages were computed with)."""
        stats = CriticStats()
        self.model.train()
        for _ in range(plan.epochs):
            for index, totals in zip(plan.minibatches, plan.totals):
                self._zero_grads()
                for micro in micro_batches(batch, index, self.cfg):
                    stats = self._value_step(batch.select(micro), [old_values[i] for i in micro],
                                             [returns[i] for i in micro], plan.keep[micro], totals, stats)
                    ACTIVITY.progress()
                stats.grad_norm += self._optimizer_step()
                stats.optimizer_steps += 1
        steps = max(stats.optimizer_steps, 1)
        stats.loss /= steps
        stats.grad_norm /= steps
        stats.clipped /= plan.epochs
        stats.tokens /= plan.epochs
        return stats

    def _value_step(self, mb: SampleBatch, old: list[np.ndarray], returns: list[np.ndarray], keep: np.ndarray,
                    totals, stats: CriticStats) -> CriticStats:
        """One micro-batch's share of the mini-batch's value loss, backward; its sums added to `stats`."""
        v_new, mask, layout = self._micro_values(mb)
        width = v_new.shape[1]
        v_old = shared_prompt.padded(old, width).to(v_new.device)
        ret = shared_prompt.padded(returns, width).to(v_new.device)
        mask = mask * torch.from_numpy(keep).to(mask)[:, None]  # train.mask_truncated: out of this loss too
        per_token, clipped = value_loss(v_new, v_old, ret, self.cfg.critic.value_clip)
        loss = aggregate(per_token, mask, "token-mean", totals)
        with shared_prompt.active(layout) if layout is not None else contextlib.nullcontext():
            loss.backward()  # a recomputed layer (train.recompute) attends on the same stream
        stats.loss += float(loss.detach())
        stats.clipped += float((clipped.to(mask.dtype) * mask).sum())
        stats.tokens += float(mask.sum())
        return stats
