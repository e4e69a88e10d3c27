"""Expert parallelism's one rule for the trainer's loops: the ranks of an expert group pass through their MoE
layers together.

    lockstep = ExpertLockstep.of(model)              # None unless placement.trainer.ep > 1
    idle = lockstep.missing(len(micros))             # forwards this rank owes its expert group: BEFORE the
    ... one forward (and backward) per micro-batch ...   # loop (a collective of its own; the layers' follow)
    for _ in range(idle):
        lockstep.idle_step(model, reference)         # an update's micro-step: forward(s) and a backward
        lockstep.idle_forward(model)                 # a forward-only pass's (log-probabilities)

Each MoE layer's token exchange (Megatron's all-gather dispatcher, `moe/layers.py`) is a collective over the
expert group, in its forward and in its backward. Data-parallel replicas hold different samples, so they cut
different numbers of micro-batches; a replica with fewer runs idle passes on one token until every rank of its
expert group has run as many. An idle pass changes nothing: its loss is multiplied by zero, its backward adds
no load-balancing loss (`aux_loss_off`), it is not counted in `ExpertLoad` nor in the routing agreement, and
its gradients are zeros added to the real ones.
"""
from __future__ import annotations

import torch

from yatt_hpc.moe.layers import aux_loss_off, expert_parallel_size
from yatt_hpc.train.mcore import parallel_state


class ExpertLockstep:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.group = parallel_state.get_expert_model_parallel_group()

    @classmethod
    def of(cls, model: torch.nn.Module) -> ExpertLockstep | None:
        if expert_parallel_size() == 1:
            return None
        return cls(next(model.parameters()).device)

    def missing(self, count: int) -> int:
        """How many passes this rank must add to `count` to match the most of its expert group. Collective over the
        expert group: call it before the passes, whose MoE layers run collectives of their own."""
        most = torch.tensor([count], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(most.item()) - count

    def _one_token(self, model: torch.nn.Module) -> torch.Tensor:
        from yatt_hpc.train.megatron_model import forward_logits

        return forward_logits(model, torch.zeros(1, 1, dtype=torch.long, device=self.device))

    @torch.no_grad()
    def idle_forward(self, model: torch.nn.Module) -> None:
        self._one_token(model)

    def idle_step(self, model: torch.nn.Module, reference: torch.nn.Module | None) -> None:
        """A micro-step's passes: the policy's forward, the reference's (when the real micro-steps run one), and
        the backward, in the order a real micro-step runs them."""
        logits = self._one_token(model)
        if reference is not None:
            with torch.no_grad():
                self._one_token(reference)
        with aux_loss_off():
            (logits.float().sum() * 0.0).backward()
