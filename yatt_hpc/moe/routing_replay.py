"""The trainer's forward with the experts the engine chose for each response token (`train.moe_routing_replay`).

    replay = RoutingReplay(model)                     # every router of the policy, in layer order
    with replay.padded(mb, inputs.shape[1]):          # padded rows: inputs = pack_micro_batch's tokens[:, :-1]
        logits = forward_logits(model, inputs)
    with replay.shared(mb, layout):                   # the shared-prompt stream (train/shared_prompt.py)
        logits = forward_shared(model, layout)

Every token fed as an input goes to the experts the engine's routers chose for it (the batch's `routed_experts`,
recorded by `rollout/routing_record.py`): a prompt token to its prefill's, a response token to those of the
decode step it was fed to; pads and a response's last token keep the trainer's own top k. The shared-prompt
stream computes a group's prompt once, with the routing recorded for the group's first sample in the micro-batch.
As Megatron-Core's `RouterReplay` (REPLAY_FORWARD) and verl/slime's routing replay do, only the choice is
replayed: the routing probabilities are the trainer's router scores gathered at the replayed experts
(renormalised over them as the router's softmax does), so the router still gets its gradient. The
load-balancing loss counts the router's own top k, as Megatron's does under replay.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from yatt_hpc.batch import SampleBatch
from yatt_hpc.moe.layers import router_rows
from yatt_hpc.train.mcore import parallel_state

if TYPE_CHECKING:
    from yatt_hpc.train.shared_prompt import SharedLayout


class ReplayTopK:
    """A router's `router_replay` (Megatron's `RouterReplay.get_replay_topk` hook, moe_utils.py): the recorded
    experts where a token has them (its row of `target` not -1), the router's own top k elsewhere."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None  # [S, B, k] int64, -1: the router's own choice
        self.agreed = self.replayed = 0  # in forwards with gradients: tokens replayed, and those routed alike

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, top = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return probs, top
        target = router_rows(self.target, top.shape[0], -1).to(top.device)
        if target.shape != top.shape:
            raise RuntimeError(f"routing replay: {tuple(target.shape)} recorded experts for a router that routes "
                               f"{tuple(top.shape)}")
        recorded = target[:, 0] >= 0
        if torch.is_grad_enabled():  # the update's forwards: would the trainer's router have chosen the same?
            alike = (top.sort(1).values == target.sort(1).values).all(1)
            self.agreed += int((alike & recorded).sum())
            self.replayed += int(recorded.sum())
        top = torch.where(recorded[:, None], target, top)
        return scores.gather(1, top), top


class RoutingReplay:
    """Sets every router's replayed experts for one forward of the policy (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("train.moe_routing_replay=true but the policy has no MoE layer (model.path is a dense "
                             "model); set train.moe_routing_replay=false")
        self.replays = []
        for router in routers:
            router.router_replay = ReplayTopK()
            self.replays.append(router.router_replay)
        self.topk = routers[0].topk

    def take_agreement(self) -> np.ndarray:
        """[tokens routed alike, tokens replayed] over every layer since the last take (the update's forwards),
        summed over tp; the engine/trainer routing agreement is their ratio (`moe/routing_agreement`)."""
        counts = torch.tensor([[r.agreed, r.replayed] for r in self.replays], dtype=torch.float64).sum(0)
        for replay in self.replays:
            replay.agreed = replay.replayed = 0
        group = parallel_state.get_tensor_model_parallel_group()
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        return counts.numpy()

    def per_token(self, mb: SampleBatch) -> list[np.ndarray]:
        """Each sample's recorded experts, [prompt_len + response_len, layers, k]; a ValueError for a sample
        without them."""
        width = len(self.replays) * self.topk
        out = []
        for i, (n, routed) in enumerate(zip(mb.prompt_len + mb.response_len, mb.ragged("routed_experts"))):
            if routed.size != n * width:
                raise ValueError(f"train.moe_routing_replay=true but sample {int(mb.sample_id[i])} carries "
                                 f"{routed.size} recorded expert ids for {n} prompt and response tokens x "
                                 f"{len(self.replays)} MoE layers x top {self.topk}: its engine did not record this "
                                 "model's routing (rollout.engine=hf records it when the option is on)")
            out.append(routed.reshape(n, len(self.replays), self.topk).astype(np.int64))
        return out

    @contextlib.contextmanager
    def padded(self, mb: SampleBatch, width: int) -> Iterator[None]:
        """The padded rows' forward ([B, width] inputs: sample i's prompt, then its response from P_i on)."""
        target = torch.full((width, len(mb), len(self.replays), self.topk), -1, dtype=torch.long)
        for row, routed in enumerate(self.per_token(mb)):
            fed = routed[:len(routed) - 1]  # the last token is no input
            target[:len(fed), row] = torch.from_numpy(fed)
        with self._active(target):
            yield

    @contextlib.contextmanager
    def shared(self, mb: SampleBatch, layout: SharedLayout) -> Iterator[None]:
        """The shared-prompt stream's forward: distinct prompt g's token j at `layout.prompt_rows[g, j]`, sample i's
        response input j at `layout.response_rows[i, j]`."""
        target = torch.full((layout.tokens.shape[0], len(self.replays), self.topk), -1, dtype=torch.long)
        responses, prompts = layout.response_rows.cpu(), layout.prompt_rows.cpu()
        routed = self.per_token(mb)
        for g, first in enumerate(layout.group_first.tolist()):
            p = int(mb.prompt_len[first])
            target[prompts[g, :p]] = torch.from_numpy(routed[first][:p])
        for i, (p, n) in enumerate(zip(mb.prompt_len, mb.response_len)):
            fed = routed[i][p:p + max(int(n) - 1, 0)]
            target[responses[i, :len(fed)]] = torch.from_numpy(fed)
        with self._active(target[:, None]):
            yield

    @contextlib.contextmanager
    def _active(self, target: torch.Tensor) -> Iterator[None]:
        """`target`: [sequence, batch, layers, k], the MoE layers' input order; each router takes its rank's rows
        of it as it routes (`moe/layers.router_rows`: under tp or ep the layer pads and splits its tokens)."""
        try:
            for layer, replay in enumerate(self.replays):
                replay.target = target[:, :, layer].contiguous()
            yield
        finally:
            for replay in self.replays:
                replay.target = None
