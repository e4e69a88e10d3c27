"""The experts a transformers MoE engine's routers choose for each token it decodes (`train.moe_routing_replay`).

    recorder = RoutingRecorder(model)        # hooks every MoE router of the model (Qwen3-MoE's `mlp.gate`)
    logits = model(prompts)                  # the prefill of [distinct prompts, width] left-padded rows
    prefill = recorder.take(len(distinct), width)             # [rows, width, layers, top k] int16
    routed = recorder.buffer(rows, steps)    # [rows, steps, layers, top k] int16, -1 where nothing was routed
    logits = model(...)                      # one decode step over `rows` live rows
    routed[present, step - 1] = recorder.take(len(present))[:, 0]   # the experts of the tokens this step fed

The trainer replays them (`moe/routing_replay.py`, docs/moe.md): a prompt token's routing is the prefill's, a
response token's the one the engine computed when that token was the input of the next decode step, so the
last token of a response (never fed back) keeps -1.
"""
from __future__ import annotations

import torch


class RoutingRecorder:
    """Keeps the top-k expert ids of every MoE router's last forward (one hook per router, in layer order)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]
        if not self.routers:
            raise ValueError("train.moe_routing_replay=true but the policy has no MoE router (model.path is a dense "
                             "model): routing replay needs a mixture-of-experts policy; set train.moe_routing_replay="
                             "false")
        self.layers, self.topk = len(self.routers), int(self.routers[0].top_k)
        self._last: list[torch.Tensor | None] = [None] * self.layers
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._keep(index))

    def _keep(self, index: int):
        def hook(module, args, output) -> None:
            self._last[index] = output[2]  # Qwen3MoeTopKRouter: (logits, top-k weights, top-k ids [tokens, k])
        return hook

    def buffer(self, rows: int, steps: int) -> torch.Tensor:
        return torch.full((rows, steps, self.layers, self.topk), -1, dtype=torch.int16)

    def take(self, rows: int, positions: int = 1) -> torch.Tensor:
        """[rows, positions, layers, top k]: each row's experts at its last `positions` positions in the forward
        just run."""
        ids = [last.view(rows, -1, self.topk)[:, -positions:] for last in self._last]
        self._last = [None] * self.layers
        return torch.stack(ids, 2).to(device="cpu", dtype=torch.int16)
