"""The `train:` section: the policy update (estimator, loss, aggregation, KL, optimizer, schedule, micro-batches,
recompute), with its `train.off_policy:` part (the decoupled PPO objective and the importance-weight correction of
the gap between the engine that sampled and the trainer). `train.critic:` and `train.lora:` have modules of their
own (`config/critic.py`, `config/lora.py`).

    train:
      loss_mode: vanilla
      off_policy: {proximal: recompute, correction: token_truncate, cap: 2.0}

Part of the typed configuration (`yatt_hpc.config.schema.RunConfig.train`); the formulas are `yatt_hpc/algos/`
(off-policy: `algos/off_policy.py`), the guide docs/recipes.md.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from yatt_hpc.config.critic import CriticConfig, critic_problem
from yatt_hpc.config.lora import LoraConfig
from yatt_hpc.config.section import Section


class OffPolicyConfig(Section):
    """What the policy ratio is taken against, and how the engine/trainer gap is corrected."""

    proximal: Literal["engine", "recompute"] = "engine"
    """The ratio's old policy. `engine`: the engine's log-probabilities of the sampled tokens (the behavior
    policy; on-policy GRPO as today). `recompute`: the trainer's own log-probabilities under the weights before
    the update, computed in a forward pass over the step's samples (the proximal policy of decoupled PPO, AReaL
    `use_decoupled_loss`); the engine's are then used only for the importance weight of `correction`."""
    correction: Literal["none", "token_truncate", "sequence_truncate", "token_mask", "sequence_mask"] = "none"
    """The importance weight w = pi_proximal / pi_behavior on each token's policy-gradient term (not on the KL or
    entropy terms); TRL's `vllm_importance_sampling_mode` names. `token_truncate`: w_t capped at `cap` (TIS);
    `sequence_truncate`: the sequence's w = exp(sum_t log w_t), capped, on all its tokens; `token_mask`: w_t
    where it lies in [mask_low, mask_high], else 0 (IcePop); `sequence_mask`: the sequence's w, or 0 for every
    token when it lies outside. Needs `proximal: recompute`."""
    cap: float = Field(2.0, gt=0)
    """The truncation cap of `token_truncate` and `sequence_truncate` (verl, slime and WeChat-YATT use 2, TRL 3)."""
    mask_low: float = Field(0.5, ge=0)
    """The lower bound of w kept by `token_mask` and `sequence_mask`."""
    mask_high: float = Field(2.0, gt=0)
    """The upper bound of w kept by `token_mask` and `sequence_mask`."""

    @model_validator(mode="after")
    def _fields_agree(self) -> OffPolicyConfig:
        default = OffPolicyConfig.model_fields
        if self.correction != "none" and self.proximal != "recompute":
            raise ValueError(f"train.off_policy.correction={self.correction} weighs tokens by pi_proximal / "
                             "pi_behavior, and the proximal log-probabilities are the trainer's recomputed ones; set "
                             "train.off_policy.proximal=recompute, or train.off_policy.correction=none")
        truncate, mask = self.correction.endswith("truncate"), self.correction.endswith("mask")
        if self.cap != default["cap"].default and not truncate:
            raise ValueError(f"train.off_policy.cap={self.cap:g} caps a truncating correction, but "
                             f"train.off_policy.correction={self.correction}; use token_truncate or sequence_truncate, "
                             "or drop train.off_policy.cap")
        for f in ("mask_low", "mask_high"):
            if getattr(self, f) != default[f].default and not mask:
                raise ValueError(f"train.off_policy.{f}={getattr(self, f):g} bounds a masking correction, but "
                                 f"train.off_policy.correction={self.correction}; use token_mask or sequence_mask, "
                                 f"or drop train.off_policy.{f}")
        if not self.mask_low <= 1.0 <= self.mask_high:
            raise ValueError(f"train.off_policy.mask_low={self.mask_low:g} and mask_high={self.mask_high:g} must hold "
                             "w = 1 (the on-policy weight) between them: mask_low <= 1 <= mask_high")
        return self


class TrainConfig(Section):
    """The policy update: the advantage estimator, the policy loss and its aggregation, the KL to the
    reference, the optimizer and its schedule. Each choice is spelled as verl spells it; docs/recipes.md
    maps every one to verl's and TRL's options and gives the settings of GRPO, DAPO, Dr.GRPO, GSPO and CISPO."""

    steps: int = Field(20, ge=0)
    """Number of RL steps (generate -> score -> update) to run in total, across restarts."""
    seed: int = 0
    """Seed for model init noise, sampling and dropout; same seed, same run."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompt groups per step over all trainer data-parallel ranks (must divide by trainer dp)."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples per forward/backward on one trainer rank; gradients accumulate over micro-batches. With
    `max_tokens_per_micro_batch` it is the most samples a micro-batch holds."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token-budget micro-batches: each mini-batch's samples (and the reference's scoring) are packed into
    micro-batches of at most this many tokens of the forward (with `share_prompts`, each distinct prompt once
    plus its samples' response inputs; without, rows x the longest row), and at most `micro_batch_size`
    samples, so one long response no longer sets the size of every micro-batch. Longest samples first,
    first fit; a prompt group stays in one micro-batch where it fits. A sample longer than the budget gets a
    micro-batch of its own. The loss and gradients are the fixed-size path's (up to float summation order).
    0: fixed micro-batches of `micro_batch_size` samples."""
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"] = "grpo"
    """How rewards become advantages (`yatt_hpc/algos/advantages.py`): `grpo` (group mean and std; Dr.GRPO with
    `norm_adv_by_std: false`), `rloo` (leave-one-out group baseline), `reinforce_plus_plus` (batch-whitened
    returns), `reinforce_plus_plus_baseline` (group mean removed, then batch-whitened), `gae` (PPO: a value model,
    `train.critic`). A group of one sample, or of equal rewards, gets advantage 0 under every group estimator."""
    norm_adv_by_std: bool = True
    """`grpo` only: divide by the group's reward std; false is Dr.GRPO (verl `norm_adv_by_std_in_grpo`)."""
    adv_std: Literal["sample", "population"] = "sample"
    """`grpo` only: the group std, `sample` (ddof 1, as verl, TRL, slime and NeMo-RL) or `population` (ddof 0)."""
    adv_eps: float = Field(1e-6, gt=0)
    """`grpo` with `norm_adv_by_std` only: added to the group std (outside the square root)."""
    gamma: float = Field(1.0, gt=0, le=1)
    """`reinforce_plus_plus` and `gae` only: the discount of their per-token returns."""
    loss_mode: Literal["vanilla", "gspo", "cispo"] = "vanilla"
    """The per-token policy loss (`yatt_hpc/algos/policy_loss.py`): `vanilla` (PPO's clipped ratio, with
    clip-higher and the optional dual clip), `gspo` (the sequence-level ratio, clipped per sequence), `cispo`
    (the clipped importance weight, detached, times the log-probability)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] | None = None
    """How per-token losses add up over the global batch (`yatt_hpc/algos/aggregate.py`): `token-mean`,
    `seq-mean-token-mean`, `seq-mean-token-sum`, or `seq-mean-token-sum-norm` (Dr.GRPO: the token sum over
    batch size x rollout.max_new_tokens). Exact over the whole batch however samples are split over ranks and
    micro-batches. null: the loss mode's own (`seq-mean-token-mean` for gspo, else `token-mean`)."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """Ratio clip below 1: rho = pi / pi_old is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = Field(0.28, ge=0)
    """Ratio clip above 1 (DAPO's clip-higher when larger than clip_low)."""
    clip_ratio_c: float | None = Field(None, gt=1)
    """`vanilla` only: the dual clip's bound (> 1): a negative advantage's loss is capped at -A x clip_ratio_c
    (verl `clip_ratio_c`, which is 3.0 there by default); null turns it off."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL to the frozen reference policy (the initial weights); 0 skips the reference model.
    In the loss (default) or subtracted from the reward (`kl_in_reward`)."""
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    """The per-token KL estimate (`yatt_hpc/algos/kl.py`): `k1` = log pi - log pi_ref, `k2` = its square / 2,
    `k3` = exp(-d) + d - 1 (verl `low_var_kl`), `k3+` = k3's value with k2's gradient."""
    kl_in_reward: bool = False
    """Subtract kl_coef x the per-token KL (of the sampling policy to the reference, scored before the update)
    from the reward, as verl `use_kl_in_reward` and the PPO tradition, instead of adding it to the loss."""
    kl_target: float | None = Field(None, gt=0)
    """An adaptive kl_coef (Ziegler et al.'s controller, verl `kl_ctrl.type=adaptive`): it starts at kl_coef and
    moves toward keeping the step's mean KL at this target; its value is in the checkpoint. null: fixed."""
    kl_horizon: int = Field(10000, ge=1)
    """The adaptive controller's horizon in samples (verl `kl_ctrl.horizon`)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus subtracted from the loss."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: samples cut at rollout.max_new_tokens are masked out of the loss (and of its
    token and sequence counts); counted as `train/truncated_masked` (TRL `mask_truncated_completions`, NeMo-RL
    `overlong_filtering`). Their rewards still count in their group's advantages."""
    epochs: int = Field(1, ge=1)
    """Passes over each step's samples (verl `ppo_epochs`, TRL `num_iterations`); 1 with one mini-batch is on-policy."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass: the step's prompt groups, in prompt-id order over the whole global batch, cut
    into this many mini-batches (verl's train batch / `ppo_mini_batch_size`). The ratio stays against the
    rollout's log-probabilities."""
    lr: float = Field(1e-4, gt=0)
    """AdamW's peak learning rate."""
    lr_warmup_steps: int = Field(0, ge=0)
    """RL steps of linear warmup: step s (from 0) trains at lr x (s + 1) / lr_warmup_steps."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: `constant`, or `linear` / `cosine` decay from lr to min_lr at lr_decay_steps."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """The RL step at which decay reaches min_lr; null: train.steps."""
    min_lr: float = Field(0.0, ge=0)
    """The floor of `linear` and `cosine` decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables clipping."""
    shard_optimizer: bool = False
    """ZeRO stage 1 (`optim/sharded.py`): split AdamW's moments (and a bf16 model's fp32 masters) over the
    data-parallel ranks, each updating its rows and broadcasting them; bitwise the same weights as unsharded,
    8 (fp32) or 12 (bf16) bytes per parameter become that / dp. Checkpoints hold one shard per DP rank."""
    balance: Literal["flops", "tokens", "none"] = "flops"
    """Data-parallel load balancing before the update: Karmarkar-Karp, then whole-group exchanges that
    lower the heaviest rank (`sched/balance.py::balanced_partition`), over a FLOPs proxy (a*L + L^2),
    over plain token counts, or none; with `share_prompts` a group's prompt counts once, as it is computed
    (`group_workload`). Whole GRPO groups move; a group is never split."""
    balance_flops_coeff: float | None = Field(None, gt=0)
    """`a` in the FLOPs proxy a*L + L^2; null derives 6*hidden_size from the model."""
    share_prompts: bool = True
    """Run each distinct prompt (and its images) through the trainer's forward once per micro-batch instead of
    once per sample (a GRPO group's samples share it; `train/shared_prompt.py`): the same logprobs and
    gradients from fewer tokens. False pads every sample to its own row."""
    moe_routing_replay: bool = False
    """Mixture-of-experts policies (docs/moe.md): the engine records the experts its routers chose for each prompt
    and response token, and the trainer's forward sends each token to those experts instead of its own router's top
    k (the routing probabilities, and the router's gradient, still come from the trainer's router). The hf engine
    only; refused with sglang, agent rollouts and partial rollouts."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation (Megatron-Core's; Korthikanti et al. 2022, arXiv 2205.05198): `none` keeps every
    activation for the backward; `selective` recomputes each layer's core attention in the backward (Megatron's
    recompute_granularity=selective, recompute_modules=[core_attn]): the attention scores and probabilities, which
    grow with the square of the sequence, are not kept; `full` keeps only the input of each checkpointed chunk of
    transformer layers and recomputes the chunk in the backward (recompute_granularity=full). Gradients are the
    same; each recomputed part runs its forward twice."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """`recompute: full` only (Megatron's recompute_method): `uniform` splits the layers into chunks of
    `recompute_num_layers` and keeps only each chunk's input; `block` recomputes the first
    `recompute_num_layers` layers one at a time and keeps the other layers' activations."""
    recompute_num_layers: int = Field(1, ge=1)
    """`recompute: full` only (Megatron's recompute_num_layers): layers per checkpointed chunk (`uniform`) or
    layers recomputed (`block`); at most the model's layer count, and a divisor of it for `uniform` (checked when
    the trainer builds the model)."""
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    """The ratio's old policy and the engine/trainer importance-weight correction."""
    train_vision_tower: bool = False
    """Vision-language policies (Qwen2-VL): train the vision tower too (it is then in the optimizer, the data-parallel
    all-reduce and the weight sync); false keeps it frozen and syncs only the language model. Refused for text."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of training every parameter (`config/lora.py`, docs/lora.md)."""
    critic: CriticConfig = CriticConfig()
    """PPO's value model and its GAE settings, for `adv_estimator: gae` (`config/critic.py`, docs/critic.md)."""

    @property
    def agg_mode(self) -> str:
        """The loss aggregation in effect (loss_agg_mode, or the loss mode's own)."""
        return self.loss_agg_mode or ("seq-mean-token-mean" if self.loss_mode == "gspo" else "token-mean")

    @model_validator(mode="after")
    def _recipe_fields_agree(self) -> TrainConfig:
        default = TrainConfig.model_fields
        if critic_problem(self):  # train.critic with adv_estimator gae, and nowhere else (config/critic.py)
            raise ValueError(critic_problem(self))
        grpo_fields = [f for f in ("norm_adv_by_std", "adv_std", "adv_eps") if getattr(self, f) != default[f].default]
        if grpo_fields and self.adv_estimator != "grpo":
            raise ValueError(f"train.{grpo_fields[0]}={getattr(self, grpo_fields[0])} only shapes the grpo estimator, "
                             f"but train.adv_estimator={self.adv_estimator}; drop train.{grpo_fields[0]}")
        for f in ("adv_std", "adv_eps"):
            if f in grpo_fields and not self.norm_adv_by_std:
                raise ValueError(f"train.{f}={getattr(self, f)} shapes the division by the group std, which "
                                 "train.norm_adv_by_std=false (Dr.GRPO) turns off; drop train." + f)
        if self.gamma != 1.0 and self.adv_estimator not in ("reinforce_plus_plus", "gae"):
            raise ValueError(f"train.gamma={self.gamma:g} discounts per-token returns (reinforce_plus_plus, gae), but "
                             f"train.adv_estimator={self.adv_estimator}; drop train.gamma")
        if self.loss_mode == "gspo" and self.agg_mode != "seq-mean-token-mean":
            raise ValueError(f"train.loss_mode=gspo with train.loss_agg_mode={self.loss_agg_mode}: GSPO's objective "
                             "is a mean over sequences of a sequence-level ratio, which another aggregation does not "
                             "define; use loss_agg_mode=seq-mean-token-mean (or leave it null)")
        if self.clip_ratio_c is not None and self.loss_mode != "vanilla":
            raise ValueError(f"train.clip_ratio_c={self.clip_ratio_c:g} is the dual clip of the vanilla loss, but "
                             f"train.loss_mode={self.loss_mode}; drop train.clip_ratio_c")
        kl_fields = [f for f in ("kl_estimator", "kl_in_reward", "kl_target")
                     if getattr(self, f) != default[f].default]
        if self.kl_coef == 0 and kl_fields:
            raise ValueError(f"train.{kl_fields[0]}={getattr(self, kl_fields[0])} shapes the KL term, but "
                             "train.kl_coef=0 turns it off; set train.kl_coef > 0, or drop "
                             f"train.{kl_fields[0]}")
        if self.kl_horizon != default["kl_horizon"].default and self.kl_target is None:
            raise ValueError(f"train.kl_horizon={self.kl_horizon} paces the adaptive KL controller, which "
                             "train.kl_target turns on; set train.kl_target, or drop train.kl_horizon")
        if self.lr_decay == "constant":
            for f in ("lr_decay_steps", "min_lr"):
                if getattr(self, f) != default[f].default:
                    raise ValueError(f"train.{f}={getattr(self, f)} shapes a decay, but train.lr_decay=constant; "
                                     f"set train.lr_decay to linear or cosine, or drop train.{f}")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr:g} is above train.lr={self.lr:g}; the floor of the decay "
                             "must be below the peak")
        if self.recompute != "full":
            for f in ("recompute_method", "recompute_num_layers"):
                if getattr(self, f) != default[f].default:
                    raise ValueError(f"train.{f}={getattr(self, f)} shapes full recomputation, but train.recompute="
                                     f"{self.recompute}; set train.recompute=full, or drop train.{f}")
        if self.mini_batches > self.prompts_per_step:
            raise ValueError(f"train.mini_batches={self.mini_batches} is more than train.prompts_per_step="
                             f"{self.prompts_per_step}: a mini-batch holds whole prompt groups; lower "
                             "train.mini_batches")
        if self.lora.enabled and self.train_vision_tower:
            raise ValueError(f"train.lora.rank={self.lora.rank} with train.train_vision_tower=true: LoRA is mapped for "
                             "the language model only; set train.lora.rank=0 to train the tower too, or drop "
                             "train.train_vision_tower")
        for name, beta in ((n, b) for n, b in zip(("beta1", "beta2"), self.adam_betas) if not 0 <= b < 1):
            raise ValueError(f"train.adam_betas {name}={beta:g} must lie in [0, 1)")
        return self


def recompute_layers_problem(train: TrainConfig, model_layers: int) -> str | None:
    """Why `train.recompute_num_layers` cannot act on a model of `model_layers` transformer layers (None: it can).
    Megatron would index layers past the last one (transformer_block.py `_checkpointed_forward`)."""
    if train.recompute != "full":
        return None
    layers = train.recompute_num_layers
    if layers > model_layers:
        return (f"train.recompute_num_layers={layers} is more than the model's {model_layers} transformer layers; "
                f"set train.recompute_num_layers to at most {model_layers}")
    if train.recompute_method == "uniform" and model_layers % layers:
        return (f"train.recompute_num_layers={layers} does not divide the model's {model_layers} transformer layers, "
                "and train.recompute_method=uniform checkpoints chunks of that many; use a divisor of "
                f"{model_layers}, or train.recompute_method=block")
    return None
