"""The policy's optimizer step and its state, mixed into `MegatronPolicy` (and so `MegatronCritic`): gradients
reduced over the data-parallel ranks (an expert's over the ranks that hold it), clipped by the global norm, AdamW
on the fp32 masters of a bf16 model or on the parameters, and what a checkpoint holds of them.

    policy._zero_grads(); ... backward ...; norm = policy._optimizer_step()
    policy.checkpoint_tensors(), policy.optimizer_state()             # a checkpoint's tensors of this rank
    policy.load_checkpoint_tensors(shard); policy.load_optimizer_state(full, meta)
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from yatt_hpc.ckpt.optim import load_optimizer_tensors, optimizer_tensors
from yatt_hpc.optim.buckets import GRAD_BUCKET_MB, allreduce_bucketed
from yatt_hpc.train import convert, megatron_model
from yatt_hpc.train.mcore import parallel_state
from yatt_hpc.train.pipeline import sync_tied_embeddings


class OptimizerStep:
    """`MegatronPolicy` provides `model`, `named_params`, `master`, `optimizer`, `sharded`, `mixed`, `lora`,
    `experts`, `pipeline`, the groups and `cfg`."""

    _scratch: torch.Tensor | None = None  # the streamed step's buffer for widened gradients, while it runs

    def drop_gradients(self) -> None:
        """Free the last update's gradients (the next update starts from none)."""
        self._zero_grads()

    def _zero_grads(self) -> None:
        for p in self.named_params.values():
            p.grad = None
        if not self.sharded:
            self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        """DP-sum the gradients, clip them by the global norm, step; the norm before clipping."""
        if self.pipeline is not None:
            sync_tied_embeddings(self.model)  # the first stage's embeddings and the last's head: one update
        if not self.sharded and self._streams_master_grads():
            return self._streamed_mixed_step()
        if not self.sharded:
            self._grads_to_master()
            self._allreduce_grads()
            norm = self._clip_grads([(p, p.grad) for p in self.master.values()])
            self.optimizer.step()
            self._master_to_model()
            return norm
        # the same fp32 gradients, sums and norm as the unsharded path; ShardedAdamW steps this rank's rows
        grads = {}
        for name, p in self.named_params.items():
            g = torch.zeros(p.shape, dtype=torch.float32, device=p.device) if p.grad is None else \
                p.grad.float() if self.mixed else p.grad
            grads[name], p.grad = g, None
        allreduce_bucketed(list(grads.values()), self.dp_group, GRAD_BUCKET_MB * 2**20)
        norm = self._clip_grads([(self.named_params[n], g) for n, g in grads.items()])
        self.optimizer.step(grads)
        return norm

    def _streams_master_grads(self) -> bool:
        """A bf16 model with nothing to reduce (one data-parallel replica, no expert-data-parallel peers): its
        fp32 master gradients are made one at a time inside the step (`_streamed_mixed_step`)."""
        if not self.mixed or torch.distributed.get_world_size(self.dp_group) > 1:
            return False
        return not (self.experts.count > 1 and
                    torch.distributed.get_world_size(parallel_state.get_expert_data_parallel_group()) > 1)

    def _streamed_mixed_step(self) -> float:
        """The step of `_optimizer_step` for a bf16 model at dp 1, without holding every fp32 master gradient
        at once (they are as large as the masters: 4 bytes a parameter, 2 GB at 0.5B): the norm is summed from
        the bf16 gradients widened one at a time, then each parameter's master gradient is made, clipped, stepped
        and dropped in turn. Every widened gradient is a view of one buffer the size of the largest parameter
        (a real vocabulary's embedding: 0.5 GB at 0.5B), taken once a step, so no larger block is ever asked of
        the allocator. Each value is the one the batched step computes (the widening is exact, the sums run in
        the same order, AdamW updates each parameter on its own), so the weights are bitwise the same."""
        names = [n for n, p in self.named_params.items() if p.grad is not None]
        if not names:
            return self._clip_grads([], scale_in_place=False)
        self._scratch = torch.empty(max(self.named_params[n].numel() for n in names), dtype=torch.float32,
                                    device=self.device)
        try:
            norm = self._clip_grads(((self.master[n], self.named_params[n].grad) for n in names), scale_in_place=False)
            scale = self._clip_scale(norm)
            for name in names:
                p, master = self.named_params[name], self.master[name]
                master.grad, p.grad = self._widened(p.grad), None
                if scale is not None:
                    master.grad.mul_(scale)
                self.optimizer.step()  # AdamW skips the parameters with no gradient: this one alone
                master.grad = None
                with torch.no_grad():
                    p.copy_(master)
        finally:
            self._scratch = None
        return norm

    def _widened(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` in fp32: in the step's buffer while `_streamed_mixed_step` holds one, else a new tensor."""
        if self._scratch is None:
            return grad.float()
        return self._scratch[: grad.numel()].view(grad.shape).copy_(grad)

    def _allreduce_grads(self) -> None:
        """SUM the gradients the optimizer will step over the DP group, in `GRAD_BUCKET_MB` buckets; under ep > 1
        an expert's over the ranks that hold it (Megatron's expert-data-parallel group: its tokens' gradients
        reached it from every rank of its expert group already, through the dispatcher's backward)."""
        if torch.distributed.get_world_size(self.dp_group) == 1:
            return
        dense, experts = [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:  # a replica with no samples this step still joins every all-reduce
                    p.grad = torch.zeros_like(p)
                (experts if getattr(p, "expert_parallel", False) else dense).append(p.grad)
        allreduce_bucketed(dense, self.dp_group, GRAD_BUCKET_MB * 2**20)
        expert_dp = parallel_state.get_expert_data_parallel_group()
        if experts and torch.distributed.get_world_size(expert_dp) > 1:
            allreduce_bucketed(experts, expert_dp, GRAD_BUCKET_MB * 2**20)

    def _grads_to_master(self) -> None:
        """bf16 model: move each gradient into its fp32 master (the model's own grads are dropped)."""
        if not self.mixed:
            return
        for name, p in self.named_params.items():
            master = self.master[name]
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def _master_to_model(self) -> None:
        if self.mixed:
            for name, p in self.named_params.items():
                p.copy_(self.master[name])

    def checkpoint_tensors(self, experts_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict with every parameter at full (master) precision (a sharded bf16 run: the
        bf16 parameters; its fp32 masters are in the optimizer shards, `optimizer_state`). Experts go under their
        model-wide numbers; `experts_only`: this expert-parallel rank's experts alone."""
        state = {k: v for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)
                 and (self.lora is None or k in self.named_params)}  # LoRA: the adapters (the base is model.path)
        if self.mixed and not self.sharded:
            state.update({name: m.detach() for name, m in self.master.items() if name in state})
        if experts_only:
            state = {k: v for k, v in state.items() if convert.is_expert(k)}
        return convert.experts_global(state, self.experts) if self.experts.count > 1 else state

    def load_checkpoint_tensors(self, shard: dict[str, torch.Tensor]) -> None:
        """Inverse of `checkpoint_tensors` (a converter shard works too): model and masters. Under ep > 1 `shard`
        holds every expert (`ckpt/loader.read_weights`); this rank takes its own."""
        if self.experts.count > 1:
            shard = convert.experts_local(shard, self.experts)
        if self.lora is not None:
            self.lora.load(self.model, shard)
        else:
            megatron_model.load_megatron_shard(self.model, shard)
        if self.mixed and self.sharded:
            self.optimizer.load_masters(shard)
        elif self.mixed:
            with torch.no_grad():
                for name, master in self.master.items():
                    master.copy_(shard[name])

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """This rank's optimizer file: ``{"<param>.<key>": tensor}`` and metadata (`yatt_hpc.ckpt.optim`); a
        sharded optimizer's rows carry their ranges (`optim/sharded.py`)."""
        if self.sharded:
            return self.optimizer.state_tensors()
        return optimizer_tensors(self.optimizer, self.master.items())

    @torch.no_grad()
    def load_optimizer_state(self, full: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """Whole-parameter optimizer state (`ckpt.optim.assemble_state` of the checkpoint's files, sharded or not), after
        `load_checkpoint_tensors`: ``<param>.master`` entries (a sharded bf16 run's) replace the masters."""
        if self.sharded:
            self.optimizer.load_state(full, meta)
            return
        for name, master in self.master.items():
            if self.mixed and f"{name}.master" in full:
                master.copy_(full[f"{name}.master"])
        state = {k: v for k, v in full.items() if not k.endswith(".master")}
        load_optimizer_tensors(self.optimizer, self.master.items(), state, meta)

    def _clip_grads(self, grads: Iterable[tuple[torch.Tensor, torch.Tensor | None]], scale_in_place: bool = True) -> float:
        """Global L2 norm over the whole (TP-sharded) model of the (parameter, gradient) pairs; clip the
        gradients to `grad_clip` if set (`scale_in_place`; else the caller scales them by `_clip_scale`)."""
        grads = list(grads) if scale_in_place else grads
        # summed on the parameters' device: NCCL reduces device tensors only, and one sync at the end
        sharded, replicated = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        experts = torch.zeros((), device=self.device)  # ep > 1: this rank's own experts (tp-split like dense MLPs)
        for p, g in grads:
            if g is None or getattr(p, "shared", False):  # the last stage's copy of tied embeddings: counted once
                continue
            # a lower-precision gradient's widened copy is squared in place (pow(2)'s values, no second temporary)
            sq = (g.detach().pow(2) if g.dtype == torch.float32 else self._widened(g.detach()).pow_(2)).sum()
            if getattr(p, "expert_parallel", False):
                experts += sq
            elif getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.experts.count > 1:  # every expert of the layer: the sum over the expert group
            torch.distributed.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
            sharded += experts
        if torch.distributed.get_world_size(self.tp_group) > 1:
            torch.distributed.all_reduce(sharded, group=self.tp_group)
        total = sharded + replicated
        if self.pipeline is not None:  # every stage's layers
            total = self.pipeline.sum(total)
        norm = math.sqrt(float(total))
        scale = self._clip_scale(norm)
        if scale is not None and scale_in_place:
            for _, g in grads:
                if g is not None:
                    g.mul_(scale)
        return norm

    def _clip_scale(self, norm: float) -> float | None:
        """The factor the gradients are clipped by at this norm (None: not clipped)."""
        if self.cfg.grad_clip and norm > self.cfg.grad_clip:
            return self.cfg.grad_clip / (norm + 1e-6)
        return None


def master_copy(p: torch.Tensor) -> torch.Tensor:
    master = p.detach().float().clone().requires_grad_(True)
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "expert_parallel"):  # clipping
        if hasattr(p, attr):
            setattr(master, attr, getattr(p, attr))
    return master
