"""Build a Megatron-core GPTModel that computes what an HF causal LM computes, and its process groups.

    from yatt_hpc.train import megatron_model as mm
    mm.initialize_model_parallel(rank, world_size, leader_addr, leader_port, tp_size=2, seed=0)
    model = mm.build_gpt_model(hf_config, tp_size=2)       # random init, this rank's TP shard
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf_sd, hf_config, tp_rank, 2))
    logits = mm.forward_logits(model, input_ids)          # [B, T, padded_vocab / tp] (vocab-parallel)

Two block styles: GPT-2 (learned positions, LayerNorm with bias, biased linears, the tanh GELU in one kernel
(GPT-2's gelu_new), tied embeddings) and Llama/Qwen2/Qwen3 (RoPE with Llama-3 or linear scaling, RMSNorm,
SwiGLU, GQA, Qwen2's QKV bias, Qwen3's per-head q/k RMSNorm). A Qwen2-VL checkpoint gives a Qwen2
GPTModel with M-RoPE (``position_embedding_type="mrope"``) that also holds the HF vision tower as
``model.visual`` (replicated over TP; frozen unless asked to train): ``forward_logits`` with
``pixel_values`` runs the tower, writes its features over the image-pad rows of the token embedding
and hands that to the decoder as ``decoder_input`` (the structure of Megatron-Bridge's Qwen2.5-VL). Layers come from
``get_gpt_layer_local_spec()`` (plain torch, no Transformer Engine), so the same model runs on CPU
with gloo (see ``cpu_compat``) and on GPU with NCCL.
"""
from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from yatt_hpc.config.schema import TrainConfig, recompute_layers_problem
from yatt_hpc.moe.layers import adopt_moe_modules
from yatt_hpc.train import convert, cpu_compat
from yatt_hpc.train.hf_arch import HFArch, describe_hf_config
from yatt_hpc.train.mcore import (
    GPTModel,
    ModuleSpec,
    TransformerConfig,
    get_gpt_layer_local_spec,
    parallel_state,
    tensor_parallel,
)
from yatt_hpc.train.shared_prompt import SharedPromptAttention


def initialize_model_parallel(
    rank: int,
    world_size: int,
    leader_addr: str,
    leader_port: int,
    tp_size: int,
    seed: int = 0,
    timeout_s: float = 600.0,
    cuda_device: int | None = None,
    pp_size: int = 1,
    ep_size: int = 1,
    pp_layers: tuple[int, int] | None = None,
) -> None:
    """Join the trainer's process group (gloo on CPU, NCCL on CUDA) and set up TP=tp_size, PP=pp_size, CP=1,
    and expert parallelism EP=ep_size (a MoE model's experts split over ep ranks; Megatron's expert tensor
    parallelism is left at its default, tp, so ep must divide dp = world / (tp * pp)).

    ``rank``/``world_size`` and the leader's address come from the caller (MPI in the controller),
    never from environment variables. Data parallelism is ``world_size // (tp_size * pp_size)``; Megatron's
    rank order puts tp fastest, then dp, then pp (the plan's trainer layout). ``pp_layers`` gives the first and
    last stage their own layer counts (`placement.trainer.pp_layers`; `pipeline_stage` hands it to the model
    builder and the converter). ``cuda_device`` defaults to ``rank % device_count`` (ranks packed node by node).
    """
    global _pipeline_split
    if pp_layers is not None and pp_size == 1:
        raise ValueError(f"placement.trainer.pp_layers={list(pp_layers)} needs placement.trainer.pp > 1")
    _pipeline_split = None if pp_layers is None else tuple(pp_layers)
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
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=1,
        expert_model_parallel_size=ep_size,
    )
    if not cpu_compat.prepare_cpu_runtime(seed):
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


# The stage split the groups were built with, beside Megatron's own parallel state (which has no place for it):
# set by `initialize_model_parallel`, read by `pipeline_stage`, cleared by `destroy_model_parallel`.
_pipeline_split: tuple[int, int] | None = None


def pipeline_stage() -> convert.Stage:
    """This rank's pipeline stage (after `initialize_model_parallel`): the one description of its layers that
    the model builder, the converter, checkpoints and weight sync share."""
    return convert.Stage(parallel_state.get_pipeline_model_parallel_rank(),
                         parallel_state.get_pipeline_model_parallel_world_size(), _pipeline_split)


def built_group_sizes() -> dict[str, int]:
    """The sizes of the Megatron groups this rank is in (after `initialize_model_parallel`)."""
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size()}


def check_groups(planned: Any, dp_rank: int = 0) -> None:
    """Raise if the Megatron groups built differ from the plan's trainer layout (a `GroupPlan`): a
    data-parallel group larger than planned would sum more replicas' gradients than the batch has; or if this
    rank (replica `dp_rank`) is not the expert-parallel rank the plan's routes take it for (`Routes.expert_peers`)."""
    built, want = built_group_sizes(), dict(planned.layout)
    if built != want:
        raise RuntimeError(f"Megatron built groups {built} but the plan's trainer layout is {want}")
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep != planned.ep or parallel_state.get_expert_model_parallel_rank() != dp_rank % ep:
        raise RuntimeError(f"Megatron made replica {dp_rank} expert-parallel rank "
                           f"{parallel_state.get_expert_model_parallel_rank()} of {ep}; the plan has ep={planned.ep}")


def destroy_model_parallel() -> None:
    """Undo :func:`initialize_model_parallel` (tests run several worlds in one process)."""
    global _pipeline_split
    _pipeline_split = None
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation as ``train.recompute``, ``train.recompute_method`` and
    ``train.recompute_num_layers`` state it (``TrainConfig``'s docstrings say what each does)."""

    mode: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    def transformer_fields(self, model_layers: int) -> dict[str, Any]:
        """Megatron-Core's TransformerConfig fields for it (transformer_config.py, "activation recomputation"):
        `selective` is recompute_granularity=selective with Megatron's default recompute_modules, the core
        attention; `full` is recompute_granularity=full with the method and layer count as given."""
        if self.mode == "none":
            return {}
        if self.mode == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
        problem = recompute_layers_problem(TrainConfig(recompute=self.mode, recompute_method=self.method,
                                                       recompute_num_layers=self.num_layers), model_layers)
        if problem:
            raise ValueError(problem)
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}

    @classmethod
    def of(cls, cfg: Any) -> Recompute:
        """The recompute a `TrainConfig` asks for."""
        return cls(cfg.recompute, cfg.recompute_method, cfg.recompute_num_layers)


def build_transformer_config(
    arch: HFArch, tp_size: int, params_dtype: torch.dtype = torch.float32, recompute: Recompute = Recompute(),
    stage: convert.Stage | None = None,
) -> TransformerConfig:
    """The ``TransformerConfig`` whose local-spec layers reproduce the HF blocks of ``arch``, for pipeline
    `stage` (its count and split: every stage builds the same config; None: the whole model on one)."""
    gpt2 = arch.family == "gpt2"
    with warnings.catch_warnings():
        # selective recompute's "core_attn may be Transformer Engine's fused attention" note: ours is the local
        # spec's attention, whose scores and probabilities are what selective recompute is for
        warnings.filterwarnings("ignore", message="If you are using transformer_engine", category=UserWarning)
        return _transformer_config(arch, tp_size, params_dtype, recompute, gpt2, stage or convert.Stage())


def _transformer_config(arch: HFArch, tp_size: int, params_dtype: torch.dtype, recompute: Recompute,
                        gpt2: bool, stage: convert.Stage) -> TransformerConfig:
    layers = stage.layers(arch.num_layers)  # raises naming placement.trainer.pp(_layers) when they do not split
    pipeline = {} if stage.count == 1 else {
        "pipeline_model_parallel_size": stage.count,
        # uneven stages: Megatron offsets and sizes each stage's layers from these (transformer_block.py), the
        # converter from the same split (`convert.Stage`)
        **({} if stage.split is None else {"num_layers_in_first_pipeline_stage": stage.split[0],
                                           "num_layers_in_last_pipeline_stage": stage.split[1]}),
        "pipeline_dtype": params_dtype,
        # micro-batches of varied length and row count: each send is preceded by its shape
        "variable_seq_lengths": True,
        # a dense model has no token dispatcher; the default one (allgather) refuses variable lengths
        "moe_token_dispatcher_type": "alltoall",
        # the loss function returns the micro-batch's share of the mini-batch loss, already divided by
        # the global counts (`yatt_hpc/algos/aggregate.py`): the schedule must not divide it again
        "calculate_per_token_loss": True,
    }
    return TransformerConfig(
        **recompute.transformer_fields(len(layers)),
        **pipeline,
        **moe_fields(arch, parallel_state.get_expert_model_parallel_world_size()),
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
        activation_func=F.silu if arch.gated_mlp else activation(arch.activation),
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
        mrope_section=list(arch.mrope_section) if arch.mrope_section else None,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def moe_fields(arch: HFArch, ep_size: int) -> dict[str, Any]:
    """Megatron-Core's MoE fields (transformer_config.py, "MoE related") for HF's routed experts: Qwen3-MoE's
    router is a softmax over every expert, the top k kept, renormalised when ``norm_topk_prob``; Megatron's
    default (top k of the logits, softmax over them) is that renormalised softmax, ``moe_router_pre_softmax``
    the plain one. Experts are ``SequentialMLP`` (no grouped GEMM: that needs Transformer Engine or the
    grouped_gemm package). Tokens reach their experts through the all-gather dispatcher on CPU (Gloo's
    all_gather_into_tensor and reduce_scatter_tensor; the all-to-all dispatcher allocates CUDA streams) and
    the all-to-all dispatcher on GPU (NCCL). Qwen2-MoE's shared expert is Megatron's ``SharedExpertMLP`` with its
    gate: ``output * sigmoid(x @ gate_weight.T)``, transformers' ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``
    (shared_experts.py; modeling_qwen2_moe.py ``Qwen2MoeSparseMoeBlock``)."""
    if arch.moe is None:
        return {}
    shared = arch.moe.shared_ffn_hidden_size
    return {
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": shared is not None,
        "num_moe_experts": arch.moe.num_experts,
        "moe_router_topk": arch.moe.topk,
        "moe_ffn_hidden_size": arch.moe.ffn_hidden_size,
        "moe_router_pre_softmax": not arch.moe.norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": arch.moe.aux_loss_coeff,
        "moe_token_dispatcher_type": "allgather" if cpu_compat.is_cpu_runtime() else "alltoall",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": ep_size,
    }


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


NATIVE_ACTIVATIONS = {"gelu_new": tanh_gelu, "gelu_fast": tanh_gelu, "gelu_pytorch_tanh": tanh_gelu,
                      "gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swish": F.silu}


def activation(name: str):
    """HF's activation `name` as a function: the tanh GELUs (GPT-2's gelu_new, gelu_fast) as torch's one
    kernel, which is what the HF engine serves too (rollout/hf_fast.py); gelu, relu and silu as torch's;
    anything else through transformers' ACT2FN, imported only then (it pulls in ~2 s of transformers'
    model-loading machinery that a trainer rank otherwise never needs)."""
    if name in NATIVE_ACTIVATIONS:
        return NATIVE_ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def build_gpt_model(
    hf_config: Any,
    tp_size: int,
    params_dtype: torch.dtype = torch.float32,
    parallel_output: bool = True,
    train_vision: bool = False,
    recompute: Recompute = Recompute(),
) -> GPTModel:
    """This rank's TP shard of a GPTModel shaped like ``hf_config`` (randomly initialised).

    Needs :func:`initialize_model_parallel` first. With ``parallel_output=True`` the logits stay
    vocab-parallel ([B, T, padded_vocab / tp]), which is what ``logprobs`` expects. A vision-language
    config also builds its HF vision tower as ``model.visual``, trainable when ``train_vision``.
    ``recompute`` takes effect in training mode only (Megatron checks ``self.training``).
    """
    arch = describe_hf_config(hf_config, tp_size)
    stage = pipeline_stage()
    if arch.vision and stage.count > 1:
        raise ValueError("pipeline parallelism with a vision-language model is not supported: set "
                         "placement.trainer.pp=1")
    config = build_transformer_config(arch, tp_size, params_dtype, recompute, stage)
    rope = arch.rope_theta is not None
    # MultimodalRotaryEmbedding asks torch.cuda for a device; a tied head's first sync moves it to CUDA
    with cpu_compat.cuda_device_on_cpu():
        model = _gpt_model(arch, config, parallel_output, rope)
    if arch.vision:
        model.visual = _vision_tower(hf_config).requires_grad_(train_vision)
        model.image_token_id = int(hf_config.image_token_id)
    cpu_compat.make_rope_cpu_safe(model)
    cpu_compat.use_onednn_forward(model)  # fp32 layers' forward products through oneDNN on a CPU (cpu_compat.py)
    cpu_compat.add_embedding_grads_in_place(model)  # no dense table-sized gradient a micro-batch (cpu_compat.py)
    if arch.moe is not None:
        cpu_compat.make_moe_mappings_cpu_safe()
    adopt_moe_modules(model, tp_size)  # the trainer's router and MoE layer classes (moe/layers.py)
    if params_dtype != torch.float32:
        # what Megatron's Float16Module does: the norms and position embeddings of the local spec are
        # built in fp32 whatever params_dtype says, so the whole model is cast once
        model.to(params_dtype)
    if not cpu_compat.is_cpu_runtime():
        model.cuda(torch.cuda.current_device())
    return model


def _gpt_model(arch: HFArch, config: TransformerConfig, parallel_output: bool, rope: bool) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(arch, config),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_positions,
        parallel_output=parallel_output,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="mrope" if arch.mrope_section else "rope" if rope else "learned_absolute",
        rotary_base=int(arch.rope_theta) if rope else 10000,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        seq_len_interpolation_factor=arch.rope_interpolation_factor,
    )


def _vision_tower(hf_config: Any) -> torch.nn.Module:
    """The HF vision tower of a Qwen2-VL config (random init; the converter loads its weights)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VisionTransformerPretrainedModel._from_config(hf_config.vision_config)


def _layer_spec(arch: HFArch, config: TransformerConfig) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(num_experts=arch.moe.num_experts if arch.moe else None,
                                    normalization=config.normalization, qk_layernorm=arch.qk_norm)
    # Megatron's own attention unless a shared-prompt forward is running (train/shared_prompt.py)
    spec.submodules.self_attention.submodules.core_attention = SharedPromptAttention
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
    model: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
    images: VisionInputs | None = None,
) -> torch.Tensor:
    """Logits [B, T, V_local] for right-padded ``input_ids`` [B, T] (causal mask, positions 0..T-1).

    With ``images`` (a vision model's batch: pixel values of every image of the rows in order, their
    grids, and M-RoPE ``position_ids`` [3, B, T]) the tower's features replace the image-pad rows.
    """
    batch, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
    mask = causal_attention_mask(seq_len, input_ids.device)
    if images is None:
        return model(input_ids, position_ids, mask)
    return model(input_ids, images.position_ids, mask, decoder_input=vision_decoder_input(model, input_ids, images))


@dataclass
class VisionInputs:
    """What a vision model's forward needs beyond the tokens (built on the rank that runs it)."""

    pixel_values: torch.Tensor | None
    """[patches, C * temporal_patch * patch * patch] of every image of the batch, row by row; None when no
    row of the batch holds an image."""
    image_grid_thw: torch.Tensor | None
    """[images, 3] (temporal, height, width) patch grid of each image."""
    position_ids: torch.Tensor
    """[3, B, T] M-RoPE positions."""
    image_mask: torch.Tensor | None = None
    """[B, T] bool: the image-pad slots the features go to (the prompts' pads; a pad token a policy
    sampled in its response is text). None: every image-pad token."""


def vision_decoder_input(model: GPTModel, input_ids: torch.Tensor, images: VisionInputs) -> torch.Tensor:
    """[T, B, H] token embeddings with the vision tower's features over the image-pad tokens (in row-major
    (row, position) order, the order HF's ``masked_scatter`` gives)."""
    embeds = model.embedding(input_ids=input_ids, position_ids=None)
    slots = images.image_mask if images.image_mask is not None else input_ids == model.image_token_id
    where = slots.nonzero(as_tuple=True)  # (rows, positions)
    if images.pixel_values is None:
        if where[0].numel():
            raise ValueError(f"{where[0].numel()} image-pad tokens but no images in the batch")
        return embeds
    features = model.visual(images.pixel_values.to(embeds.dtype), grid_thw=images.image_grid_thw).pooler_output
    if features.shape[0] != where[0].numel():
        raise ValueError(f"the batch has {where[0].numel()} image-pad tokens but its images give "
                         f"{features.shape[0]} features (grids {images.image_grid_thw.tolist()})")
    return embeds.index_put((where[1], where[0]), features.to(embeds.dtype))
