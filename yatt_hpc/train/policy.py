"""The trainer's policy: a Megatron-Core GPTModel shard, AdamW (`optim/adamw.py`), and one RL update on a batch.

    policy = MegatronPolicy.from_hf(model_dir, tp_rank, tp_size, cfg.train)   # after initialize_model_parallel
    policy.set_lr(lr)                                                         # this step's rate
    stats = policy.update(batch, advantages, plan)                            # samples of this DP replica
    for name, tensor in policy.hf_weights(): ...                              # collective over the TP group

The update runs `plan.epochs` passes; each pass one optimizer step per mini-batch
(`train/step_plan.py`), its samples in micro-batches of `train.micro_batch_size` samples or packed to
`train.max_tokens_per_micro_batch` (`train/step_plan.py`), each micro-batch's loss the policy loss of
`train.loss_mode` aggregated by `train.loss_agg_mode` with the KL and entropy terms (`yatt_hpc/algos/`).
Data parallelism is plain: each DP replica computes gradients on its own samples, every aggregate is already divided by the
mini-batch's global counts, so an all-reduce SUM over the DP group gives the exact gradient of the
whole mini-batch's loss. (Megatron's DDP and optimizer hard-code CUDA; on GPU the same code runs
with NCCL.)

Mixed precision (`model.dtype: bfloat16`): the Megatron model holds bf16 parameters (forward,
backward, weight sync and the engines all in bf16); AdamW runs on fp32 master copies. After a
backward the bf16 gradients are moved into fp32 master gradients, reduced and clipped there (with one
data-parallel replica, nothing to reduce, one parameter at a time: `train/optimizer_step.py`); the
optimizer steps the masters and the bf16 parameters are rounded from them. Checkpoints hold the
fp32 masters, so a resumed bf16 run continues from exactly the same state.

Pipeline parallelism (`placement.trainer.pp > 1`): this rank holds one stage (`train/pipeline.py`); each
mini-batch's micro-batches run through Megatron's 1F1B schedule, the last stage computes their losses, and
the reference's log-probabilities (KL in the loss) come from a forward-only pass of the reference's stages
before the update. The update's statistics are the last stage's, broadcast to the others.

A vision-language policy (Qwen2-VL): each update decodes every group's images once, from the encoded
bytes the batch carries, into pixel values on this rank (`vision/processor.py`); every micro-batch's
forward gets its rows' pixels, grids and M-RoPE positions. The vision tower trains only with
`train.train_vision_tower` (then it is in the optimizer, the DP all-reduce and the weight sync).
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from yatt_hpc.algos.aggregate import Totals, aggregate
from yatt_hpc.algos.kl import kl_estimate
from yatt_hpc.algos.policy_loss import token_loss
from yatt_hpc.batch import SampleBatch
from yatt_hpc.config.schema import TrainConfig
from yatt_hpc.device.offload import HostParking
from yatt_hpc.lora.layers import Lora
from yatt_hpc.metrics.activity import ACTIVITY
from yatt_hpc.models.hf_config import load_hf_config
from yatt_hpc.moe.layers import ExpertLoad, set_aux_loss_scale
from yatt_hpc.moe.lockstep import ExpertLockstep
from yatt_hpc.moe.routing_replay import RoutingReplay
from yatt_hpc.optim.adamw import AdamW
from yatt_hpc.optim.sharded import ShardedAdamW
from yatt_hpc.train import convert, megatron_model, shared_prompt, update_images
from yatt_hpc.train.hf_arch import describe_hf_config, refuse_unsupported_moe
from yatt_hpc.train.logprobs import token_logprobs_and_entropy
from yatt_hpc.train.mcore import parallel_state
from yatt_hpc.train.megatron_model import pipeline_stage
from yatt_hpc.train.optimizer_step import OptimizerStep, master_copy
from yatt_hpc.train.pipeline import PipelineStages, StageUpdate
from yatt_hpc.train.step_plan import (
    UpdatePlan,
    forward_tokens,
    micro_batches,
    pack_micro_batch,
    response_aligned,
    whole_batch_plan,
)
from yatt_hpc.vision.processor import ImageProcessor


@dataclass
class UpdateStats:
    loss: float
    kl: float
    entropy: float
    clip_frac: float
    grad_norm: float
    tokens: float
    logp_diff_max: float = 0.0  # max |trainer logp - rollout logp| before the update: weight-sync health
    optimizer_steps: int = 0
    micro_batch_tokens_max: int = 0  # the largest micro-batch forward, in tokens (train/step_plan.py)
    expert_load: np.ndarray | None = None  # a MoE policy: [layers, experts] tokens routed in the update, this replica
    routing_agreement: np.ndarray | None = None  # train.moe_routing_replay: [routed alike, replayed] (token, layer)s


@dataclass(frozen=True)
class LossTerms:
    """What a micro-batch's loss needs beyond its tensors: the mini-batch's global counts and the weights."""

    totals: Totals
    kl_coef: float
    norm_len: float


def load_hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model directory (safetensors only: loading never runs code)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(model_dir / name)))
    return state


class MegatronPolicy(StageUpdate, OptimizerStep):
    def __init__(self, model, hf_config, cfg: TrainConfig, reference=None, temperature: float = 1.0,
                 images: ImageProcessor | None = None, share_prompts: bool = False, lora: Lora | None = None):
        self.model = model
        self.lora = lora  # train.lora: adapters on a frozen base (yatt_hpc/lora/); the reference is the base
        self.share_prompts = share_prompts  # the shared-prompt forward (train/shared_prompt.py)
        self.hf_config = hf_config
        self.cfg = cfg
        self.reference = reference
        self.images = images  # a vision-language policy's image processor, else None
        self.vocab_size = hf_config.get_text_config().vocab_size
        self.moe = describe_hf_config(hf_config, 1).moe is not None  # its aux loss's scale, per mini-batch
        self.expert_load = ExpertLoad(model) if self.moe else None  # tokens per expert, for metrics
        # train.moe_routing_replay: the policy's forwards send response tokens to the engine's experts
        self.replay = RoutingReplay(model) if cfg.moe_routing_replay else None
        # placement.trainer.ep > 1: this rank's experts, and the expert group's forwards kept in step
        self.experts = expert_rank()
        self.lockstep = ExpertLockstep.of(model) if self.moe else None
        self.named_params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # not a frozen tower
        for name, p in self.named_params.items():  # an expert-parallel rank's own experts: reduced over their holders
            p.expert_parallel = self.experts.count > 1 and convert.is_expert(name)
        self.mixed = any(p.dtype != torch.float32 for p in self.named_params.values())
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pipeline = PipelineStages() if parallel_state.get_pipeline_model_parallel_world_size() > 1 else None
        # train.shard_optimizer: AdamW state (and a bf16 model's fp32 masters) split over the DP ranks
        self.sharded = cfg.shard_optimizer and torch.distributed.get_world_size(self.dp_group) > 1
        if self.sharded and self.experts.count > 1:
            raise ValueError(f"train.shard_optimizer=true with placement.trainer.ep={self.experts.count}: the sharded "
                             "optimizer splits every parameter over all data-parallel ranks, and an expert-parallel "
                             "rank's experts are its own; set train.shard_optimizer=false or placement.trainer.ep=1")
        if self.sharded:
            self.master = {}
            self.optimizer = ShardedAdamW(self.named_params, self.dp_group, lr=cfg.lr, betas=cfg.adam_betas,
                                          eps=cfg.adam_eps, weight_decay=cfg.weight_decay, mixed=self.mixed)
        else:
            # fp32 masters for a bf16 model (the optimizer's parameters); the model's own otherwise
            self.master = {name: master_copy(p) for name, p in self.named_params.items()} if self.mixed \
                else self.named_params
            self.optimizer = AdamW(self.master.values(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   betas=cfg.adam_betas, eps=cfg.adam_eps)
        # the rollout's sampling temperature: logprobs score the distribution the tokens came from
        self.temperature = temperature
        self._parking = HostParking()

    @classmethod
    def from_hf(cls, model_dir: str | Path, tp_rank: int, tp_size: int, cfg: TrainConfig,
                dtype: torch.dtype = torch.float32, temperature: float = 1.0) -> MegatronPolicy:
        model_dir = Path(model_dir)
        hf_config = load_hf_config(model_dir)
        refuse_unsupported_moe(describe_hf_config(hf_config, tp_size), cfg.lora.enabled, cfg.recompute,
                               parallel_state.get_pipeline_model_parallel_world_size())
        hf_state = load_hf_state_dict(model_dir)
        shard = convert.hf_to_megatron(hf_state, hf_config, tp_rank, tp_size, pipeline_stage(), expert_rank())
        vision = hasattr(hf_config, "vision_config")
        if cfg.train_vision_tower and not vision:
            raise ValueError(f"train.train_vision_tower=true but model.path={str(model_dir)!r} has no vision tower "
                             "(config.json has no vision_config); drop the setting or use a vision-language model")
        model = megatron_model.build_gpt_model(hf_config, tp_size, params_dtype=dtype,
                                               train_vision=cfg.train_vision_tower,
                                               recompute=megatron_model.Recompute.of(cfg))
        megatron_model.load_megatron_shard(model, shard)
        lora = None
        if cfg.lora.enabled:  # the base frozen, adapters on it; with the adapters off it is the KL reference
            lora = Lora.attach(model, describe_hf_config(hf_config, tp_size), cfg.lora, cfg.seed, tp_rank, tp_size,
                               pipeline_stage(), recompute_full=cfg.recompute == "full")
        reference = None
        if cfg.kl_coef > 0:
            reference = model if lora is not None else megatron_model.build_gpt_model(hf_config, tp_size,
                                                                                       params_dtype=dtype)
        if reference is not None and lora is None:
            megatron_model.load_megatron_shard(reference, shard)
            reference.eval().requires_grad_(False)
        images = ImageProcessor.from_model_dir(model_dir) if vision else None
        return cls(model, hf_config, cfg, reference, temperature=temperature, images=images,
                   share_prompts=cfg.share_prompts, lora=lora)

    # ------------------------------------------------------------------ the update

    def set_lr(self, lr: float) -> None:
        """The learning rate of the coming optimizer steps (`yatt_hpc/algos/schedule.py` decides it per RL step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def update(self, batch: SampleBatch, advantages: list[np.ndarray] | np.ndarray,
               plan: UpdatePlan | None = None) -> UpdateStats:
        """`plan.epochs` passes over this replica's samples, one optimizer step per mini-batch of each.
        `advantages` holds one array per sample, one value per response token (or one number per sample, for
        every token of it). No plan: this process holds the whole batch (`whole_batch_plan`)."""
        if isinstance(advantages, np.ndarray):
            advantages = [np.full(n, a, np.float32) for a, n in zip(advantages, batch.response_len)]
        if plan is None:
            plan = whole_batch_plan(batch, self.cfg)
        totals = UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        # the pipeline's reference term: every sample's reference log-probs, before the update
        reference = self.reference_logprobs(batch) if self.pipeline is not None and self.reference is not None \
            and plan.kl_coef else None
        self.model.train()
        pixels = self._group_pixels(batch)
        steps = 0
        for _ in range(plan.epochs):
            for index, counts in zip(plan.minibatches, plan.totals):
                terms = LossTerms(counts, plan.kl_coef, plan.norm_len)
                self._zero_grads()
                micros = list(micro_batches(batch, index, self.cfg))
                # ep > 1: agreed before any forward, as the expert group's other collectives follow
                idle = self.lockstep.missing(len(micros)) if self.lockstep is not None else 0
                if self.moe:  # the load-balancing loss: its mean over the mini-batch's micro-batches
                    set_aux_loss_scale(len(micros), self.dp_group)
                for micro in micros:
                    totals.micro_batch_tokens_max = max(totals.micro_batch_tokens_max, forward_tokens(
                        batch.prompt_len[micro], batch.response_len[micro], batch.prompt_id[micro], self.share_prompts))
                if self.pipeline is None:
                    every = (self._micro_step(batch.select(micro), [advantages[i] for i in micro], plan.keep[micro],
                                              terms, pixels) for micro in micros)
                else:
                    every = self._pipeline_steps(batch, micros, advantages, plan.keep, terms, reference)
                for stats in every:
                    ACTIVITY.progress()
                    for key in ("loss", "kl", "entropy", "clip_frac", "tokens"):
                        setattr(totals, key, getattr(totals, key) + getattr(stats, key))
                    if steps == 0:  # only the first optimizer step scores the weights the rollout sampled with
                        totals.logp_diff_max = max(totals.logp_diff_max, stats.logp_diff_max)
                for _ in range(idle):  # ep > 1: as many micro-steps as the busiest rank of the expert group
                    self.lockstep.idle_step(self.model, self.reference if self.reference is not None and terms.kl_coef
                                            else None)
                totals.grad_norm += self._optimizer_step()
                steps += 1
        if self.pipeline is not None:  # the last stage computed the losses: every stage reports its numbers
            keys = ("loss", "kl", "entropy", "clip_frac", "tokens", "logp_diff_max")
            shared = self.pipeline.broadcast_from_last(np.array([getattr(totals, k) for k in keys]))
            for key, value in zip(keys, shared):
                setattr(totals, key, float(value))
        for key in ("kl", "entropy", "clip_frac", "tokens"):  # sums over the samples, once each
            setattr(totals, key, getattr(totals, key) / plan.epochs)
        if self.expert_load is not None:  # collective over tp: every rank of the replica takes it
            totals.expert_load = self.expert_load.take().numpy()
        if self.replay is not None:  # collective over tp, as above
            totals.routing_agreement = self.replay.take_agreement()
        totals.loss /= max(steps, 1)  # the mean over optimizer steps of each mini-batch's loss
        totals.grad_norm /= max(steps, 1)
        totals.optimizer_steps = steps
        return totals

    def reference_logprobs(self, batch: SampleBatch) -> list[np.ndarray]:
        """The frozen reference's log-probability of every response token, one array per sample (the KL
        in the reward); collective over the TP group, like a forward."""
        with self._as_reference():
            return self.logprobs_of(self.reference, batch)

    def proximal_logprobs(self, batch: SampleBatch) -> list[np.ndarray]:
        """The policy's own log-probability of every response token under its current weights (decoupled PPO's
        proximal policy, `train.off_policy.proximal: recompute`), one array per sample, without gradients."""
        self.model.eval()  # no dropout in the layers we build; eval keeps recomputation out of a no-grad pass
        try:
            return self.logprobs_of(self.model, batch)
        finally:
            self.model.train()

    @torch.no_grad()
    def logprobs_of(self, model, batch: SampleBatch) -> list[np.ndarray]:
        """`model`'s log-probability of every response token, one array per sample; every pipeline stage gets
        them."""
        if self.pipeline is not None:
            return self._pipeline_logprobs(model, batch)
        out: list[np.ndarray | None] = [None] * len(batch)
        pixels = self._group_pixels(batch)
        micros = list(micro_batches(batch, np.arange(len(batch)), self.cfg))
        idle = self.lockstep.missing(len(micros)) if self.lockstep is not None else 0  # ep > 1, before any forward
        for micro in micros:
            mb = batch.select(micro)
            if self.share_prompts:
                layout = shared_prompt.build_layout(mb.ragged("prompt_tokens"), mb.ragged("response_tokens"),
                                                    mb.prompt_id)
                vision = None if self.images is None else \
                    update_images.shared_inputs(self.images, mb, layout, pixels, self.device)
                with self._replayed(model, mb, layout):
                    logp, _ = self._shared_logprobs(model, layout.to(self.device), vision)
                rows = [row[:n] for row, n in zip(logp.float().cpu().numpy(), mb.response_len)]
            else:
                tokens, _, _ = pack_micro_batch(mb)
                tokens = tokens.to(self.device)
                inputs, targets = tokens[:, :-1], tokens[:, 1:]
                with self._replayed(model, mb, inputs.shape[1]):
                    logits = megatron_model.forward_logits(model, inputs, images=self.vision_inputs(mb, inputs, pixels))
                logp, _ = token_logprobs_and_entropy(logits, targets, self.tp_group, self.vocab_size, self.temperature)
                padded = logp.float().cpu().numpy()
                rows = [padded[i, p - 1:p - 1 + n] for i, (p, n) in enumerate(zip(mb.prompt_len, mb.response_len))]
            for i, row in zip(micro, rows):
                out[i] = row
            ACTIVITY.progress()
        for _ in range(idle):  # as many forwards as the busiest rank of the expert group
            self.lockstep.idle_forward(model)
        return out

    def _replayed(self, model, mb: SampleBatch, layout: shared_prompt.SharedLayout | int):
        """The policy's forward of `mb` with the engine's experts (train.moe_routing_replay): `layout` is the
        shared-prompt stream's, or the padded inputs' width. The reference keeps its own routing."""
        if self.replay is None or model is not self.model:
            return contextlib.nullcontext()
        if isinstance(layout, int):
            return self.replay.padded(mb, layout)
        return self.replay.shared(mb, layout)

    def _as_reference(self):
        """The reference's forwards: with LoRA the reference is the policy's own model with its adapters off."""
        return self.lora.disabled() if self.lora is not None else contextlib.nullcontext()

    @property
    def layout_note(self) -> str:
        """How the update lays out its micro-batches (the trainer's start-up log says it)."""
        return "each prompt once per micro-batch" if self.share_prompts else "padded rows (train.share_prompts=false)"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _group_pixels(self, batch: SampleBatch) -> update_images.Pixels:
        """{prompt_id: (pixel values, grids)} of every group with images, decoded once per group here."""
        return {} if self.images is None else update_images.group_pixels(self.images, batch)

    def vision_inputs(self, mb: SampleBatch, inputs: torch.Tensor,
                      pixels: update_images.Pixels) -> megatron_model.VisionInputs | None:
        """The padded micro-batch's pixels, grids and M-RoPE positions (None for a text policy)."""
        return None if self.images is None else \
            update_images.padded_inputs(self.images, mb, inputs, pixels, self.device)

    def _micro_step(self, mb: SampleBatch, adv: list[np.ndarray], keep: np.ndarray, terms: LossTerms,
                    pixels: update_images.Pixels) -> UpdateStats:
        if self.share_prompts:
            return self._shared_micro_step(mb, adv, keep, terms, pixels)
        tokens, mask, old_logp = pack_micro_batch(mb)
        adv_tok = response_aligned(mb.prompt_len, adv, mask.shape[1])
        tokens, mask, old_logp, adv_tok = (t.to(self.device) for t in (tokens, mask, old_logp, adv_tok))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        images = self.vision_inputs(mb, inputs, pixels)
        with self._replayed(self.model, mb, inputs.shape[1]):
            logits = megatron_model.forward_logits(self.model, inputs, images=images)
        if self.expert_load is not None:  # the real tokens' experts: positions before each row's last token
            lengths = torch.as_tensor(mb.prompt_len + mb.response_len - 1, device=inputs.device)
            self.expert_load.count(torch.arange(inputs.shape[1], device=inputs.device)[None] < lengths[:, None])
        logp, entropy = token_logprobs_and_entropy(logits, targets, self.tp_group, self.vocab_size,
                                                   self.temperature)
        ref_logp = None
        if self.reference is not None and terms.kl_coef:
            with torch.no_grad(), self._as_reference():
                ref_logits = megatron_model.forward_logits(self.reference, inputs, images=images)
                ref_logp, _ = token_logprobs_and_entropy(ref_logits, targets, self.tp_group,
                                                         self.vocab_size, self.temperature)
        return self._loss_backward(logp, entropy, ref_logp, old_logp, mask, adv_tok, keep, terms)

    def _shared_micro_step(self, mb: SampleBatch, adv: list[np.ndarray], keep: np.ndarray, terms: LossTerms,
                           pixels: update_images.Pixels) -> UpdateStats:
        """`_micro_step` on the shared-prompt stream: [N, R] response-aligned logprobs instead of [N, L-1]."""
        layout = shared_prompt.layout_of(mb)  # the loss mask leaves out the tokens the model did not sample
        old_logp = shared_prompt.padded(mb.ragged("logprobs"), layout.targets.shape[1])
        adv_tok = shared_prompt.padded(adv, layout.targets.shape[1])
        vision = None if self.images is None else \
            update_images.shared_inputs(self.images, mb, layout, pixels, self.device)
        layout, old_logp, adv_tok = layout.to(self.device), old_logp.to(self.device), adv_tok.to(self.device)
        with self._replayed(self.model, mb, layout):
            logp, entropy = self._shared_logprobs(self.model, layout, vision)
        if self.expert_load is not None:  # every stream token is real: a shared prompt's tokens count once
            self.expert_load.count(torch.ones(1, layout.tokens.shape[0], dtype=torch.bool, device=layout.tokens.device))
        ref_logp = None
        if self.reference is not None and terms.kl_coef:
            with torch.no_grad(), self._as_reference():
                ref_logp, _ = self._shared_logprobs(self.reference, layout, vision)
        with shared_prompt.active(layout):  # a recomputed layer (train.recompute) attends on the same stream
            return self._loss_backward(logp, entropy, ref_logp, old_logp, layout.mask, adv_tok, keep, terms)

    def _shared_logprobs(self, model, layout: shared_prompt.SharedLayout,
                         vision: megatron_model.VisionInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
        positions = decoder_input = None
        if vision is not None:  # this model's own embeddings and tower (the reference's are frozen copies)
            positions = vision.position_ids
            decoder_input = megatron_model.vision_decoder_input(model, layout.tokens[None], vision)
        logits = shared_prompt.forward_shared(model, layout, positions, decoder_input, rows=layout.source)
        return token_logprobs_and_entropy(logits, layout.targets, self.tp_group, self.vocab_size, self.temperature)

    def _loss_backward(self, logp, entropy, ref_logp, old_logp, mask, adv_tok, keep: np.ndarray,
                       terms: LossTerms) -> UpdateStats:
        """The micro-batch's share of the aggregated loss (`yatt_hpc/algos/`), backward; sums for the metrics."""
        loss, stats = self._loss(logp, entropy, ref_logp, old_logp, mask, adv_tok, keep, terms)
        loss.backward()
        return stats

    def _loss(self, logp, entropy, ref_logp, old_logp, mask, adv_tok, keep: np.ndarray,
              terms: LossTerms) -> tuple[torch.Tensor, UpdateStats]:
        """The micro-batch's share of the aggregated loss (`yatt_hpc/algos/`) and its sums for the metrics."""
        cfg = self.cfg
        diff = float(((logp.detach() - old_logp).abs() * mask).max()) if mask.any() else 0.0
        mask = mask * torch.from_numpy(keep).to(mask)[:, None]  # train.mask_truncated: out of the loss
        per_token, clipped = token_loss(cfg.loss_mode, logp, old_logp, adv_tok, mask, clip_low=cfg.clip_low,
                                        clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c)
        kl_tok = kl_estimate(cfg.kl_estimator, logp, ref_logp) if ref_logp is not None else None
        if kl_tok is not None:
            per_token = per_token + terms.kl_coef * kl_tok
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy
        loss = aggregate(per_token, mask, cfg.agg_mode, terms.totals, norm_len=terms.norm_len)
        with torch.no_grad():
            m = mask.to(logp.dtype)
            return loss, UpdateStats(loss=loss.item(), kl=float((kl_tok * m).sum()) if kl_tok is not None else 0.0,
                               entropy=float((entropy * m).sum()), clip_frac=float((clipped.to(m.dtype) * m).sum()),
                               grad_norm=0.0, tokens=float(m.sum()), logp_diff_max=diff)

    # ------------------------------------------------------------------ full colocation

    def release_memory(self) -> None:
        """Give the device back for the other groups' phases: parameters (policy and reference) and
        optimizer state move to reused pinned host buffers (`yatt_hpc.device.offload`), gradients are dropped.
        The round trip is a copy, so a released-and-resumed policy trains bitwise like one that stayed.
        CPU runtime: the gradients are freed (each update zeroes them first), the rest stays."""
        self._zero_grads()  # the next update starts from none anyway; on CPU this is all that is freed
        if self.device.type != "cuda":
            return
        self._parking.release((self.model, self.reference), self._adamw, self._master_list())

    def resume_memory(self) -> None:
        if torch.cuda.is_available():
            self._parking.resume((self.model, self.reference), self._adamw,
                                 torch.device("cuda", torch.cuda.current_device()), self._master_list())

    @property
    def _adamw(self) -> AdamW:
        return self.optimizer.inner if self.sharded else self.optimizer

    def _master_list(self) -> list[torch.Tensor]:
        if not self.mixed:
            return []  # the parameters themselves (a sharded optimizer re-views them at each step)
        return list(self.optimizer.master.values() if self.sharded else self.master.values())

    # ------------------------------------------------------------------ weights out

    def hf_weights(self, experts_only: bool = False):
        """(hf_name, tensor) of the full model; collective over the TP group (all TP ranks iterate). With LoRA the
        weights are merged (base + scaling x B A), so the engines need no adapter support. Under ep > 1 the
        experts are this rank's own; `experts_only`: those alone."""
        return convert.iter_gathered_hf_weights(self.model, self.hf_config, self.tp_group,
                                                vision=self.cfg.train_vision_tower, stage=pipeline_stage(),
                                                local=None if self.lora is None else self.lora.merged_state(self.model),
                                                experts=self.experts, experts_only=experts_only)


def expert_rank() -> convert.Experts:
    """This rank's share of a MoE model's experts (all of them unless placement.trainer.ep > 1)."""
    return convert.Experts(parallel_state.get_expert_model_parallel_rank(),
                           parallel_state.get_expert_model_parallel_world_size())

