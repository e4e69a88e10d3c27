"""What runs around the policy's update on a trainer rank, mixed into `TrainerController`: the critic's part of
the step (`train.adv_estimator: gae`) and decoupled PPO's proximal pass (`train.off_policy.proximal: recompute`).

    values = self.critic_values(batch)            # the critic's turn on the devices: V_t of every response token
    adv = self.advantages(batch, penalties)       # GAE on those values (else the estimator's), returns kept
    if self.policy_trains(step): policy.update     # train.critic.warmup_steps: the critic trains alone first
    self.critic_update(batch, step)               # the critic's second turn: the clipped value loss, AdamW

Each trainer rank holds its shard of the value model (same tensor and data-parallel groups as the policy) and
computes the values of its replica's samples: no driver, no extra messages. In full colocation the critic takes
the devices in turn with the policy (released and resumed like the policy, `roles/colocation.py`): once for the
values, once for its update after the policy's. Its tensors and AdamW state are in every checkpoint
(`critic-tp{t}-pp{p}.safetensors`, `critic-optim-tp{t}-pp{p}-dp{d}.safetensors`).

    batch, advantages, gap = self.off_policy(batch, advantages)   # the ratio against the trainer's own weights
"""
from __future__ import annotations

import numpy as np

from yatt_hpc.algos.advantages import Advantages
from yatt_hpc.algos.gae import value_positions, value_sums
from yatt_hpc.algos.off_policy import importance_weights
from yatt_hpc.batch import SampleBatch
from yatt_hpc.errors import InputError
from yatt_hpc.roles.colocation import holding_devices
from yatt_hpc.train.step_plan import (
    critic_lr,
    masked_behavior,
    plan_update,
    step_advantages,
    step_gae,
    value_tokens,
)


class UpdateSteps:
    """The critic's steps and the proximal pass; the controller provides cfg, stats, policy, the replica sums and
    the rank's coordinates."""

    critic = None
    _gae = None  # (old values, returns) of the step's samples, from `advantages` to `critic_update`

    def build_critic(self, tp: int) -> None:
        """The value model of `train.critic` on this rank (None without `adv_estimator: gae`)."""
        if self.cfg.train.adv_estimator != "gae":
            return
        from yatt_hpc.critic.update import MegatronCritic

        try:
            self.critic = MegatronCritic.from_run_config(self.cfg, self.tp_rank, tp)
        except ValueError as err:
            raise InputError(str(err)) from None
        if self.colocate:
            self.critic.release_memory()

    def critic_values(self, batch: SampleBatch) -> list[np.ndarray] | None:
        """V_t of every response token of this replica's samples (the critic's turn on the devices), or None."""
        if self.critic is None:
            return None
        with holding_devices(self.stats, self.critic, self.colocate), self.stats.phase("critic"):
            return self.critic.values(batch)

    def advantages(self, batch: SampleBatch, penalties, values: list[np.ndarray] | None) -> Advantages:
        """GAE on the critic's `values` (keeping the returns for `critic_update`), or `train.adv_estimator`'s."""
        tc = self.cfg.train
        if values is None:
            return step_advantages(batch, tc, penalties, reduce=self.sum_over_replicas)
        gae = step_gae(batch, values, tc, penalties, reduce=self.sum_over_replicas)
        self._gae = (values, gae.returns)
        return Advantages(gae.advantages, 0)

    def policy_trains(self, step: int) -> bool:
        """False in the critic's warm-up steps (`train.critic.warmup_steps`): the policy is left as it is."""
        return self.critic is None or step >= self.cfg.train.critic.warmup_steps

    def critic_update(self, batch: SampleBatch, step: int) -> None:
        """The critic's update on this step's returns (its second turn on the devices) and its metrics."""
        if self.critic is None:
            return
        values, returns = self._gae
        level = self.cfg.train.critic.level  # the value loss's token-mean counts the tokens it covers
        plan = plan_update(batch, self.cfg.train, self.cfg.rollout.max_new_tokens, gather=self.gather_over_replicas,
                           reduce=self.sum_over_replicas, tokens=value_tokens(batch, level))
        lr = critic_lr(step, self.cfg.train)
        with holding_devices(self.stats, self.critic, self.colocate), self.stats.phase("critic"):
            self.critic.set_lr(lr)
            stats = self.critic.update_values(batch, values, returns, plan)
        self._gae = None
        self.stats.values.update({"critic_lr": lr, "critic_grad_norm": stats.grad_norm})
        if self.is_owner:
            positions = [value_positions(m, level) for m in batch.ragged("response_mask")]
            sums = value_sums(values, returns, positions)  # where the value loss looks
            for key, value in zip(("critic_tokens", "critic_value_sum", "critic_ret_sum", "critic_ret_sq",
                                   "critic_err_sum", "critic_err_sq"), sums):
                self.stats.add(key, float(value))
            self.stats.add("critic_loss", stats.loss)
            self.stats.add("critic_clipped", stats.clipped)
            self.stats.add("critic_loss_tokens", stats.tokens)

    def warmup_stats(self):
        """The policy's statistics of a step it does not train (the critic's warm-up)."""
        from yatt_hpc.train.policy import UpdateStats  # Megatron: imported where the trainer builds its models

        return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    # ------------------------------------------------------------------ decoupled PPO

    def off_policy(self, batch: SampleBatch, values) -> tuple[SampleBatch, list[np.ndarray], float]:
        """The step's samples with the trainer's proximal log-probabilities in place of the engine's, their
        advantages weighted by `train.off_policy.correction` (`algos/off_policy.py`), and the largest
        |proximal - behavior| of this replica's tokens."""
        op = self.cfg.train.off_policy
        if isinstance(values, np.ndarray):
            values = [np.full(n, a, np.float32) for a, n in zip(values, batch.response_len)]
        proximal = self.policy.proximal_logprobs(batch)
        behavior = masked_behavior(batch, proximal)  # tokens the model did not sample: weight 1
        weights, stats = importance_weights(proximal, behavior, op.correction, op.cap, op.mask_low, op.mask_high)
        if self.is_owner:
            for key, value in zip(("is_tokens", "is_weight_sum", "is_weight_max", "is_truncated", "is_masked"),
                                  stats.as_array()):
                if key == "is_weight_max":
                    self.stats.values[key] = float(value)
                else:
                    self.stats.add(key, float(value))
        values = [a * w for a, w in zip(values, weights)]
        flat = np.concatenate(proximal).astype(np.float32) if len(batch) else np.zeros(0, np.float32)
        return batch.select(np.arange(len(batch)), logprobs=flat), values, stats.abs_log_ratio_max

    # ------------------------------------------------------------------ checkpoint

    def critic_state(self) -> dict:
        """The RankState fields of the critic: its parameters (dp rank 0 of the shard) and AdamW state."""
        if self.critic is None:
            return {}
        optim, meta = self.critic.optimizer_state()
        return {"critic": self.critic.checkpoint_tensors() if self.dp_rank == 0 else None,
                "critic_optim": optim, "critic_optim_meta": meta}

    def restore_critic(self, restored) -> None:
        """The critic of a checkpoint of this layout; a run with a critic needs one in its checkpoint."""
        if self.critic is None:
            return
        if not restored.critic:
            raise InputError(f"checkpoint step-{restored.step} holds no critic (it was written by a run without "
                             "train.adv_estimator=gae); resume it with its own estimator, or start a fresh --run-dir")
        self.critic.load_checkpoint_tensors(restored.critic)
        self.critic.load_optimizer_state(restored.critic_optim, restored.critic_optim_meta)
