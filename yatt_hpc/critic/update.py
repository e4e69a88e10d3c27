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
the policy's too: each trainer rank holds its stage of the value model (the head on the last), and each
mini-batch runs through Megatron's 1F1B schedule (`train/pipeline.py`), the last stage computing the loss.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from yatt_hpc.algos.aggregate import aggregate
from yatt_hpc.algos.gae import value_loss, value_positions
from yatt_hpc.batch import SampleBatch
from yatt_hpc.config.schema import TrainConfig
from yatt_hpc.critic.model import build_value_model, value_shard
from yatt_hpc.metrics.activity import ACTIVITY
from yatt_hpc.models.hf_config import load_hf_config
from yatt_hpc.train import megatron_model, shared_prompt
from yatt_hpc.train.policy import MegatronPolicy, load_hf_state_dict, pipeline_stage
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
        model_dir = Path(model_dir)
        hf_config = load_hf_config(model_dir)
        if hasattr(hf_config, "vision_config"):
            raise ValueError(f"train.critic.path={str(model_dir)!r} is a vision-language model; the value model "
                             "reads text only: use a text model's directory")
        shard = value_shard(load_hf_state_dict(model_dir), hf_config, tp_rank, tp_size, cfg.seed,
                            cfg.critic.head_init_std, where=f"train.critic.path={str(model_dir)!r}",
                            stage=pipeline_stage())
        model = build_value_model(hf_config, tp_size, dtype, megatron_model.Recompute.of(cfg))
        megatron_model.load_megatron_shard(model, shard)
        return cls(model, hf_config, critic_train_config(cfg), share_prompts=cfg.share_prompts)

    def update(self, *args, **kwargs):
        raise TypeError("a critic trains with update_values, not the policy's update")

    @torch.no_grad()
    def values(self, batch: SampleBatch) -> list[np.ndarray]:
        """V_t of every response token (the value at the position that samples it), one array per sample; with
        pipeline stages the last stage's, on every stage."""
        self.model.eval()
        try:
            micros = [(micro, batch.select(micro)) for micro in micro_batches(batch, np.arange(len(batch)), self.cfg)]
            items = [(micro, mb, self._inputs(mb)) for micro, mb in micros]
            if self.pipeline is None:
                per_micro = [self._rows(item, self._forward(self.model, item[2])) for item in items]
            else:
                per_micro = self.pipeline.run(self.model, items, lambda model, item: self._forward(model, item[2]),
                                              lambda item, out: (torch.zeros(()), self._rows(item, out)),
                                              forward_only=True)
            flat = np.zeros(int(batch.response_len.sum()), np.float32)
            if per_micro or not len(batch):
                out: list = [None] * len(batch)
                for (micro, _, _), rows in zip(items, per_micro):
                    for i, row in zip(micro, rows):
                        out[i] = row
                flat = np.concatenate(out).astype(np.float32) if len(batch) else flat
            if self.pipeline is not None:
                flat = self.pipeline.broadcast_from_last(flat).astype(np.float32)
            return np.split(flat, np.cumsum(batch.response_len)[:-1]) if len(batch) else []
        finally:
            self.model.train()

    def _inputs(self, mb: SampleBatch):
        """What every stage builds for a micro-batch: the shared-prompt layout, or the padded tokens."""
        if self.share_prompts:
            return shared_prompt.build_layout(mb.ragged("prompt_tokens"), mb.ragged("response_tokens"),
                                              mb.prompt_id).to(self.device)
        tokens, _, _ = pack_micro_batch(mb)
        return tokens.to(self.device)

    def _forward(self, model, inputs) -> torch.Tensor:
        """The stage's output: values on the last stage ([S, 1] on the stream, [B, T, 1] padded), hidden states
        before it."""
        if self.share_prompts:
            return shared_prompt.forward_shared(model, inputs)
        return megatron_model.forward_logits(model, inputs[:, :-1])

    def _aligned(self, mb: SampleBatch, inputs, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, R] float32 values of each sample's response tokens (left-aligned) from the last stage's output,
        and their mask."""
        if self.share_prompts:
            return shared_prompt.gather_rows(output, inputs.source)[..., 0].float(), inputs.mask
        width = int(mb.response_len.max()) if len(mb) else 0
        index = torch.zeros(len(mb), width, dtype=torch.long)
        mask = torch.zeros(len(mb), width)
        for i, (p, n) in enumerate(zip(mb.prompt_len, mb.response_len)):
            index[i, :n] = torch.arange(p - 1, p - 1 + n)
            mask[i, :n] = 1.0
        return output[..., 0].float().gather(1, index.to(output.device)), mask.to(output.device)

    def _rows(self, item, output: torch.Tensor) -> list[np.ndarray]:
        _, mb, inputs = item
        values, _ = self._aligned(mb, inputs, output)
        return [row[:n] for row, n in zip(values.cpu().numpy(), mb.response_len)]

    def update_values(self, batch: SampleBatch, old_values: list[np.ndarray], returns: list[np.ndarray],
                      plan: UpdatePlan) -> CriticStats:
        """`plan.epochs` passes, one optimizer step per mini-batch: the clipped value loss against `returns`,
        clipped within `train.critic.value_clip` of `old_values` (the values the advantages were computed with).
        With pipeline stages Megatron's 1F1B schedule runs each mini-batch and the last stage's sums are reported."""
        stats = CriticStats()
        self.model.train()
        for _ in range(plan.epochs):
            for index, totals in zip(plan.minibatches, plan.totals):
                self._zero_grads()
                items = [(micro, batch.select(micro)) for micro in micro_batches(batch, index, self.cfg)]
                items = [(micro, mb, self._inputs(mb)) for micro, mb in items]

                def loss(item, output, totals=totals):
                    micro = item[0]
                    return self._value_loss(item, output, [old_values[i] for i in micro], [returns[i] for i in micro],
                                            plan.keep[micro], totals)

                if self.pipeline is None:
                    sums = []
                    for item in items:
                        value, got = loss(item, self._forward(self.model, item[2]))
                        with self._backward_layout(item[2]):
                            value.backward()  # a recomputed layer (train.recompute) attends on the same stream
                        sums.append(got)
                        ACTIVITY.progress()
                else:
                    sums = self._pipeline_run(items, loss)
                for got in sums:
                    stats.loss, stats.clipped, stats.tokens = (a + b for a, b in zip(
                        (stats.loss, stats.clipped, stats.tokens), got))
                stats.grad_norm += self._optimizer_step()
                stats.optimizer_steps += 1
        if self.pipeline is not None:  # the last stage computed the losses: every stage reports its numbers
            stats.loss, stats.clipped, stats.tokens = (float(x) for x in self.pipeline.broadcast_from_last(
                np.array([stats.loss, stats.clipped, stats.tokens])))
        steps = max(stats.optimizer_steps, 1)
        stats.loss /= steps
        stats.grad_norm /= steps
        stats.clipped /= plan.epochs
        stats.tokens /= plan.epochs
        return stats

    def _pipeline_run(self, items, loss) -> list:
        recompute = self.share_prompts and self.cfg.recompute != "none"
        try:
            return self.pipeline.run(self.model, items, lambda model, item: self._forward(model, item[2]), loss,
                                     on_backward=(lambda item: shared_prompt.set_backward_layout(item[2]))
                                     if recompute else None)
        finally:
            if recompute:
                shared_prompt.set_backward_layout(None)

    def _backward_layout(self, inputs):
        return shared_prompt.active(inputs) if self.share_prompts else contextlib.nullcontext()

    def _value_loss(self, item, output: torch.Tensor, old: list[np.ndarray], returns: list[np.ndarray],
                    keep: np.ndarray, totals) -> tuple[torch.Tensor, tuple[float, float, float]]:
        """A micro-batch's share of the mini-batch's value loss, and its (loss, clipped tokens, tokens) sums."""
        _, mb, inputs = item
        v_new, mask = self._aligned(mb, inputs, output)
        width = v_new.shape[1]
        v_old = shared_prompt.padded(old, width).to(v_new.device)
        ret = shared_prompt.padded(returns, width).to(v_new.device)
        mask = mask * torch.from_numpy(keep).to(mask)[:, None]  # train.mask_truncated: out of this loss too
        # tool results carry no value loss; at `critic.level: turn` only a turn's first token does
        level = self.cfg.critic.level
        positions = [value_positions(m, level).astype(np.float32) for m in mb.ragged("response_mask")]
        mask = mask * shared_prompt.padded(positions, width).to(mask)
        per_token, clipped = value_loss(v_new, v_old, ret, self.cfg.critic.value_clip)
        loss = aggregate(per_token, mask, "token-mean", totals)
        return loss, (float(loss.detach()), float((clipped.to(mask.dtype) * mask).sum()), float(mask.sum()))
