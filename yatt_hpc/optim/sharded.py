"""The sharded optimizer (`train.shard_optimizer`, ZeRO stage 1): AdamW state split over the data-parallel ranks.

    pieces = shard_pieces([(name, shape), ...], ranks=dp)          # pure: the same split on every rank
    opt = ShardedAdamW(named_params, dp_group, lr=..., mixed=True)   # state of this rank's pieces only
    opt.step(grads)                 # grads: {name: fp32 gradient, already summed over the DP group}
    opt.state_tensors(); opt.load_state(full)                        # checkpoint shards, resume (any layout)

The parameters, in model order, are laid out as one flat buffer and cut into `dp` near-equal ranges, each
cut moved to the nearest row (dim 0) of the tensor it falls in, so every rank owns whole rows: a piece
is a row range of one parameter, a plain view. Each rank keeps the AdamW moments (and, for a bf16 model,
the fp32 master copy) of its pieces only: 8 (fp32) or 12 (bf16) bytes per parameter become 8/dp or 12/dp.

A step: every rank holds the whole gradient, summed over the DP group by the same bucketed all-reduce as
the unsharded path, and clips it by the same global norm; each rank steps its pieces (torch's AdamW on
views of the rows it owns) and writes them into its model parameters; then each owner broadcasts its
rows to the other ranks, in buckets. Adam is elementwise, so the weights after any number of steps are
bitwise the unsharded optimizer's (tests/mpi/test_sharded_optimizer.py holds it to that).

What differs from Megatron's distributed optimizer, on purpose: the gradient is all-reduced, not
reduce-scattered, so every rank keeps the full gradient and computes the clipping norm in the
unsharded order (exact equality, and the same code on gloo, which has no reduce-scatter); the cost is
the gradient's all-reduce plus the parameters' broadcast, about 1.5x the communication volume of
reduce-scatter + all-gather. The saving is the optimizer state, the larger term for AdamW.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from yatt_hpc.optim.adamw import AdamW
from yatt_hpc.optim.buckets import plan_buckets

BROADCAST_BUCKET_MB = 64


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) along dim 0 of parameter `name` (a 0-d tensor has one row)."""

    name: str
    lo: int
    hi: int


def rows_of(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def shard_pieces(shapes: list[tuple[str, tuple[int, ...]]], ranks: int) -> list[list[Piece]]:
    """Each rank's pieces: the flat layout of `shapes` cut at k x total / ranks, each cut moved to the
    nearest row boundary of its tensor. Pure and deterministic: every rank computes the same split."""
    total = sum(_numel(s) for _, s in shapes)
    bounds = [k * total // ranks for k in range(ranks + 1)]
    out: list[list[Piece]] = [[] for _ in range(ranks)]
    offset = 0
    for name, shape in shapes:
        rows, numel = rows_of(shape), _numel(shape)
        per_row = max(numel // rows, 1)
        cuts = [min(max(round((b - offset) / per_row), 0), rows) for b in bounds]
        cuts[0], cuts[-1] = 0, rows
        for k in range(ranks):
            if cuts[k + 1] > cuts[k]:
                out[k].append(Piece(name, cuts[k], cuts[k + 1]))
        offset += numel
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _rows(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    return t.reshape(1)[piece.lo:piece.hi] if t.dim() == 0 else t[piece.lo:piece.hi]


class ShardedAdamW:
    """AdamW over this DP rank's pieces of `named` (see the module doc). `mixed`: the model's parameters are
    bf16, and this rank keeps fp32 masters of its pieces."""

    def __init__(self, named: dict[str, torch.Tensor], group, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, mixed: bool = False) -> None:
        self.named, self.group, self.mixed = named, group, mixed
        self.rank = torch.distributed.get_rank(group)
        self.size = torch.distributed.get_world_size(group)
        self.plan = shard_pieces([(n, tuple(p.shape)) for n, p in named.items()], self.size)
        self.mine = self.plan[self.rank]
        # the tensors AdamW steps: fp32 copies of this rank's rows (bf16 model), else views of the parameters
        self.master = {pc: _rows(named[pc.name].detach(), pc).float().clone() if mixed
                       else _rows(named[pc.name].detach(), pc) for pc in self.mine}
        if not self.master:  # more ranks than rows: this rank owns nothing (and steps nothing)
            self.master = {Piece("", 0, 0): torch.zeros(0)}
        self.inner = AdamW(self.master.values(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def register_step_pre_hook(self, hook) -> None:
        self.inner.register_step_pre_hook(hook)

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> None:
        """Step this rank's pieces with their rows of `grads` (fp32, whole, DP-summed, clipped), write them into
        the model's parameters, then broadcast every owner's rows to the others."""
        for pc, master in self.master.items():
            if pc.name and not self.mixed:  # the parameter may have moved (device parking): view it afresh
                master.data = _rows(self.named[pc.name].data, pc)
            master.grad = _rows(grads[pc.name], pc) if pc.name else torch.zeros(0)
        self.inner.step()
        for pc, master in self.master.items():
            master.grad = None
            if self.mixed and pc.name:
                _rows(self.named[pc.name].data, pc).copy_(master)
        self._broadcast()

    def _broadcast(self) -> None:
        for owner, pieces in enumerate(self.plan):
            src = torch.distributed.get_global_rank(self.group, owner)
            views = [_rows(self.named[pc.name].data, pc) for pc in pieces]
            for bucket in plan_buckets(views, BROADCAST_BUCKET_MB * 2**20):
                members = [views[i] for i in bucket]
                flat = torch.cat([v.reshape(-1) for v in members]) if owner == self.rank else \
                    torch.empty(sum(v.numel() for v in members), dtype=members[0].dtype, device=members[0].device)
                torch.distributed.broadcast(flat, src=src, group=self.group)
                if owner != self.rank:
                    at = 0
                    for v in members:
                        v.copy_(flat[at:at + v.numel()].view_as(v))
                        at += v.numel()

    # ------------------------------------------------------------------ checkpoints

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """This rank's rows: ``{"<param>.exp_avg" | ".exp_avg_sq" | ".step" | ".master": tensor}`` and metadata
        naming each parameter's row range (`ckpt.optim.assemble_state` puts the ranks' files back together)."""
        state = self.inner.state
        tensors: dict[str, torch.Tensor] = {}
        rows: dict[str, list[int]] = {}
        for pc, master in self.master.items():
            if not pc.name:
                continue
            rows[pc.name] = [pc.lo, pc.hi, rows_of(tuple(self.named[pc.name].shape))]
            if self.mixed:
                tensors[f"{pc.name}.master"] = master
            for key, value in state.get(master, {}).items():
                tensors[f"{pc.name}.{key}"] = value
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        return tensors, {"param_groups": json.dumps(groups), "rows": json.dumps(rows)}

    @torch.no_grad()
    def load_masters(self, shard: dict[str, torch.Tensor]) -> None:
        """bf16 model: this rank's fp32 masters from whole parameters (a checkpoint's model file, or weights)."""
        if self.mixed:
            for pc, master in self.master.items():
                if pc.name:
                    master.copy_(_rows(shard[pc.name], pc))

    @torch.no_grad()
    def load_state(self, full: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """This rank's rows of a whole-parameter state (`assemble_state`'s output: ``<param>.<key>``, and
        ``<param>.master`` when the run was bf16 and sharded, else the masters stay as `load_masters` set them)."""
        live = self.inner.param_groups[0]
        if "param_groups" in meta:
            saved = json.loads(meta["param_groups"])[0]
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in saved:
                    live[key] = tuple(saved[key]) if key == "betas" else saved[key]
        self.inner.state = {}
        for pc, master in self.master.items():
            if not pc.name:
                continue
            if self.mixed and f"{pc.name}.master" in full:
                master.copy_(_rows(full[f"{pc.name}.master"], pc))
            if f"{pc.name}.exp_avg" not in full:
                continue  # no step taken yet when saved: AdamW creates the state at the first step
            step = full[f"{pc.name}.step"]
            self.inner.state[master] = {
                "step": torch.as_tensor(step, dtype=torch.float32).reshape(()).to(  # a copy: stepped in place
                    master.device if live["fused"] else "cpu").clone(),
                "exp_avg": _rows(full[f"{pc.name}.exp_avg"], pc).to(master).clone(),
                "exp_avg_sq": _rows(full[f"{pc.name}.exp_avg_sq"], pc).to(master).clone()}
