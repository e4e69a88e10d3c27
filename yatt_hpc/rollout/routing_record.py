"""The experts an MoE engine's routers choose for each token it decodes (`train.moe_routing_replay`): the HF engine's
recorder, and SGLang's returned routing decoded to the same column.

    recorder = RoutingRecorder(model)        # hooks every MoE router of the model (Qwen3-MoE's `mlp.gate`)
    logits = model(prompts)                  # the prefill of [distinct prompts, width] left-padded rows
    prefill = recorder.take(len(distinct), width)             # [rows, width, layers, top k] int16
    routed = recorder.buffer(rows, steps)    # [rows, steps, layers, top k] int16, -1 where nothing was routed
    logits = model(...)                      # one decode step over `rows` live rows
    routed[present, step - 1] = recorder.take(len(present))[:, 0]   # the experts of the tokens this step fed

The trainer replays them (`moe/routing_replay.py`, docs/moe.md): a prompt token's routing is the prefill's, a
response token's the one the engine computed when that token was the input of the next decode step, so the
last token of a response (never fed back) keeps -1.

    routed = routed_experts_from_sglang(meta_info, prompt_len, response_len, layers, topk)   # the same column

SGLang (``enable_return_routed_experts`` at launch, ``return_routed_experts`` per request) captures each MoE layer's
top-k ids per KV slot and returns them in ``meta_info["routed_experts"]``: base64 of the bytes of an int32
C-order array [seqlen - 1, layers, top k] (sglang python/sglang/srt/managers/tokenizer_manager.py, which encodes
``val.numpy().tobytes()``; managers/io_struct.py ``GenerateReqInput.routed_experts_start_len``: the rows cover
positions ``[routed_experts_start_len, seqlen - 1)``, 0 by default; layers/moe/routed_experts_capturer.py, the int32
buffer of shape [tokens, num_hidden_layers, num_experts_per_tok]). ``seqlen - 1`` is every prompt token and every
response token but the last, which was never fed: the HF recorder's layout, less its last row.
"""
from __future__ import annotations

import base64

import numpy as np
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


def routed_experts_from_sglang(meta_info: dict, prompt_len: int, response_len: int, layers: int, topk: int,
                               aborted: bool = False) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` of one request (routed from position 0) as the column the HF engine
    records: int16 [prompt_len + response_len, layers, top k], -1 on the last response token (never fed). An aborted
    request SGLang returned no routing for gets -1 everywhere (the trainer's router chooses); a finished one without
    it means the engine was not started to record (a ValueError naming the fix)."""
    rows = prompt_len + response_len
    encoded = meta_info.get("routed_experts")
    if encoded is None:
        if aborted:
            return np.full((rows, layers, topk), -1, np.int16)
        raise ValueError("train.moe_routing_replay=true but SGLang returned no meta_info['routed_experts']: the engine "
                         "must be started with enable_return_routed_experts=True and asked with "
                         "return_routed_experts=True (SGLangEngine(record_routing=True) does both), on an SGLang that "
                         "has them")
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    if flat.size != (rows - 1) * layers * topk:
        raise ValueError(f"SGLang's meta_info['routed_experts'] holds {flat.size} expert ids, but {prompt_len} prompt "
                         f"+ {response_len} response tokens - 1 (the last is never fed) x {layers} MoE layers x top "
                         f"{topk} is {(rows - 1) * layers * topk}: the engine's model is not the policy's config.json "
                         "(num_hidden_layers, num_experts_per_tok), or the request set routed_experts_start_len")
    out = np.full((rows, layers, topk), -1, np.int16)
    out[: rows - 1] = flat.reshape(rows - 1, layers, topk)
    return out
