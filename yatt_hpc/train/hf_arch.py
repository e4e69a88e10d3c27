"""What a Hugging Face causal-LM config means for a Megatron GPTModel: one frozen description.

    from yatt_hpc.train.hf_arch import describe_hf_config
    arch = describe_hf_config(load_hf_config(path), tp_size=2)    # yatt_hpc.models.hf_config

Both the model builder (``megatron_model.py``) and the weight converter (``convert.py``) read this
description, so the two can never disagree about head counts, biases, tying or vocab padding. It
imports neither torch nor megatron: it is plain arithmetic on the config.

Maps: ``gpt2``; ``llama`` (GQA, Llama-3 ``llama3`` and ``linear`` RoPE scaling); ``qwen2`` (Qwen2 and
Qwen2.5: fixed Q/K/V biases); ``qwen3`` (per-head q/k RMSNorm, ``head_dim`` independent of
``hidden_size``); ``qwen3_moe`` (Qwen3-MoE: Qwen3 attention, every layer a top-k mixture of SwiGLU experts, no shared
expert); ``qwen2_moe`` (Qwen2-MoE / Qwen1.5-MoE: Qwen2 attention with its Q/K/V biases, every layer routed
experts plus one shared SwiGLU expert scaled by a sigmoid gate); ``qwen2_vl`` (Qwen2-VL: its ``text_config`` is a
Qwen2 language model with M-RoPE, ``mrope_section`` (temporal, height, width) rotary channels; the HF vision tower
rides along unconverted, see ``vision``). A setting the Megatron model would compute differently (sliding windows, other RoPE
types, other bias layouts, attention dropout) raises, naming the config.json field and its value.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

Family = Literal["gpt2", "llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"]
SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "qwen2_vl")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
VISION_MODEL_TYPES = ("qwen2_vl",)


@dataclasses.dataclass(frozen=True)
class HFArch:
    """The architecture facts that the Megatron model and the weight layout depend on."""

    family: Family
    """HF ``model_type``: selects the weight-name table and the block style."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    """Query groups (GQA); equal to ``num_heads`` for multi-head attention."""
    head_dim: int
    vocab_size: int
    """The tokenizer's vocabulary as HF stores it (rows of ``embed_tokens``)."""
    padded_vocab_size: int
    """``vocab_size`` rounded up so every TP rank holds the same number of rows."""
    max_positions: int
    tied_embeddings: bool
    norm_eps: float
    activation: str
    """HF's activation name (``gelu_new``, ``silu`` ...), resolved through ``ACT2FN``."""
    linear_bias: bool
    """Biases on every linear layer (GPT-2)."""
    qkv_bias: bool
    """Biases on the Q/K/V projections only (Qwen2), or on them as part of ``linear_bias``."""
    qk_norm: bool
    """Per-head RMSNorm (weights of ``head_dim``) on queries and keys before RoPE (Qwen3)."""
    rope_theta: float | None
    """None for learned absolute positions (GPT-2)."""
    rope_scaling_factor: float | None
    """Llama-3 style frequency scaling factor, None when the config asks for plain RoPE."""
    rope_interpolation_factor: float | None
    """``linear`` RoPE scaling: positions are divided by this factor; None for none."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2-VL): rotary frequency pairs given to the temporal, height and width position ids
    (sums to ``head_dim / 2``); None for 1-D RoPE or learned positions."""
    vision: bool = False
    """A vision-language checkpoint: besides the language model (``model.*`` on disk) it holds a
    vision tower (``visual.*``), which the trainer keeps as HF's own module."""
    moe: MoEArch | None = None
    """A mixture-of-experts model (Qwen3-MoE, Qwen2-MoE): every layer's MLP is a routed set of experts; None: dense."""

    @property
    def gated_mlp(self) -> bool:
        """SwiGLU MLPs fuse gate and up projections into Megatron's ``linear_fc1``."""
        return self.family != "gpt2"


@dataclasses.dataclass(frozen=True)
class MoEArch:
    """The routed experts of a mixture-of-experts model, as HF's config states them."""

    num_experts: int
    topk: int
    """``num_experts_per_tok``: experts each token goes to."""
    ffn_hidden_size: int
    """``moe_intermediate_size``: each expert's SwiGLU width."""
    norm_topk_prob: bool
    """True: the top-k probabilities are renormalised to sum to 1 (Megatron: softmax over the top-k logits);
    False: they stay the softmax over all experts (Megatron's ``moe_router_pre_softmax``)."""
    aux_loss_coeff: float
    """``router_aux_loss_coef``: the load-balancing loss's weight (Megatron's ``moe_aux_loss_coeff``)."""
    shared_ffn_hidden_size: int | None = None
    """``shared_expert_intermediate_size`` (Qwen2-MoE): the width of the one SwiGLU expert every token goes through,
    its output times ``sigmoid(shared_expert_gate(x))`` (Megatron's ``SharedExpertMLP`` with
    ``moe_shared_expert_gate``); None: no shared expert (Qwen3-MoE)."""


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Round up to a multiple of ``tp_size``: Megatron's vocab-parallel embedding splits rows evenly."""
    return -(-vocab_size // tp_size) * tp_size


def describe_hf_config(hf_config: Any, tp_size: int) -> HFArch:
    """Read an HF ``PretrainedConfig`` into an :class:`HFArch`; raise for what we cannot express."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"hf_config.model_type={model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "gpt2":
        arch = _describe_gpt2(hf_config, tp_size)
    elif model_type in VISION_MODEL_TYPES:
        arch = _describe_vision_language(hf_config, tp_size)
    elif model_type in MOE_MODEL_TYPES:
        arch = _describe_moe(hf_config, tp_size, model_type)
    else:
        arch = _describe_rope_family(hf_config, tp_size, model_type)
    _check_tp_divisibility(arch, tp_size)
    return arch


def _describe_gpt2(c: Any, tp_size: int) -> HFArch:
    if not c.scale_attn_weights or c.scale_attn_by_inverse_layer_idx:
        raise NotImplementedError(
            "GPT-2 attention scaling must be plain 1/sqrt(head_dim): need scale_attn_weights=True "
            "and scale_attn_by_inverse_layer_idx=False"
        )
    return HFArch(
        family="gpt2",
        num_layers=c.n_layer,
        hidden_size=c.n_embd,
        ffn_hidden_size=c.n_inner or 4 * c.n_embd,
        num_heads=c.n_head,
        num_kv_heads=c.n_head,
        head_dim=c.n_embd // c.n_head,
        vocab_size=c.vocab_size,
        padded_vocab_size=pad_vocab_size(c.vocab_size, tp_size),
        max_positions=c.n_positions,
        tied_embeddings=bool(c.tie_word_embeddings),
        norm_eps=c.layer_norm_epsilon,
        activation=c.activation_function,
        linear_bias=True,
        qkv_bias=True,
        qk_norm=False,
        rope_theta=None,
        rope_scaling_factor=None,
        rope_interpolation_factor=None,
    )


def _describe_vision_language(c: Any, tp_size: int) -> HFArch:
    """Qwen2-VL: the text config as a Qwen2 language model with M-RoPE."""
    text = c.text_config
    arch = _describe_rope_family(text, tp_size, "qwen2", mrope=True)
    section = tuple(int(x) for x in (text.rope_parameters or {}).get("mrope_section") or ())
    if len(section) != 3 or sum(section) * 2 != arch.head_dim:
        raise NotImplementedError(
            f"config.json text_config.rope_parameters.mrope_section={list(section)}: need three "
            f"(temporal, height, width) counts summing to head_dim/2={arch.head_dim // 2}")
    if arch.tied_embeddings != bool(getattr(c, "tie_word_embeddings", arch.tied_embeddings)):
        raise NotImplementedError("config.json tie_word_embeddings differs between the top level and text_config; "
                                  "make them equal")
    return dataclasses.replace(arch, mrope_section=section, vision=True)


def _describe_moe(c: Any, tp_size: int, family: Family) -> HFArch:
    """Qwen3-MoE (Qwen3's attention) and Qwen2-MoE (Qwen2's, plus a gated shared expert): every layer's MLP routed
    experts (Megatron's MoELayer)."""
    sparse_step = getattr(c, "decoder_sparse_step", 1)
    if sparse_step != 1:
        raise NotImplementedError(f"config.json decoder_sparse_step={sparse_step} ({family}): only 1 (every layer "
                                  "a mixture of experts) maps; Megatron's moe_layer_freq is not wired")
    if getattr(c, "mlp_only_layers", None):
        raise NotImplementedError(f"config.json mlp_only_layers={list(c.mlp_only_layers)} ({family}): dense layers "
                                  "among the experts' layers are not mapped; use []")
    shared = getattr(c, "shared_expert_intermediate_size", None) or None
    if family == "qwen3_moe" and shared:
        raise NotImplementedError(f"config.json shared_expert_intermediate_size={shared} (qwen3_moe): Qwen3-MoE has "
                                  "no shared expert and transformers builds none; remove the field")
    if family == "qwen2_moe" and not (shared and shared > 0):
        raise NotImplementedError(f"config.json shared_expert_intermediate_size={c.shared_expert_intermediate_size!r} "
                                  "(qwen2_moe): a shared expert of width 0 is not mapped; use a positive width")
    moe = MoEArch(num_experts=c.num_experts, topk=c.num_experts_per_tok, ffn_hidden_size=c.moe_intermediate_size,
                  norm_topk_prob=bool(c.norm_topk_prob), aux_loss_coeff=float(c.router_aux_loss_coef),
                  shared_ffn_hidden_size=shared)
    if not 0 < moe.topk <= moe.num_experts:
        raise ValueError(f"config.json num_experts_per_tok={moe.topk} must be in 1..num_experts={moe.num_experts}")
    dense = _describe_rope_family(c, tp_size, "qwen3" if family == "qwen3_moe" else "qwen2")
    # Qwen2-MoE's attention biases are a config field in transformers 5 (qkv_bias, true by default)
    qkv_bias = bool(getattr(c, "qkv_bias", True)) if family == "qwen2_moe" else dense.qkv_bias
    return dataclasses.replace(dense, family=family, moe=moe, qkv_bias=qkv_bias)


def _describe_rope_family(c: Any, tp_size: int, family: Family, mrope: bool = False) -> HFArch:
    _refuse_unmapped_options(c, family)
    theta, scaling, interpolation = _rope_parameters(c, mrope)
    heads = c.num_attention_heads
    return HFArch(
        family=family,
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size,
        num_heads=heads,
        num_kv_heads=c.num_key_value_heads or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        vocab_size=c.vocab_size,
        padded_vocab_size=pad_vocab_size(c.vocab_size, tp_size),
        max_positions=c.max_position_embeddings,
        tied_embeddings=bool(c.tie_word_embeddings),
        norm_eps=c.rms_norm_eps,
        activation=c.hidden_act,
        linear_bias=False,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        rope_theta=theta,
        rope_scaling_factor=scaling,
        rope_interpolation_factor=interpolation,
    )


def _refuse_unmapped_options(c: Any, family: str) -> None:
    """Raise for config.json settings the Megatron local-spec model would silently compute differently."""
    def refuse(field: str, value: Any, why: str) -> None:
        raise NotImplementedError(f"config.json {field}={value!r} ({family}) cannot be converted: {why}")

    if c.hidden_act != "silu":
        refuse("hidden_act", c.hidden_act, "only 'silu' (SwiGLU) maps to Megatron's gated MLP")
    if getattr(c, "pretraining_tp", 1) != 1:
        refuse("pretraining_tp", c.pretraining_tp, "only 1 maps")
    if getattr(c, "use_sliding_window", False):
        refuse("use_sliding_window", True, "Megatron's local attention has no sliding window; "
               "use a checkpoint with use_sliding_window=false")
    sliding = sorted({t for t in getattr(c, "layer_types", None) or () if t != "full_attention"})
    if sliding:
        refuse("layer_types", sliding, "only 'full_attention' layers map")
    if getattr(c, "attention_dropout", 0.0):
        refuse("attention_dropout", c.attention_dropout, "the Megatron model runs without dropout; set 0.0")
    # Megatron has one flag for Q/K/V biases and one for o_proj + the whole MLP; Llama's
    # attention_bias covers Q/K/V/o_proj and mlp_bias the MLP, so no combination lines up.
    for field in ("attention_bias", "mlp_bias"):
        if getattr(c, field, False):
            refuse(field, True, "only attention_bias=false and mlp_bias=false map (Qwen2's fixed Q/K/V "
                   "biases do)")


# Megatron's RotaryEmbedding._apply_scaling takes only `factor` from GPTModel; the other Llama-3
# constants are fixed at Llama-3.1's values, so a config with different ones is refused.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_ROPE_KEYS = {"default": set(), "linear": {"factor"}, "llama3": {"factor", *_LLAMA3_FIXED}}


def _rope_parameters(c: Any, mrope: bool = False) -> tuple[float, float | None, float | None]:
    """(theta, llama3 factor, linear factor) from ``rope_parameters`` (transformers 5; config.json
    files of 4.x spell it ``rope_theta`` + ``rope_scaling``, which transformers 5 folds in)."""
    params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    field = "rope_parameters (rope_scaling in transformers 4 config.json files)"
    if mrope and rope_type != "default":
        raise NotImplementedError(f"config.json {field}.rope_type={rope_type!r} with M-RoPE: Megatron's "
                                  "MultimodalRotaryEmbedding has no scaling; only 'default' maps")
    if rope_type not in _ROPE_KEYS:
        raise NotImplementedError(
            f"config.json {field}.rope_type={rope_type!r} has no twin in Megatron's RotaryEmbedding; "
            f"supported: {', '.join(_ROPE_KEYS)} (llama3 with {_LLAMA3_FIXED})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError(f"config.json {field}.partial_rotary_factor="
                                  f"{params['partial_rotary_factor']}: only 1.0 (full rotary) maps")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor"} | ({"mrope_section"} if mrope else set())
    unknown = sorted(set(params) - known - _ROPE_KEYS[rope_type])
    if unknown:
        raise NotImplementedError(f"config.json {field} has {unknown}, which rope_type={rope_type!r} "
                                  "in Megatron does not read")
    if rope_type == "default":
        return theta, None, None
    factor = float(params["factor"])
    if rope_type == "linear":
        return theta, None, factor
    for key, value in _LLAMA3_FIXED.items():
        if float(params.get(key, -1)) != value:
            raise NotImplementedError(
                f"config.json {field}.{key}={params.get(key)!r}: Megatron's llama3 RoPE scaling is "
                f"fixed at {_LLAMA3_FIXED}")
    return theta, factor, None


def _check_tp_divisibility(arch: HFArch, tp_size: int) -> None:
    fields = [(f, getattr(arch, f)) for f in ("num_heads", "num_kv_heads", "ffn_hidden_size")]
    if arch.moe is not None:  # the experts split over tp like a dense MLP (Megatron's expert tp = tp)
        fields.append(("moe_intermediate_size", arch.moe.ffn_hidden_size))
        if arch.moe.shared_ffn_hidden_size:  # a dense SwiGLU MLP split over tp
            fields.append(("shared_expert_intermediate_size", arch.moe.shared_ffn_hidden_size))
    for field, value in fields:
        if value % tp_size:
            raise ValueError(f"{field}={value} is not divisible by tp_size={tp_size}; pick a tp_size "
                             f"that divides it")


def refuse_unsupported_moe(arch: HFArch, lora: bool, recompute: str, pp_size: int) -> None:
    """Raise for a mixture-of-experts policy with a trainer feature its experts are not wired into (the field, the
    value, the fix); for a dense model, only expert parallelism (it has no experts to split)."""
    from yatt_hpc.moe.layers import expert_parallel_size

    ep = expert_parallel_size()
    if arch.moe is None:
        if ep > 1:
            raise ValueError(f"placement.trainer.ep={ep} but the policy ({arch.family}) has no experts; set "
                             "placement.trainer.ep=1")
        return
    refused = [
        (pp_size > 1, f"placement.trainer.pp={pp_size}", "pipeline stages take variable-length micro-batches, which "
         "Megatron's all-gather dispatcher refuses (the all-to-all one allocates CUDA streams); set "
         "placement.trainer.pp=1"),
        (lora, "train.lora.rank > 0", "LoRA's adapters are not mapped onto the experts; set train.lora.rank=0"),
        (recompute != "none", f"train.recompute={recompute!r}", "recomputation through MoE layers is not checked "
         "against the plain path; set train.recompute=none"),
    ]
    for refuse, field, why in refused:
        if refuse:
            raise ValueError(f"{field} with a mixture-of-experts policy ({arch.family}, {arch.moe.num_experts} "
                             f"experts): {why} (docs/moe.md)")
