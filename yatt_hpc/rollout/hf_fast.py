"""Faster paths for an HF model the engine serves, computing the same thing.

    fuse_activations(model)                          # GPT-2's gelu_new -> torch's one-kernel tanh GELU
    cache = preallocated_cache(model.config, 58)     # a KV cache that writes in place, never re-concatenates
    use_decode_attention(model)                      # one-token decode steps as two strided bmm calls
    use_onednn_linears(model)                        # fp32 projections through oneDNN's matmul, not MKL's

GPT-2 (and GPT-J, GPT-Neo, ...) name their activation `gelu_new` or `gelu_fast`: transformers writes both
in Python, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), eight elementwise ops with a temporary each.
`torch.nn.functional.gelu(x, approximate="tanh")` is that function in one kernel (transformers' own
`gelu_pytorch_tanh`): ~7x faster on a [1600, 1024] activation here, within 2.4e-7 of the Python form.
The trainer's Megatron model uses the same kernel (`train/megatron_model.py`), so the engine and the
trainer score the same function the same way. The checkpoint's config is left as it is.

transformers' `DynamicCache` grows each layer's keys and values with `torch.cat` at every decode step,
copying the whole cache each time (O(length^2) bytes per response): 28% of a decode's CPU time for a
4-layer, 256-wide GPT-2 with 128 rows x 48 tokens here. `preallocated_cache` gives the same cache with
its full-attention layers writing into buffers sized once for the micro-batch (prompt + new tokens) and
handing attention a view of the filled part; the attention inputs hold the same values.

A decode step's attention has one query row per sequence. torch's SDPA on CPU takes 2.7 ms for 128 rows
x 4 heads x 40 cached positions of the view above (2.9 ms even on contiguous keys); the same product as
two `bmm` calls over the views flattened to [rows*heads, positions, dim] (no copy: the strides merge)
takes 0.7 ms. `use_decode_attention` registers that as an attention implementation of transformers
(`yatt_decode`) for one-token queries, with everything else (the prefill, any model whose attention is
not SDPA) left to transformers' SDPA: same softmax(q k^T * scale + mask) v, fp32 accumulation.

`use_onednn_linears` serves the fp32 projections through oneDNN's matmul (`device/cpu_matmul.py` says why).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.activations import FastGELUActivation, GELUTanh, NewGELUActivation
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import AttentionInterface

from yatt_hpc.device import cpu_matmul
from yatt_hpc.rollout.native_gpt2 import keep_rows, row_moves

_PYTHON_TANH_GELU = (NewGELUActivation, FastGELUActivation)


def fuse_activations(model: torch.nn.Module) -> int:
    """Replace every Python-written tanh GELU module of `model` by the fused one; returns how many."""
    swaps = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if type(child) in _PYTHON_TANH_GELU]
    for parent, name in swaps:
        setattr(parent, name, GELUTanh())
    return len(swaps)


class PreallocatedLayer(DynamicLayer):
    """A full-attention layer's cache in buffers of `capacity` positions, filled in place."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._filled = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.device = key_states.device
            shape = (*key_states.shape[:-2], self.capacity, key_states.shape[-1])
            self._keys = key_states.new_empty(shape)
            self._values = value_states.new_empty(shape[:-1] + (value_states.shape[-1],))
            self.is_initialized = True
        start, end = self._filled, self._filled + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions asked to hold {end}")
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self._filled = end
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices`, in place when they allow it (`native_gpt2.keep_rows`)."""
        if not self.is_initialized:
            return
        end, moves = self._filled, row_moves(indices)
        self._keys, self._values = (keep_rows(t, indices, end, moves) for t in (self._keys, self._values))
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """`DynamicCache(config=config)` whose full-attention layers are `PreallocatedLayer`s of `capacity`
    positions (sliding-window and other special layers stay as transformers builds them)."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


DECODE_ATTENTION = "yatt_decode"


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """transformers' attention contract ([B, H, q, D] in, [B, q, H, D] out); a one-token query takes two bmm."""
    rows, heads, q_len, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if q_len != 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    group = heads // kv_heads  # grouped-query attention: a kv head's query heads become its query rows
    q = query.reshape(rows * kv_heads, group, dim)
    k = key.reshape(rows * kv_heads, length, dim)
    v = value.reshape(rows * kv_heads, length, value.shape[-1])
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(dim ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:  # [B, 1, 1, L]: bool (True attends) or additive
        mask = attention_mask[:, :, :, -length:].expand(rows, kv_heads, 1, length).reshape(rows * kv_heads, 1, length)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.bmm(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)
    return out.reshape(rows, heads, 1, -1).transpose(1, 2), None


def use_decode_attention(model: torch.nn.Module) -> bool:
    """Serve `model`'s one-token decode steps with `decode_attention` where it runs transformers' SDPA
    (the default on CPU); True if it does now."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if DECODE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(DECODE_ATTENTION, decode_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(DECODE_ATTENTION)
    return True


def _onednn_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or not cpu_matmul.runs_on_onednn(x, self.weight):
        return F.linear(x, self.weight, self.bias)  # autograd (the op has none), or no longer an fp32 CPU layer
    return cpu_matmul.onednn_linear(x, self.weight, self.bias)


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Serve `model`'s fp32 CPU `nn.Linear` layers of at least `cpu_matmul.ONEDNN_MIN_WEIGHT` weights with oneDNN's
    matmul; returns how many. The layers keep their parameters; a call with gradients on takes `F.linear`."""
    if not cpu_matmul.onednn_linear_available():
        return 0
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and cpu_matmul.runs_on_onednn(m.weight, m.weight)]
    for layer in layers:
        layer.forward = types.MethodType(_onednn_linear, layer)
    return len(layers)
