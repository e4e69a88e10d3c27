"""Gradient all-reduce in size-bounded buckets (the data-parallel sum of the trainer's gradients).

    allreduce_bucketed(grads, dp_group, GRAD_BUCKET_MB * 2**20)     # in place, SUM
"""
from __future__ import annotations

import torch

GRAD_BUCKET_MB = 64
"""Most gradient bytes per DP all-reduce: one collective per parameter is hundreds of small messages
per step on a real model, each paying the full latency; one per bucket costs a copy in and out."""


def plan_buckets(tensors: list[torch.Tensor], limit_bytes: int) -> list[list[int]]:
    """Indices of `tensors` grouped into all-reduce buckets, each of one dtype and device and at most
    `limit_bytes` (a tensor larger than that gets a bucket of its own), in parameter order. Pure, so
    every rank plans the same buckets from the same parameters and issues the same collectives."""
    done: list[list[int]] = []
    filling: dict[tuple, tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key, size = (t.dtype, t.device), t.numel() * t.element_size()
        members, used = filling.get(key, ([], 0))
        if members and used + size > limit_bytes:
            done.append(members)
            members, used = [], 0
        filling[key] = (members + [i], used + size)
    done.extend(members for members, _ in filling.values())
    return sorted(done, key=lambda bucket: bucket[0])


def allreduce_bucketed(tensors: list[torch.Tensor], group, limit_bytes: int) -> None:
    """In-place all-reduce SUM of `tensors` over `group`, one collective per `plan_buckets` bucket."""
    for bucket in plan_buckets(tensors, limit_bytes):
        members = [tensors[i] for i in bucket]
        if len(members) == 1 and members[0].is_contiguous():
            torch.distributed.all_reduce(members[0], group=group)
            continue
        flat = torch.cat([t.reshape(-1) for t in members])
        torch.distributed.all_reduce(flat, group=group)
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
