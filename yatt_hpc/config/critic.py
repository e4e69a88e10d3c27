"""`train.critic`: PPO's value model and its GAE settings (with `train.adv_estimator: gae`).

    train:
      adv_estimator: gae
      critic: {lr: 1e-5, lam: 0.95, value_clip: 0.5, warmup_steps: 2}

Part of the typed configuration (`yatt_hpc.config.schema.TrainConfig.critic`); the formulas are
`yatt_hpc/algos/gae.py`, the model and its update `yatt_hpc/critic/`, the guide docs/critic.md. The critic has
the policy's trainer layout (tp, pp, dp) and its own AdamW, learning rate and schedule; the policy's micro-batch,
mini-batch, epoch, recompute and share_prompts settings shape its passes too.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from yatt_hpc.config.section import Section


class CriticConfig(Section):
    """The value model of `adv_estimator: gae` (ignored by nothing: every field is refused without it)."""

    path: str | None = None
    """Hugging Face directory the value model starts from. null: the policy's `model.path` (a new value head on
    the policy's weights, verl's default). A causal LM directory gives its decoder and a new head; a reward or
    value model saved as `*ForSequenceClassification` or `*ForTokenClassification` with one label (num_labels 1)
    gives its decoder and its head (`score`/`classifier`). It must read the policy's tokens: the same vocabulary
    size as the policy (checked before launch)."""
    head_init_std: float = Field(0.0, ge=0)
    """A new value head's weight is drawn from N(0, head_init_std^2) (seeded by train.seed, the same on every
    rank), its bias 0; 0 starts it at zero, so the first values are 0 and the decoder learns from the second
    optimizer step. Not used when `path` holds a head."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE's lambda (verl `algorithm.lam`, TRL `lam`); gamma is `train.gamma`. 1 with gamma 1 makes A_t = R - V_t."""
    level: Literal["token", "turn"] = "token"
    """Where GAE's steps are. `token`: every token the model sampled is an action, V_t its value (verl, TRL,
    OpenRLHF). `turn`: every model turn of a multi-turn trajectory is one action (its tokens a run of
    `response_mask` 1s), valued at its first token; the reward and the per-token penalties of a turn are summed,
    gamma and lambda discount from turn to turn, every token of a turn takes its turn's advantage, and only a
    turn's first token carries the value loss. A single-turn response is one turn: A = R - V at its first token."""
    whiten_advantages: bool = True
    """Whiten the GAE advantages over every response token of the global batch (verl and TRL's PPOTrainer always
    do); false keeps them as GAE gives them."""
    value_clip: float | None = Field(0.5, gt=0)
    """PPO's value clip: the new value is held within value_clip of the value before the update in the
    loss's second term (verl `critic.cliprange_value`, 0.5; TRL `cliprange_value`, 0.2); null: no clip."""
    warmup_steps: int = Field(0, ge=0)
    """RL steps at the start in which only the critic trains: the policy is not updated (its weights and
    optimizer stay), so the first policy step has a fitted baseline (OpenRLHF `freezing_actor_steps`)."""
    lr: float = Field(1e-5, gt=0)
    """The critic's AdamW peak learning rate (verl `critic.optim.lr`)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """RL steps of linear warmup of the critic's rate: step s trains at lr x (s + 1) / lr_warmup_steps."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: `constant`, or `linear` / `cosine` decay from lr to min_lr at lr_decay_steps."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """The RL step at which the critic's decay reaches min_lr; null: train.steps."""
    min_lr: float = Field(0.0, ge=0)
    """The floor of the critic's `linear` and `cosine` decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """The critic's AdamW (beta1, beta2)."""
    adam_eps: float = Field(1e-8, gt=0)
    """The critic's AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """The critic's AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip of the critic's update; 0 disables clipping."""

    @model_validator(mode="after")
    def _fields_agree(self) -> CriticConfig:
        default = CriticConfig.model_fields
        if self.lr_decay == "constant":
            for f in ("lr_decay_steps", "min_lr"):
                if getattr(self, f) != default[f].default:
                    raise ValueError(f"train.critic.{f}={getattr(self, f)} shapes a decay, but train.critic.lr_decay="
                                     f"constant; set train.critic.lr_decay to linear or cosine, or drop "
                                     f"train.critic.{f}")
        if self.min_lr > self.lr:
            raise ValueError(f"train.critic.min_lr={self.min_lr:g} is above train.critic.lr={self.lr:g}; the floor "
                             "of the decay must be below the peak")
        for name, beta in zip(("beta1", "beta2"), self.adam_betas):
            if not 0 <= beta < 1:
                raise ValueError(f"train.critic.adam_betas {name}={beta:g} must lie in [0, 1)")
        return self

    def optimizer_settings(self) -> dict:
        """The `TrainConfig` fields the critic's optimizer step reads, with the critic's values."""
        return {f: getattr(self, f) for f in ("lr", "lr_warmup_steps", "lr_decay", "lr_decay_steps", "min_lr",
                                                 "adam_betas", "adam_eps", "weight_decay", "grad_clip")}


def critic_problem(train) -> str | None:
    """Why `train`'s settings and its critic do not go together (None: they do); `TrainConfig`'s validator
    raises it."""
    default = CriticConfig()
    if train.adv_estimator != "gae":
        given = [f for f in CriticConfig.model_fields if getattr(train.critic, f) != getattr(default, f)]
        if given:
            return (f"train.critic.{given[0]}={getattr(train.critic, given[0])} configures the value model, which "
                    f"only train.adv_estimator=gae uses (it is {train.adv_estimator}); set train.adv_estimator=gae, "
                    f"or drop train.critic.{given[0]}")
        return None
    if train.lora.enabled:
        return (f"train.adv_estimator=gae with train.lora.rank={train.lora.rank}: the value model trains every "
                "parameter and LoRA is mapped for the policy only; set train.lora.rank=0")
    if train.critic.warmup_steps >= train.steps > 0:
        return (f"train.critic.warmup_steps={train.critic.warmup_steps} is not below train.steps={train.steps}: "
                "the policy would never train; lower train.critic.warmup_steps")
    return None
