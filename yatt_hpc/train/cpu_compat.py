"""Everything megatron-core 0.16 needs to run a GPTModel on a CPU-only torch build, in one place.

    from yatt_hpc.train import cpu_compat
    cpu_compat.prepare_cpu_runtime(seed)      # after parallel_state.initialize_model_parallel
    model = GPTModel(...)
    cpu_compat.make_rope_cpu_safe(model)      # before the first forward

Nothing here runs at import time, and every function returns without touching anything when CUDA
is available: on a GPU machine megatron's own code paths are used unchanged. Each accommodation
names the megatron source line it steps around, so it can be dropped when upstream fixes it.

Activation recomputation (``train.recompute``) runs through Megatron's own ``tensor_parallel.checkpoint``,
whose RNG bookkeeping reads and restores the CUDA generator's state; on CPU that bookkeeping covers the
CPU generator and the tracker only (``_use_cpu_rng_states``).

Megatron's pipeline schedules (``pipeline_parallel/schedules.py``, ``p2p_communication.py``) run on CPU
inside ``pipeline_on_cpu()``: they allocate with ``device="cuda"`` and ``torch.cuda.current_device()`` and
call ``torch.cuda.synchronize()`` after batched sends.

Megatron's linear layers compute ``torch.matmul(input, weight.t())`` (``tensor_parallel/layers.py``,
``LinearWithGradAccumulationAndAsyncCommunication.forward``), which torch gives MKL for fp32; on this CPU
oneDNN's matmul is 1.2-2x as fast for the same product (``device/cpu_matmul.py``). ``use_onednn_forward``
gives each fp32 layer's forward to oneDNN; its backward is Megatron's input gradient and tensor-parallel
all-reduce, with the weight gradient added into ``weight.grad`` by the product itself
(``accumulate_weight_grad``: Megatron's gradient-accumulation fusion, which on a GPU writes ``main_grad``).
The layers keep their parameters, and any call this does not cover (sequence parallel, Megatron's own
gradient-accumulation fusion, deferred weight gradients, a frozen weight under autograd as LoRA's base
layers) goes to Megatron's own function unchanged. ``add_embedding_grads_in_place`` does the same for the
word embedding's backward (``_WordEmbeddingIntoGrad``).

Not covered, because our trainer does not use them on CPU:
megatron ``DistributedDataParallel``, ``get_megatron_optimizer`` (literal ``"cuda"`` devices),
``dist_checkpointing.save`` (CUDA sync), ``sequence_parallel`` (needs TE/Apex). The default causal
mask (``transformer/utils.py::get_default_causal_mask`` builds it with ``device="cuda"``) is avoided
by always passing an explicit mask, see ``megatron_model.causal_attention_mask``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Iterator

import torch

from yatt_hpc.device import cpu_matmul
from yatt_hpc.train.mcore import GlobalMemoryBuffer, RotaryEmbedding, parallel_state, tensor_parallel

_layers = tensor_parallel.layers


def is_cpu_runtime() -> bool:
    """True when megatron must be steered away from CUDA (a CPU-only build or no visible GPU)."""
    return not torch.cuda.is_available()


def prepare_cpu_runtime(seed: int) -> bool:
    """Seed the RNG trackers and re-home the global scratch buffer on CPU; False (no-op) on CUDA.

    Call once per process, after ``parallel_state.initialize_model_parallel``.
    """
    if not is_cpu_runtime():
        return False
    torch.manual_seed(seed)
    # The default tracker seeds with torch.cuda.manual_seed and forks CUDA RNG states; the
    # inference tracker is a plain-CPU stand-in (megatron/core/tensor_parallel/random.py).
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    # Attention and TP all-gathers borrow scratch tensors from this buffer, which allocates with
    # device=torch.cuda.current_device() (megatron/core/utils.py::GlobalMemoryBuffer.get_tensor).
    buffer = parallel_state.get_global_memory_buffer()
    if not isinstance(buffer, _CpuGlobalMemoryBuffer):
        buffer.__class__ = _CpuGlobalMemoryBuffer
    _use_cpu_rng_states()
    return True


def _use_cpu_rng_states() -> None:
    """Megatron's activation checkpoint (``CheckpointFunction``, ``CheckpointWithoutOutput``) saves the RNG
    states before the forward and restores them around the recompute, so dropout draws the same masks twice.
    Its ``_get_all_rng_states`` calls ``torch.cuda.random.get_rng_state``, which a CPU build refuses, and
    ``_set_all_rng_states`` queues a CUDA callback that never runs (tensor_parallel/random.py). On CPU the
    only generator is the CPU one, so the pair becomes (CPU state, no CUDA state, the tracker's states)."""
    tp_random = tensor_parallel.random
    tp_random._get_all_rng_states = _get_cpu_rng_states
    tp_random._set_all_rng_states = _set_cpu_rng_states


def _get_cpu_rng_states():
    return torch.get_rng_state(), None, tensor_parallel.random.get_cuda_rng_tracker().get_states()


def _set_cpu_rng_states(cpu_rng_state, _cuda_rng_state, tracker_states) -> None:
    torch.set_rng_state(cpu_rng_state)
    tensor_parallel.random.get_cuda_rng_tracker().set_states(tracker_states)


def make_rope_cpu_safe(model: torch.nn.Module) -> int:
    """Keep every RoPE module of ``model`` on CPU; returns how many were changed (0 on CUDA).

    ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on its first
    call whenever it sits on CPU, with no flag to stop it (rotary_pos_embedding.py, ``get_emb``).
    The replacement class differs only by skipping that move; ``inv_freq`` (incl. Llama-3
    scaling) is kept as computed by megatron.
    """
    if not is_cpu_runtime():
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = _CpuRotaryEmbedding
            changed += 1
    return changed


@contextlib.contextmanager
def cuda_device_on_cpu() -> Iterator[None]:
    """While building a model on CPU, ``torch.cuda.current_device()`` answers ``"cpu"`` and
    ``Tensor.cuda()`` leaves a tensor where it is.

    ``MultimodalRotaryEmbedding.__init__`` (M-RoPE, rotary_pos_embedding.py) builds ``inv_freq`` with
    ``device=torch.cuda.current_device()`` and has no CPU branch; with pipeline stages and tied embeddings
    ``LanguageModule.setup_embeddings_and_output_layer`` moves the head's copy to CUDA before its first
    all-reduce (language_module.py, ``weight.data.cuda()``). A no-op on CUDA.
    """
    if not is_cpu_runtime():
        yield
        return
    saved, saved_cuda = torch.cuda.current_device, torch.Tensor.cuda
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda = saved, saved_cuda


class _CpuTorch:
    """``torch`` as the pipeline schedules see it on CPU: ``torch.zeros(..., device="cuda")`` (the token
    counter of every schedule, schedules.py) allocates on the CPU; everything else is torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def pipeline_on_cpu() -> Iterator[None]:
    """Run Megatron's pipeline schedules on CPU (gloo point-to-point): receive buffers and shape messages
    on the CPU (``p2p_communication.py`` allocates on ``torch.cuda.current_device()``), no CUDA sync after a
    batched exchange, the schedules' token counter on the CPU. A no-op on CUDA."""
    if not is_cpu_runtime():
        yield
        return
    from megatron.core.pipeline_parallel import schedules

    saved = torch.cuda.current_device, torch.cuda.synchronize, schedules.torch
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    schedules.torch = _CpuTorch()
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, schedules.torch = saved


def make_moe_mappings_cpu_safe() -> bool:
    """Let Megatron's sequence-parallel gather and reduce-scatter allocate on the CPU; False (no-op) on CUDA.

    The MoE all-gather dispatcher moves tokens with ``gather_from_sequence_parallel_region`` and
    ``reduce_scatter_to_sequence_parallel_region``, whose output buffers are ``torch.empty(...,
    device=torch.cuda.current_device())`` (tensor_parallel/mappings.py, forward and backward alike). The
    module's own ``torch`` is replaced by one whose ``cuda.current_device()`` answers ``"cpu"``; the
    collectives are torch's (Gloo has all_gather_into_tensor and reduce_scatter_tensor).
    """
    if not is_cpu_runtime():
        return False
    from megatron.core.tensor_parallel import mappings

    if not isinstance(mappings.torch, _CpuDeviceTorch):
        mappings.torch = _CpuDeviceTorch()
    return True


class _CpuCuda:
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"


class _CpuDeviceTorch:
    """``torch`` whose ``torch.cuda.current_device()`` is the CPU (see `make_moe_mappings_cpu_safe`)."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


class _CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
    """``GlobalMemoryBuffer`` that allocates on the CPU instead of the current CUDA device."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = math.prod(tensor_shape)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required_len:
            buffer = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = buffer
        return buffer[:required_len].view(*tensor_shape)


class _CpuRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose ``get_emb`` leaves ``inv_freq`` where it is.

    The body mirrors megatron-core 0.16.1 ``RotaryEmbedding.get_emb`` minus its first two lines
    (the CUDA move); ``forward``'s lru_cache and CP slicing are inherited unchanged.
    """

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        return emb[:, None, None, :]


class _OneDnnForwardLinear(torch.autograd.Function):
    """Megatron's linear autograd function (``LinearWithGradAccumulationAndAsyncCommunication``) for the cases
    `_forward_impl` sends here (no sequence parallel, no deferred weight gradients), with the forward's product
    through oneDNN and the weight's gradient added into `weight.grad` (`accumulate_weight_grad`); the input's
    gradient and its overlapped tensor-parallel all-reduce are computed as Megatron's backward computes them."""

    @staticmethod
    @_layers.custom_fwd  # as Megatron's forward
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(input, weight)
        ctx.use_bias, ctx.allreduce_dgrad, ctx.tp_group = bias is not None, allreduce_dgrad, tp_group
        return _onednn_product(input, weight, bias)

    @staticmethod
    @_layers.custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:  # overlapped with the weight gradient, as Megatron's
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_output, input = _layers.prepare_input_tensors_for_wgrad_compute(grad_output, input)
        grad_weight = None
        if weight.is_leaf:  # a parameter: into its .grad
            accumulate_weight_grad(weight, grad_output, input)
        else:  # a weight computed in the forward: its gradient flows on through autograd
            grad_weight = grad_output.t().matmul(input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None


def accumulate_weight_grad(weight: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """``weight.grad += grad_output.T @ input`` in place ([rows, out] and [rows, in]); the product itself when
    `weight` has no gradient yet.

    Megatron's gradient-accumulation fusion does this on a GPU (``fused_weight_gradient_mlp_cuda`` into
    ``weight.main_grad``, which its DistributedDataParallel provides); without it, each micro-batch's backward
    makes a new gradient of the weight's size and autograd adds it to ``.grad``. At Qwen2.5-0.5B's output
    projection (151,936 x 896, fp32) that is 544 MB a micro-batch, newly faulted in where glibc cannot reuse
    the last one's block: 1.5 s against 0.3 s for the product added in place (352 rows, 2 threads)."""
    if weight.grad is None:
        weight.grad = torch.matmul(grad_output.t(), input)
    else:
        weight.grad.addmm_(grad_output.t(), input)


def _onednn_product(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    output = cpu_matmul.onednn_linear(input, weight)
    return output if bias is None else output + bias  # the bias after the product, as Megatron adds it


_SIGNATURE = inspect.signature(_layers.linear_with_grad_accumulation_and_async_allreduce)


def _forward_impl(original, input, weight, *args, **kwargs):
    """A ColumnParallelLinear / RowParallelLinear `_forward_impl`: oneDNN's forward where `use_onednn_forward`
    covers the call, `original` (the layer's own) otherwise."""
    call = _SIGNATURE.bind(input, weight, *args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    plain = not (a["sequence_parallel"] or a["gradient_accumulation_fusion"] or a["grad_output_buffer"] is not None)
    if not (plain and cpu_matmul.runs_on_onednn(input, weight)):
        return original(input, weight, *args, **kwargs)
    bias = a["bias"]
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (input, weight, bias)):
        return _onednn_product(input, weight, bias)  # no graph to build: a no-grad pass, a reference model
    if not weight.requires_grad:
        return original(input, weight, *args, **kwargs)  # a frozen weight under autograd (LoRA's base layers)
    tp_group = a["tp_group"] or parallel_state.get_tensor_model_parallel_group()  # Megatron's default, as its own
    return _OneDnnForwardLinear.apply(input, weight, bias, a["allreduce_dgrad"], tp_group)


def use_onednn_forward(model: torch.nn.Module) -> int:
    """Route the forward product of `model`'s tensor-parallel linear layers through oneDNN (above) on a CPU
    runtime; returns how many layers now can (a layer decides per call: fp32, its weight large enough)."""
    if not is_cpu_runtime() or not cpu_matmul.onednn_linear_available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, (_layers.ColumnParallelLinear, _layers.RowParallelLinear))]
    for layer in layers:
        layer._forward_impl = functools.partial(_forward_impl, layer._forward_impl)
    return len(layers)


class _WordEmbeddingIntoGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds each looked-up row's gradient into ``weight.grad`` in place.

    torch's embedding backward makes a dense gradient of the whole table, zeros but for the rows looked up,
    which autograd then adds to ``.grad``: at Qwen2.5-0.5B's 151,936 x 896 fp32 table that is 544 MB zero-filled
    and 544 MB added for a micro-batch of a few hundred tokens. ``index_add_`` adds the rows in index order (its
    CPU kernel runs the indices in sequence), so the sum is the same on every run and thread count."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ids, weight = ctx.saved_tensors
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(weight.grad.dtype))
        return None, None


def _embedding_forward(layer, original, input_):
    """A VocabParallelEmbedding's forward with `_WordEmbeddingIntoGrad` for its lookup where `add_embedding_grads_in_place`
    covers the call (a trained fp32 table of `ONEDNN_MIN_WEIGHT` entries and up, under autograd, no sequence
    parallel or deterministic mode); `original` (Megatron's own) otherwise. The rest is Megatron-Core 0.16's
    forward: ids outside this rank's vocabulary slice look up row 0 and are zeroed, then the sum over the
    tensor-parallel group."""
    weight = layer.weight
    if (layer.reduce_scatter_embeddings or layer.deterministic_mode or not torch.is_grad_enabled()
            or not (weight.is_leaf and weight.requires_grad) or weight.dtype != torch.float32
            or weight.numel() < cpu_matmul.ONEDNN_MIN_WEIGHT):
        return original(input_)
    split = layer.tp_group.size() > 1
    if split:
        outside = (input_ < layer.vocab_start_index) | (input_ >= layer.vocab_end_index)
        input_ = (input_ - layer.vocab_start_index).masked_fill_(outside, 0)
    output = _WordEmbeddingIntoGrad.apply(input_, weight)
    if split:
        output = output.masked_fill(outside[..., None], 0.0)
    return _layers.reduce_from_tensor_model_parallel_region(output, group=layer.tp_group)


def add_embedding_grads_in_place(model: torch.nn.Module) -> int:
    """Give `model`'s vocabulary-parallel embeddings `_embedding_forward` on a CPU runtime; returns how many."""
    if not is_cpu_runtime():
        return 0
    tables = [m for m in model.modules() if isinstance(m, _layers.VocabParallelEmbedding)]
    for table in tables:
        table.forward = functools.partial(_embedding_forward, table, table.forward)
    return len(tables)
