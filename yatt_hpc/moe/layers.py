"""Megatron-Core's MoE layer and router as the trainer runs them, and what it counts of their routing.

    build_gpt_model(...) swaps them in: TokenSplitMoELayer under tp > 1 or ep > 1, LocalTopKRouter always
    load = ExpertLoad(model)                 # tokens per expert of every MoE layer (moe/ metrics)
    set_aux_loss_scale(micros, dp_group)     # the load-balancing loss's weight in the coming backwards
    rows = router_rows(x, len(routed), fill) # [S, B, ...] laid out as this rank's routers see its tokens

Token layouts. A router sees its MoE layer's input flattened S-major. Under tp alone each tensor rank routes
its slice of the sequence zero-padded to a multiple of tp (sequence parallelism's split). Under expert
parallelism (ep > 1) the ranks of an expert group exchange tokens with Megatron's all-gather dispatcher, whose
collectives need every rank's token count equal: each MoE layer flattens its input to [S·B, 1, H], agrees on
the largest count of the group (one all-reduce per layer call), zero-pads to it (a multiple of tp) and, under
tp, hands each tensor rank its contiguous slice. `router_rows` is the one place either layout is written down.
The rows added are routed and dispatched like tokens (their output is dropped) and left out of the
load-balancing loss (Megatron's router `padding_mask`), so the loss is the unpadded layout's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from yatt_hpc.train.cpu_compat import is_cpu_runtime
from yatt_hpc.train.mcore import MoELayer, TopKRouter, parallel_state, tensor_parallel


def expert_parallel_size() -> int:
    """placement.trainer.ep as Megatron built it (1 before `initialize_model_parallel`)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_expert_model_parallel_world_size()


def router_rows(x: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """`x` ([S, B, ...], the layer input's token order) as this rank's routers see it: `rows` rows, padded
    rows set to `fill`."""
    if not parallel_state.model_parallel_is_initialized():  # one process, no model parallelism
        return x.reshape(-1, *x.shape[2:])
    group = parallel_state.get_tensor_model_parallel_group()
    tp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if expert_parallel_size() > 1:
        flat = x.reshape(-1, *x.shape[2:])
        flat = torch.cat([flat, flat.new_full((rows * tp - flat.shape[0], *flat.shape[1:]), fill)])
        return flat.chunk(tp)[rank] if tp > 1 else flat
    if tp > 1:
        x = torch.cat([x, x.new_full((-x.shape[0] % tp, *x.shape[1:]), fill)]).chunk(tp)[rank]
    return x.reshape(-1, *x.shape[2:])


class _OneRankGroup:
    """Answers ``size() == 1`` to MoELayer's guard against tp > 1 without sequence parallelism."""

    def size(self) -> int:
        return 1


class TokenSplitMoELayer(MoELayer):
    """Megatron's MoELayer under tp > 1 without sequence parallelism (which the local spec's torch norms refuse,
    torch_norm.py), and under expert parallelism with inputs of any shape.

    MoELayer expects [S/tp, B, H] (it refuses training otherwise: its dispatcher gathers tokens over tp x ep, so
    the replicated [S, B, H] would reach every expert tp times). Under tp the sequence is zero-padded to a multiple
    of tp, scattered (backward: all-gather), run through the layer, and gathered back (backward: this rank's
    slice), which is sequence parallelism's region around one MLP. Under ep the input is flattened and padded to
    the expert group's largest token count first (the module docstring), so ranks whose micro-batches differ in
    shape meet in the same collectives. The padded rows are routed like tokens, but count neither in the
    load-balancing loss (computed as Megatron computes it under sequence parallelism, with its padding mask), nor
    in a real token's output, nor in `ExpertLoad`. The router, which now sees only this rank's tokens, sums its gradient over tp
    (`LocalTopKRouter`).

    A shared expert (Qwen2-MoE) runs on the whole unsplit input, before any padding: it is Megatron's
    ``SharedExpertMLP``, a tensor-parallel MLP whose column/row-parallel linears expect every tensor rank to hold
    the same tokens without sequence parallelism (input copied, output all-reduced), and its gate weight then sees
    every token on every rank (the same gradient on each, no sum over tp needed)."""

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        return None  # computed by forward on the unsplit input

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        if padding_mask is not None:
            raise NotImplementedError("TokenSplitMoELayer takes no padding_mask")
        group = parallel_state.get_tensor_model_parallel_group()
        tp = torch.distributed.get_world_size(group)
        shape = hidden_states.shape
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        if expert_parallel_size() > 1:
            tokens = shape[0] * shape[1]
            count = torch.tensor([tokens + (-tokens % tp)], dtype=torch.int64, device=hidden_states.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX,
                                         group=parallel_state.get_expert_tensor_and_model_parallel_group())
            hidden_states = hidden_states.reshape(tokens, 1, shape[2])
            pad = int(count.item()) - tokens
        else:
            tokens, pad = shape[0], -shape[0] % tp
        # [S', B] True on the rows added here: Megatron's router leaves them out of the load-balancing loss
        pads = torch.zeros(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
        if pad:
            hidden_states = F.pad(hidden_states, (0, 0, 0, 0, 0, pad))
            pads = F.pad(pads, (0, 0, 0, pad), value=True)
        if tp > 1:
            hidden_states = tensor_parallel.scatter_to_sequence_parallel_region(hidden_states, group=group)
            pads = pads.chunk(tp)[torch.distributed.get_rank(group)]
        out, bias = super().forward(hidden_states, intermediate_tensors, padding_mask=pads.t() if pad else None)
        if tp > 1:
            out = tensor_parallel.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False,
                                                                       group=group)
        out = out[:tokens].reshape(shape)
        return (out if shared is None else out + shared), bias


class LocalTopKRouter(TopKRouter):
    """Megatron's top-k router with its gate as a plain linear layer, computed in the input's dtype (or
    ``moe_router_dtype``). Megatron's ``gating`` moves the weight to CUDA on every call when it sits on CPU and
    calls ``router_gating_linear``, whose forward reads ``te_general_gemm``, a name defined only when Transformer
    Engine imports (moe/moe_utils.py); the local spec runs without it, on CPU and GPU alike."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        # under tp each rank routes its own tokens (TokenSplitMoELayer): the replicated weight's gradient is the
        # sum over tp (identity forward, all-reduce backward), as Megatron's finalize_model_grads would sum it
        weight = tensor_parallel.copy_to_tensor_model_parallel_region(
            self.weight, group=parallel_state.get_tensor_model_parallel_group())
        return F.linear(input.to(dtype), weight.to(dtype), bias)


def adopt_moe_modules(model: torch.nn.Module, tp_size: int) -> None:
    """Swap Megatron's router and (under tp or ep) MoE layer classes for the ones above."""
    split = tp_size > 1 or expert_parallel_size() > 1
    for module in model.modules():
        if type(module) is TopKRouter:
            module.__class__ = LocalTopKRouter
        if type(module) is MoELayer and split:
            module.__class__ = TokenSplitMoELayer
            module.attn_tp_group = _OneRankGroup()  # read only by the guard TokenSplitMoELayer answers


class ExpertLoad:
    """Tokens each expert of each MoE layer was given over the forwards counted, pad positions left out.

        load = ExpertLoad(model)          # hooks every router of `model` (none for a dense model)
        logits = forward_logits(model, inputs)
        load.count(valid)                 # valid: [B, T] bool, the inputs' real tokens
        load.take()                       # [layers, experts] float64 counts since the last take, summed over tp

    A router sees this rank's rows of the layer input (`router_rows`); `count` lays `valid` out the same way.
    A forward not followed by `count` (a shared-prompt stream, a forward-only pass) is dropped at the next
    forward's first router.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, LocalTopKRouter)]
        self.maps: list[torch.Tensor | None] = [None] * len(self.routers)
        self.counts = torch.zeros(len(self.routers), self.routers[0].config.num_moe_experts if self.routers else 0,
                                  dtype=torch.float64)
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._keep(index))

    def _keep(self, index: int):
        def hook(module, args, output) -> None:
            if index == 0:
                self.maps = [None] * len(self.routers)
            self.maps[index] = output[1].detach()  # routing_map [tokens, experts]
        return hook

    def count(self, valid: torch.Tensor) -> None:
        if not self.routers or self.maps[0] is None:
            return
        flat = router_rows(valid.t().to(self.maps[0].device), self.maps[0].shape[0], False)
        for index, routing in enumerate(self.maps):
            self.counts[index] += routing[flat].sum(0).to(torch.float64).cpu()
        self.maps = [None] * len(self.routers)

    def take(self) -> torch.Tensor:
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        group = parallel_state.get_tensor_model_parallel_group()
        if self.routers and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        return counts


def set_aux_loss_scale(micro_batches: int, dp_group: Any) -> None:
    """Scale the next backward passes' load-balancing loss by 1 / (the mini-batch's micro-batches on every dp rank).

    Megatron adds each MoE layer's aux loss in its backward (``MoEAuxLossAutoScaler``), times a process-wide factor
    its own schedules set to 1 / micro-batches. The trainer's loss of a micro-batch is already its share of the
    mini-batch loss (`yatt_hpc/algos/aggregate.py`) and dp ranks sum their gradients, so the aux loss enters as its
    mean over the mini-batch's micro-batches, times ``router_aux_loss_coef``. Collective over `dp_group` (once per
    mini-batch on every rank, as the optimizer step is).
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    count = torch.tensor([float(micro_batches)])
    if torch.distributed.get_world_size(dp_group) > 1:
        torch.distributed.all_reduce(count, group=dp_group)
    device = "cpu" if is_cpu_runtime() else torch.cuda.current_device()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / max(count.item(), 1.0), device=device))


@contextlib.contextmanager
def aux_loss_off() -> Iterator[None]:
    """Backwards inside add no load-balancing loss (an idle pass that only keeps an expert group in step)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    device = "cpu" if is_cpu_runtime() else torch.cuda.current_device()
    MoEAuxLossAutoScaler.set_loss_scale(torch.zeros((), device=device))
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
