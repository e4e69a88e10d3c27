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

An fp32 `nn.Linear` goes to MKL's sgemm (torch's CPU BLAS); a bf16 one to oneDNN. On the AMD EPYC (Zen 4)
machine here MKL streams a decode step's weights at 4-5 GB/s, oneDNN at 10-16: at Qwen2.5-0.5B's shape, 16
rows, the 151,936-row output projection takes 100-145 ms through MKL and 43 ms through oneDNN, an MLP
projection 2.1-4.5 ms and 1.2-2.1 ms, and a 64-token rollout of 16 samples 23-26 s and 15-16 s.
`use_onednn_linears` routes every fp32 projection of at least `ONEDNN_MIN_WEIGHT` weights (smaller ones are
faster through MKL: 8 us against 26 us at 64 x 64) through `torch.ops.mkldnn._linear_pointwise`, the op
torch's own CPU compiler emits for a linear layer, with the layer's dense weight as it is (no packed copy, so
a weight sync's in-place writes reach it). Only without autograd (the engine runs in inference mode): the op
has no backward. It is fp32 throughout with its own summation order: within 3e-4 of MKL's result on
[322, 896] x [896, 151936], each within 3e-4 of the float64 product (MKL's 7e-5, oneDNN's 1.4e-4 here).
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.activations import FastGELUActivation, GELUTanh, NewGELUActivation
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import AttentionInterface

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


ONEDNN_MIN_WEIGHT = 1 << 18
"""Weights of an fp32 projection at and past which oneDNN's matmul is the faster (a 512 x 512 layer)."""


@functools.cache
def onednn_linear_available() -> bool:
    """This torch build has oneDNN's linear op and it runs here."""
    try:
        weight = torch.ones(2, 3)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 3), weight, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 3.0)))


def _onednn_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if torch.is_grad_enabled() or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight, self.bias)  # autograd, or a layer no longer fp32 on the CPU: torch's own
    return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Serve `model`'s fp32 CPU `nn.Linear` layers of at least `ONEDNN_MIN_WEIGHT` weights with oneDNN's matmul
    (above); returns how many. The layers keep their parameters; a call with gradients on takes `F.linear`."""
    if not onednn_linear_available():
        return 0
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
              and m.weight.device.type == "cpu" and m.weight.numel() >= ONEDNN_MIN_WEIGHT]
    for layer in layers:
        layer.forward = types.MethodType(_onednn_linear, layer)
    return len(layers)
