"""Build a Megatron-core GPTModel that computes what an HF causal LM computes, and its process groups.

    from yatt_hpc.train import megatron_model as mm
    mm.initialize_model_parallel(rank, world_size, leader_addr, leader_port, tp_size=2, seed=0)
    model = mm.build_gpt_model(hf_config, tp_size=2)       # random init, this rank's TP shard
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf_sd, hf_config, tp_rank, 2))
    logits = mm.forward_logits(model, input_ids)          # [B, T, padded_vocab / tp] (vocab-parallel)

Two block styles: GPT-2 (learned positions, LayerNorm with bias, biased linears, HF's exact GELU
variant, tied embeddings) and Llama/Qwen2/Qwen3 (RoPE with Llama-3 or linear scaling, RMSNorm,
SwiGLU, GQA, Qwen2's QKV bias, Qwen3's per-head q/k RMSNorm). Layers come from
``get_gpt_layer_local_spec()`` (plain torch, no Transformer Engine), so the same model runs on CPU
with gloo (see ``cpu_compat``) and on GPU with NCCL.
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from yatt_hpc.train import cpu_compat
from yatt_hpc.train.hf_arch import HFArch, describe_hf_config
from yatt_hpc.train.mcore import (
    GPTModel,
    ModuleSpec,
    TransformerConfig,
    get_gpt_layer_local_spec,
    parallel_state,
    tensor_parallel,
)


def initialize_model_parallel(
    rank: int,
    world_size: int,
    leader_addr: str,
    leader_port: int,
    tp_size: int,
    seed: int = 0,
    timeout_s: float = 600.0,
    cuda_device: int | None = None,
) -> None:
    """Join the trainer's process group (gloo on CPU, NCCL on CUDA) and set up TP=tp_size, PP=CP=1.

    ``rank``/``world_size`` and the leader's address come from the caller (MPI in the controller),
    never from environment variables. Data parallelism is ``world_size // tp_size``.
    ``cuda_device`` defaults to ``rank % device_count`` (ranks packed node by node).
    """
    cpu = cpu_compat.is_cpu_runtime()
    if not cpu:
        torch.cuda.set_device(rank % torch.cuda.device_count() if cuda_device is None else cuda_device)
    torch.distributed.init_process_group(
        backend="gloo" if cpu else "nccl",
        init_method=f"tcp://{leader_addr}:{leader_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
    )
    if not cpu_compat.prepare_cpu_runtime(seed):
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def built_group_sizes() -> dict[str, int]:
    """The sizes of the Megatron groups this rank is in (after `initialize_model_parallel`)."""
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size()}


def check_groups(planned: Any) -> None:
    """Raise if the Megatron groups built differ from the plan's trainer layout (a `GroupPlan`): a
    data-parallel group larger than planned would sum more replicas' gradients than the batch has."""
    built, want = built_group_sizes(), dict(planned.layout)
    if built != want:
        raise RuntimeError(f"Megatron built groups {built} but the plan's trainer layout is {want}")


def destroy_model_parallel() -> None:
    """Undo :func:`initialize_model_parallel` (tests run several worlds in one process)."""
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def build_transformer_config(
    arch: HFArch, tp_size: int, params_dtype: torch.dtype = torch.float32
) -> TransformerConfig:
    """The ``TransformerConfig`` whose local-spec layers reproduce the HF blocks of ``arch``."""
    gpt2 = arch.family == "gpt2"
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        tensor_model_parallel_size=tp_size,
        normalization="LayerNorm" if gpt2 else "RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        add_bias_linear=arch.linear_bias,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=arch.gated_mlp,
        # ACT2FN gives HF's exact function (gelu_new is the tanh approximation, written HF's way).
        activation_func=F.silu if arch.gated_mlp else ACT2FN[arch.activation],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=cpu_compat.is_cpu_runtime(),
        # The fusions below need Apex/TE kernels or assume GELU/SwiGLU variants HF does not use.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt_model(
    hf_config: Any,
    tp_size: int,
    params_dtype: torch.dtype = torch.float32,
    parallel_output: bool = True,
) -> GPTModel:
    """This rank's TP shard of a GPTModel shaped like ``hf_config`` (randomly initialised).

    Needs :func:`initialize_model_parallel` first. With ``parallel_output=True`` the logits stay
    vocab-parallel ([B, T, padded_vocab / tp]), which is what ``logprobs`` expects.
    """
    arch = describe_hf_config(hf_config, tp_size)
    config = build_transformer_config(arch, tp_size, params_dtype)
    rope = arch.rope_theta is not None
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(arch, config),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_positions,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope" if rope else "learned_absolute",
        rotary_base=int(arch.rope_theta) if rope else 10000,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        seq_len_interpolation_factor=arch.rope_interpolation_factor,
    )
    cpu_compat.make_rope_cpu_safe(model)
    if params_dtype != torch.float32:
        # what Megatron's Float16Module does: the norms and position embeddings of the local spec are
        # built in fp32 whatever params_dtype says, so the whole model is cast once
        model.to(params_dtype)
    if not cpu_compat.is_cpu_runtime():
        model.cuda(torch.cuda.current_device())
    return model


def _layer_spec(arch: HFArch, config: TransformerConfig) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=arch.qk_norm)
    if arch.qk_norm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    return spec


class HeadRMSNorm(torch.nn.RMSNorm):
    """Qwen3's per-head q/k RMSNorm, built by the local spec as ``q_layernorm``/``k_layernorm``.

    Its weight is replicated over TP but each rank normalises different heads, so its gradient is
    a sum over the TP group. Megatron sums it in ``finalize_model_grads``, which our trainer does not
    run; here the weight passes through ``copy_to_tensor_model_parallel_region`` (identity forward,
    all-reduce backward), so every TP rank holds the full gradient after ``backward``.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = tensor_parallel.copy_to_tensor_model_parallel_region(
            self.weight, group=parallel_state.get_tensor_model_parallel_group())
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def load_megatron_shard(model: GPTModel, shard: dict[str, torch.Tensor]) -> None:
    """Copy a converter shard into ``model``; every parameter must be covered, nothing left over.

    Megatron's state dict also lists ``*._extra_state`` (FP8 metadata, None here); the converter
    does not produce those, so they are the only keys allowed to be missing.
    """
    result = model.load_state_dict(shard, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise KeyError(f"shard does not match the model: missing={missing}, "
                       f"unexpected={result.unexpected_keys}")


def causal_attention_mask(seq_len: int, device: torch.device | str) -> torch.Tensor:
    """[1, 1, T, T] bool mask, True where attention is forbidden (Megatron's convention).

    Passed explicitly because megatron's fallback mask is built with ``device="cuda"``.
    """
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def forward_logits(
    model: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits [B, T, V_local] for right-padded ``input_ids`` [B, T] (causal mask, positions 0..T-1)."""
    batch, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
    mask = causal_attention_mask(seq_len, input_ids.device)
    return model(input_ids, position_ids, mask)
