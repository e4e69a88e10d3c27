"""GPT-2 for the CPU engine in plain torch: transformers' GPT2LMHeadModel's function and parameter names,
without importing transformers.

    model = load_native(model_dir, dtype=None)        # None: the checkpoint is not one this module serves
    cache = model.new_cache(capacity)                 # per micro-batch, like hf_fast.preallocated_cache
    logits = model.last_logits(input_ids, mask, positions, cache)   # [rows, vocab], the last column's

Why: a rollout rank that serves a GPT-2 checkpoint through transformers imports transformers' model
stack before its first step (the model registry, ``masking_utils`` and with it ``torch._dynamo``,
``core_model_loading`` and with it ``torch.distributed.tensor``): ~2.5 s of CPU here, on a machine whose
cores the trainer ranks are starting on too, and the engine was the last rank ready. And every decode
step of transformers' model is ~30 Python modules deep per layer. This module is the same arithmetic in
the fewest ops: the embeddings, per block LayerNorm -> fused QKV (GPT-2's ``Conv1D``, ``addmm``) ->
attention -> projection -> residual, LayerNorm -> MLP (tanh GELU as one kernel, as ``hf_fast`` makes
transformers' model run it) -> residual, the final LayerNorm and the tied head on the last column only.
Prefill attention is torch's SDPA with the padding-and-causal mask; a one-token decode step is two
strided ``bmm`` over the cache (the ``hf_fast.decode_attention`` product).

It serves a checkpoint only when config.json states every setting it reads and the safetensors hold
exactly GPT2LMHeadModel's tensors; anything else (a setting it does not compute, such as
``scale_attn_by_inverse_layer_idx`` or ``reorder_and_upcast_attn``, older GPT-2 layouts, sharded or
other files, other architectures) is served by transformers, unchanged. ``why_not_native`` says why.
tests/unit/test_native_gpt2.py holds it to transformers' GPT2LMHeadModel: the state-dict names and
shapes, the logits of prefill and decode steps with left padding, and the engine's sampled tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

_REQUIRED = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon",
             "activation_function", "tie_word_embeddings")
# config.json setting -> the value this module computes (another value: transformers serves the model)
_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
          "add_cross_attention": False}


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"gelu_new": _tanh_gelu, "gelu_fast": _tanh_gelu, "gelu_pytorch_tanh": _tanh_gelu,
                "gelu": F.gelu, "relu": F.relu, "silu": F.silu}


@dataclass(frozen=True)
class GPT2Shape:
    vocab_size: int
    max_positions: int
    width: int
    layers: int
    heads: int
    inner: int
    eps: float
    activation: str
    tied: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]


def why_not_native(model_dir: str | Path) -> str | None:
    """None when ``load_native`` serves this checkpoint, else the reason transformers does."""
    try:
        _read_shape(Path(model_dir))
    except _NotNative as reason:
        return str(reason)
    return None


def load_native(model_dir: str | Path, dtype: str | None = None) -> NativeGPT2 | None:
    """The checkpoint as a :class:`NativeGPT2` (weights cast to ``dtype``, else the checkpoint's), or None."""
    try:
        shape = _read_shape(Path(model_dir))
    except _NotNative:
        return None
    if dtype is not None:
        shape = GPT2Shape(**{**shape.__dict__, "dtype": getattr(torch, dtype)})
    model = NativeGPT2(shape)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    if shape.tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict({k: v.to(shape.dtype) for k, v in state.items()}, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if shape.tied else set()):  # _read_shape checked the names
        raise RuntimeError(f"{model_dir}: model.safetensors left {sorted(missing)} unloaded, {sorted(unexpected)} unused")
    return model.eval()


class _NotNative(Exception):
    pass


def _read_shape(model_dir: Path) -> GPT2Shape:
    config_path, weights = model_dir / "config.json", model_dir / "model.safetensors"
    if not config_path.is_file() or not weights.is_file():
        raise _NotNative("no config.json + single model.safetensors")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "gpt2":
        raise _NotNative(f"model_type {config.get('model_type')!r} is not gpt2")
    missing = [k for k in (*_REQUIRED, *_FIXED) if k not in config]
    if missing:
        raise _NotNative(f"config.json does not state {missing}")
    for key, value in _FIXED.items():
        if config[key] != value:
            raise _NotNative(f"config.json {key}={config[key]!r}")
    if config["activation_function"] not in _ACTIVATIONS:
        raise _NotNative(f"activation_function {config['activation_function']!r}")
    if config.get("quantization_config"):
        raise _NotNative("a quantized checkpoint")
    width, layers = int(config["n_embd"]), int(config["n_layer"])
    if width % int(config["n_head"]):
        raise _NotNative(f"n_embd {width} is not a multiple of n_head {config['n_head']}")
    with safe_open(str(weights), "pt") as f:
        names = set(f.keys())
        first = f.get_slice("transformer.wte.weight").get_dtype() if "transformer.wte.weight" in names else None
    expected = set(NativeGPT2.parameter_names(layers, tied=bool(config["tie_word_embeddings"])))
    if names - {"lm_head.weight"} != expected - {"lm_head.weight"} or not expected <= names:
        raise _NotNative("model.safetensors does not hold exactly GPT2LMHeadModel's tensors")
    stated = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, stated) if isinstance(stated, str) and hasattr(torch, stated) else \
        {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(first, torch.float32)
    inner = config.get("n_inner") or 4 * width
    return GPT2Shape(int(config["vocab_size"]), int(config["n_positions"]), width, layers, int(config["n_head"]),
                     int(inner), float(config["layer_norm_epsilon"]), config["activation_function"],
                     bool(config["tie_word_embeddings"]), dtype, _eos_ids(model_dir, config))


def _eos_ids(model_dir: Path, config: dict) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's (transformers' order)."""
    eos = None
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    return () if eos is None else ((int(eos),) if isinstance(eos, int) else tuple(int(t) for t in eos))


class _Conv1D(torch.nn.Module):
    """GPT-2's linear layer: weight [in, out], y = bias + x @ weight."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n_in, n_out, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(n_out, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class _Attention(torch.nn.Module):
    def __init__(self, s: GPT2Shape) -> None:
        super().__init__()
        self.c_attn, self.c_proj = _Conv1D(s.width, 3 * s.width, s.dtype), _Conv1D(s.width, s.width, s.dtype)


class _MLP(torch.nn.Module):
    def __init__(self, s: GPT2Shape) -> None:
        super().__init__()
        self.c_fc, self.c_proj = _Conv1D(s.width, s.inner, s.dtype), _Conv1D(s.inner, s.width, s.dtype)


class _Block(torch.nn.Module):
    def __init__(self, s: GPT2Shape) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(s.width, eps=s.eps, dtype=s.dtype)
        self.attn = _Attention(s)
        self.ln_2 = torch.nn.LayerNorm(s.width, eps=s.eps, dtype=s.dtype)
        self.mlp = _MLP(s)


class NativeCache:
    """Keys and values of every layer in buffers of `capacity` positions, filled in place."""

    def __init__(self, layers: int, capacity: int) -> None:
        self.capacity, self.filled = capacity, 0
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [B, H, W, D] at the next W positions; the filled views [B, H, filled + W, D]."""
        if self.keys[layer] is None:
            shape = (*k.shape[:2], self.capacity, k.shape[-1])
            self.keys[layer], self.values[layer] = k.new_empty(shape), v.new_empty(shape)
        end = self.filled + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions asked to hold {end}")
        self.keys[layer][:, :, self.filled:end] = k
        self.values[layer][:, :, self.filled:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def batch_select_indices(self, keep: torch.Tensor) -> None:
        """Only the rows `keep` from now on (the engine sheds finished rows; see `keep_rows`)."""
        moves = row_moves(keep)
        self.keys = [keep_rows(t, keep, self.filled, moves) for t in self.keys]
        self.values = [keep_rows(t, keep, self.filled, moves) for t in self.values]


def row_moves(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(to, from) when the rows `keep` can be had in place: every kept row is either already at its
    place or comes from past the kept prefix, so moving those few rows into the prefix's holes overwrites
    nothing still to be read; None otherwise (a general gather, or the prefill's rows repeated)."""
    to = (keep != torch.arange(len(keep), device=keep.device)).nonzero().squeeze(1)
    source = keep[to]
    return (to, source) if bool((source >= len(keep)).all()) else None


def keep_rows(t: torch.Tensor | None, keep: torch.Tensor, filled: int,
              moves: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """The cache buffer `t` [B, ..., capacity, D] holding only the rows `keep`, in that order. Only
    the filled positions are copied (a long-tail wave sheds ~20 times; copying whole buffers took a
    quarter of B4's rollout). With `moves` (`row_moves`: the engine sheds by moving its last live rows
    into the holes of finished ones) the rows move in place and the buffer is cut to the kept prefix:
    a shed of 16 of 128 rows copies 16 rows, not 112. Otherwise the kept rows are gathered into a new
    buffer's filled positions in one pass (`index_select` with a strided `out`)."""
    if t is None:
        return None
    if moves is not None:
        to, source = moves
        if len(to):
            t[to, ..., :filled, :] = t[source, ..., :filled, :]
        return t[:len(keep)]
    out = t.new_empty((len(keep), *t.shape[1:]))
    torch.index_select(t[..., :filled, :], 0, keep, out=out[..., :filled, :])
    return out


class NativeGPT2(torch.nn.Module):
    """GPT2LMHeadModel's parameters under its names; `last_logits` is its forward for the last column."""

    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        s = self.shape = shape
        self.transformer = torch.nn.Module()
        self.transformer.wte = torch.nn.Embedding(s.vocab_size, s.width, dtype=s.dtype)
        self.transformer.wpe = torch.nn.Embedding(s.max_positions, s.width, dtype=s.dtype)
        self.transformer.h = torch.nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.transformer.ln_f = torch.nn.LayerNorm(s.width, eps=s.eps, dtype=s.dtype)
        self.lm_head = torch.nn.Linear(s.width, s.vocab_size, bias=False, dtype=s.dtype)
        if s.tied:
            self.lm_head.weight = self.transformer.wte.weight
        self._act = _ACTIVATIONS[s.activation]
        self._by_role: dict | None = None  # `_tensors`

    @staticmethod
    def parameter_names(layers: int, tied: bool) -> list[str]:
        block = [f"{m}.{p}" for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
                 for p in ("weight", "bias")]
        names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                 "transformer.ln_f.bias", *(f"transformer.h.{i}.{b}" for i in range(layers) for b in block)]
        return [*names, "lm_head.weight"] if not tied else names

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    def new_cache(self, capacity: int) -> NativeCache:
        return NativeCache(self.shape.layers, capacity)

    def last_logits(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                    cache: NativeCache) -> torch.Tensor:
        """Logits [B, vocab] after the last column of `input_ids` [B, W]; `mask` [B, filled + W] marks the
        real (not padding) positions of everything cached so far plus these; `positions` [B, W]."""
        s, t = self.shape, self.transformer
        rows, width = input_ids.shape
        if width == 1:
            return self._decode_logits(input_ids[:, 0], mask, positions[:, 0], cache)
        heads, dim = s.heads, s.width // s.heads
        h = t.wte(input_ids) + t.wpe(positions)
        attend = self._prefill_mask(mask, width)
        for i, block in enumerate(t.h):
            qkv = block.attn.c_attn(block.ln_1(h)).view(rows, width, 3, heads, dim).permute(2, 0, 3, 1, 4)
            k, v = cache.write(i, qkv[1], qkv[2])
            a = F.scaled_dot_product_attention(qkv[0], k, v, attn_mask=attend, scale=dim ** -0.5)
            h = h + block.attn.c_proj(a.transpose(1, 2).reshape(rows, width, s.width))
            h = h + block.mlp.c_proj(self._act(block.mlp.c_fc(block.ln_2(h))))
        cache.filled += width
        return self.lm_head(t.ln_f(h[:, -1]))

    def _decode_logits(self, token: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                       cache: NativeCache) -> torch.Tensor:
        """`last_logits` of one new token per row (token, positions [B]): the same ops on [B, width]
        rows, the parameters taken from `_tensors` (no module calls, ~50 attribute lookups fewer a
        step) and the padding mask made once for all layers. A long tail's last rows decode ~140 steps
        of a B4 wave, each mostly per-op cost."""
        s, p = self.shape, self._tensors()
        rows, heads, dim = token.shape[0], s.heads, s.width // s.heads
        padding = ~mask.bool()[:, None, None, :]  # [B, 1, 1, L]: broadcast over the heads
        h = F.embedding(token, p["wte"]) + F.embedding(positions, p["wpe"])
        for i, (ln_1, c_attn, attn_proj, ln_2, c_fc, mlp_proj) in enumerate(p["blocks"]):
            x = F.layer_norm(h, (s.width,), *ln_1, s.eps)
            q, k, v = torch.addmm(c_attn[1], x, c_attn[0]).view(rows, 3, heads, 1, dim).unbind(1)
            a = _decode_attention(q, *cache.write(i, k, v), padding)
            h = h + torch.addmm(attn_proj[1], a.view(rows, s.width), attn_proj[0])
            x = self._act(torch.addmm(c_fc[1], F.layer_norm(h, (s.width,), *ln_2, s.eps), c_fc[0]))
            h = h + torch.addmm(mlp_proj[1], x, mlp_proj[0])
        cache.filled += 1
        return F.linear(F.layer_norm(h, (s.width,), *p["ln_f"], s.eps), p["head"])

    def _tensors(self) -> dict:
        """The parameters by role, collected once: the Parameter objects themselves, which weight
        updates (`load_state_dict` copies into them) and host parking (`.data` swapped) keep."""
        if self._by_role is None:
            t = self.transformer

            def pair(m):
                return (m.weight, m.bias)

            self._by_role = {"wte": t.wte.weight, "wpe": t.wpe.weight, "ln_f": pair(t.ln_f), "head": self.lm_head.weight,
                             "blocks": [(pair(b.ln_1), pair(b.attn.c_attn), pair(b.attn.c_proj), pair(b.ln_2),
                                         pair(b.mlp.c_fc), pair(b.mlp.c_proj)) for b in t.h]}
        return self._by_role

    @staticmethod
    def _prefill_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
        """[B, 1, W, L] True where a query may look: real keys at or before it (and itself, so a padding
        row's softmax has one term and stays finite; no real row ever reads a padding position)."""
        length = mask.shape[1]
        query_at = torch.arange(length - width, length, device=mask.device)[:, None]
        causal = torch.arange(length, device=mask.device)[None, :] <= query_at
        own = torch.arange(length, device=mask.device)[None, :] == query_at
        return ((causal & mask.bool()[:, None, :]) | own)[:, None]


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """One query per row: softmax(q k^T / sqrt(D), masked) v, [B, H, 1, D]; `padding` [B, 1, 1, L] is True
    at the positions not to look at. The scores are scaled and masked in place, the mask broadcast over
    the heads (not expanded into a copy per head): 8-10% less time than bmm over reshaped views with an
    expanded mask at 128 rows and 40-250 cached positions, bit-identical output; B4's whole wave ~1.5%
    faster (one or two threads)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    scores.masked_fill_(padding, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)
