"""Per-token log-probabilities and entropies from (possibly vocab-parallel) logits, differentiably.

    logits = megatron_model.forward_logits(model, input_ids)          # [B, T, V / tp]
    logp, entropy = token_logprobs_and_entropy(
        logits[:, :-1], input_ids[:, 1:], tp_group=parallel_state.get_tensor_model_parallel_group(),
        vocab_size=hf_config.vocab_size)

Memory is bounded at real vocab sizes: at V = 151,936 one fp32 copy of [8, 4096, V] logits is ~20 GB,
so nothing here is computed on the whole tensor. Forward and backward walk the B*T positions in chunks
of at most ``CHUNK_BYTES`` of fp32 [rows, V_local] scratch; the forward keeps only per-position
statistics (max, log Z, E_p[z]) and the backward recomputes each chunk's softmax and writes the
analytic gradient straight into one buffer of the logits' shape and dtype. Peak extra memory is that
gradient plus a few chunks, whatever B*T is.

With ``parallel_output=True`` a Megatron GPTModel returns each TP rank's slice of the vocab; the
softmax normaliser, the entropy sum and the target logit therefore need an all-reduce across the TP
group (one MAX for the shift, one SUM for the three sums). The backward is that of Megatron's
``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward): every TP rank
computes the same loss from the reduced values, so the gradient w.r.t. a rank's local partial sum is
the gradient w.r.t. the total, and each rank's local gradient uses the global log Z and E_p[z].
"""
from __future__ import annotations

from typing import Any

import torch

CHUNK_BYTES = 256 * 2**20
"""fp32 scratch per chunk of positions; forward and backward each hold about two such blocks."""


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: Any = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(targets)`` and the entropy of each position's distribution, both [B, T] in fp32.

    Args:
        logits: [B, T, V_local] in any float dtype (computed in fp32 chunk by chunk); this rank's
            contiguous vocab slice (rank r holds ids ``[r * V_local, (r + 1) * V_local)``), or the
            full vocab when ``tp_group`` is None.
        targets: [B, T] global token ids.
        tp_group: the tensor-parallel group the vocab is split over; None for unsplit logits.
        vocab_size: the real vocab; columns at or past it are padding, excluded, and get zero gradient.
        temperature: the sampling temperature of the rollout, so that ``logp`` scores the
            distribution the tokens were actually drawn from.
        chunk_tokens: positions per chunk; by default as many as fit ``CHUNK_BYTES`` of fp32.
    """
    tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
    width = logits.shape[-1]
    vocab_start = tp_rank * width
    valid = width if vocab_size is None else min(width, vocab_size - vocab_start)
    assert valid > 0, f"TP rank {tp_rank} holds only vocab padding ({vocab_start=}, {vocab_size=})"
    rows = chunk_tokens or max(1, CHUNK_BYTES // (4 * valid))
    group = tp_group if tp_size > 1 else None
    return _ChunkedLogprobs.apply(logits, targets, group, vocab_start, valid, float(temperature), rows)


class _ChunkedLogprobs(torch.autograd.Function):
    """For z = logits / T, p = softmax(z): logp_t = z_t - log Z and H = log Z - sum_j p_j z_j.

    d logp_t / dz_j = [j == t] - p_j and dH / dz_j = -p_j (z_j - E_p[z]); both are shift-invariant,
    so the backward works on the max-shifted chunk and reuses the forward's per-position statistics.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, valid, temperature, rows):
        # Division rounds monotonically, so max(x) / T is exactly max(x / T); no fp32 copy is needed.
        shift = logits[..., :valid].amax(dim=-1).float().div_(temperature).reshape(-1)
        if group is not None:
            torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
        local_ids = targets.reshape(-1).to(shift.device) - vocab_start
        owned = (local_ids >= 0) & (local_ids < valid)
        local_ids = local_ids.clamp(0, valid - 1)
        # [sum exp(s), sum exp(s) * s, s_target] per position, s = z - shift
        sums = torch.zeros(3, shift.numel(), dtype=torch.float32, device=shift.device)
        for lo, hi, block in _chunks(logits, rows):
            s = _shifted(block, valid, temperature, shift[lo:hi, None])
            sums[2, lo:hi] = s.gather(1, local_ids[lo:hi, None])[:, 0]
            e = s.exp()
            sums[0, lo:hi] = e.sum(dim=-1)
            sums[1, lo:hi] = e.mul_(s).sum(dim=-1)
            del s, e
        sums[2].masked_fill_(~owned, 0.0)
        if group is not None:
            torch.distributed.all_reduce(sums, group=group)
        log_z = sums[0].log()
        expected = sums[1] / sums[0]  # E_p[s]
        ctx.save_for_backward(logits, local_ids, owned, shift, log_z, expected)
        ctx.valid, ctx.temperature, ctx.rows = valid, temperature, rows
        shape = logits.shape[:-1]
        return (sums[2] - log_z).view(shape), (log_z - expected).view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, local_ids, owned, shift, log_z, expected = ctx.saved_tensors
        valid, temperature = ctx.valid, ctx.temperature
        grad_logp = _flat_or_zeros(grad_logp, shift)
        grad_entropy = _flat_or_zeros(grad_entropy, shift)
        target_grad = torch.where(owned, grad_logp, torch.zeros_like(grad_logp))
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad[..., valid:] = 0  # padding columns
        flat_grad = grad.view(-1, grad.shape[-1])
        in_place = grad.dtype == torch.float32 and temperature == 1.0  # the chunk's gradient computed where it goes
        for lo, hi, block in _chunks(logits, ctx.rows):
            out = flat_grad[lo:hi, :valid]
            s = _shifted(block, valid, temperature, shift[lo:hi, None], out=out if in_place else None)
            p = torch.sub(s, log_z[lo:hi, None]).exp_()
            # dz = dlogp * (onehot - p) - dH * p * (s - E_p[s])
            #    = onehot * dlogp - p * (dlogp + dH * (s - E_p[s]))
            # the sign folded into the factors: (s - E) * -dH - dlogp is -((s - E) * dH + dlogp) bit for bit
            g = s.sub_(expected[lo:hi, None]).mul_(grad_entropy[lo:hi, None].neg()).sub_(grad_logp[lo:hi, None])
            g = g.mul_(p)
            g.scatter_add_(1, local_ids[lo:hi, None], target_grad[lo:hi, None])
            if not in_place:
                out.copy_(g.div_(temperature))
            del s, p, g
        return grad, None, None, None, None, None, None


def _shifted(block: torch.Tensor, valid: int, temperature: float, shift: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The chunk's real columns in fp32, over T, minus each row's `shift`: a new tensor (or `out`, fp32), never
    the input. At T = 1 one pass (the subtraction widens a lower-precision block as it reads it); otherwise, or
    for a float64 block, an fp32 copy divided, then shifted (x / 1 is x, so both give the same bits)."""
    real = block[:, :valid]
    if temperature == 1.0 and torch.promote_types(real.dtype, torch.float32) == torch.float32:  # not float64
        return torch.sub(real, shift, out=out) if out is not None else torch.sub(real, shift)
    scaled = real.to(torch.float32, copy=True).div_(temperature).sub_(shift)
    return scaled if out is None else out.copy_(scaled)


def _flat_or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad.reshape(-1).float()


def _chunks(logits: torch.Tensor, rows: int):
    """(first, end, [end - first, V_local] view) over the flattened positions, in order, without copies."""
    offset = 0
    for block in _row_blocks(logits):
        for lo in range(0, block.shape[0], rows):
            view = block[lo:lo + rows]
            yield offset + lo, offset + lo + view.shape[0], view
        offset += block.shape[0]


def _row_blocks(t: torch.Tensor) -> list[torch.Tensor]:
    """2-D views covering t's positions in row-major order; sliced inputs (``logits[:, :-1]``) cannot
    be viewed as one [B*T, V] matrix without a copy, so they split along the leading dimension."""
    if t.dim() <= 2:
        return [t.reshape(-1, t.shape[-1])]
    try:
        return [t.view(-1, t.shape[-1])]
    except RuntimeError:
        return [block for sub in t.unbind(0) for block in _row_blocks(sub)]
