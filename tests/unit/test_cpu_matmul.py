"""fp32 products through oneDNN (device/cpu_matmul.py): the engine's layers (tests/unit/test_hf_fast.py) and the
trainer's Megatron layers (train/cpu_compat.py), whose gradients (added into `.grad` in place, the embedding's
row by row) stay within fp32 rounding of Megatron's own over several micro-batches."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from yatt_hpc.device.cpu_matmul import ONEDNN_MIN_WEIGHT, onednn_linear, onednn_linear_available, runs_on_onednn

ONEDNN_OP = "mkldnn._linear_pointwise"


def ops_called(fn) -> set[str]:
    """Every aten-level op `fn` runs (its forward, and a backward it runs)."""
    called: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            called.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return called


def test_the_product_is_fp32_and_only_large_fp32_cpu_weights_take_it():
    assert onednn_linear_available()  # torch's CPU wheel has oneDNN: the tests below must not pass by doing nothing
    torch.manual_seed(0)
    x, w, b = torch.randn(33, 512), torch.randn(1024, 512), torch.randn(1024)
    want = (x.double() @ w.double().T + b.double())
    got = onednn_linear(x, w, b)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-4  # bf16 rounding would be ~0.1
    assert runs_on_onednn(x, w) and not runs_on_onednn(x, w[:, :255])  # 1024 x 255 < 512 x 512
    assert ONEDNN_MIN_WEIGHT == 512 * 512
    assert not runs_on_onednn(x.bfloat16(), w.bfloat16()) and not runs_on_onednn(x, w.double())


def _megatron_pair(tied: bool = False, recompute: str = "none"):
    """Two copies of one Megatron GPT model of a Qwen2 shape wide enough for oneDNN (hidden 512, MLP 1024, a
    2,048-token vocabulary, the head untied or tied, `train.recompute` as given): the first as built (oneDNN
    forwards, gradients added in place), the second with every layer's own Megatron `_forward_impl` and the
    embedding's own forward back."""
    from transformers import Qwen2Config

    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.mcore import tensor_parallel

    config = Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=2048, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    torch.manual_seed(0)
    again = mm.Recompute(mode=recompute)  # full: each layer's forward runs again inside the backward
    ours, megatrons = mm.build_gpt_model(config, 1, recompute=again), mm.build_gpt_model(config, 1, recompute=again)
    with torch.no_grad():
        for p, q in zip(ours.parameters(), megatrons.parameters(), strict=True):
            q.copy_(p)
    restored = 0
    for layer in megatrons.modules():
        if isinstance(layer, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)):
            assert isinstance(layer._forward_impl, functools.partial)
            layer._forward_impl = layer._forward_impl.args[0]
            restored += 1
        if isinstance(layer, tensor_parallel.VocabParallelEmbedding):
            assert isinstance(layer.forward, functools.partial)
            del layer.forward
            restored += 1
    assert restored == 2 * 4 + 1 + 1  # qkv, proj, fc1, fc2 a layer; the output layer; the word embedding
    return ours, megatrons


def _loss(model, tokens):
    from yatt_hpc.train import megatron_model as mm

    logits = mm.forward_logits(model, tokens)
    return logits, logits.float().log_softmax(-1).mean() + logits.square().mean()


@pytest.mark.parametrize(("tied", "recompute"), [(False, "none"), (True, "none"), (True, "full")],
                         ids=["untied", "tied", "tied-full-recompute"])
def test_megatron_layers_forward_through_onednn_and_keep_megatrons_gradients(one_rank_world, tied, recompute):
    ours, megatrons = _megatron_pair(tied, recompute)
    batches = [torch.randint(3, 2048, (3, 17), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    for model in (ours, megatrons):
        model.train()
    # three micro-batches: the first makes each gradient, the others add into it
    ops = [ops_called(lambda t=tokens: _loss(ours, t)[1].backward()) for tokens in batches]
    assert all(ONEDNN_OP in called and "aten.embedding_dense_backward" not in called for called in ops)
    assert all("aten.index_add_" in called for called in ops) and all("aten.addmm_" in called for called in ops[1:])
    want_ops = set().union(*[ops_called(lambda t=tokens: _loss(megatrons, t)[1].backward()) for tokens in batches])
    assert ONEDNN_OP not in want_ops and "aten.embedding_dense_backward" in want_ops
    logits, want = _loss(ours, batches[0])[0], _loss(megatrons, batches[0])[0]
    assert (logits - want).abs().max() <= 1e-5 * want.abs().max()
    checked = 0
    for (name, p), (_, q) in zip(ours.named_parameters(), megatrons.named_parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert (p.grad - q.grad).abs().max() <= 1e-4 * q.grad.abs().max() + 1e-12, name
        checked += q.grad.abs().max() > 0
    assert checked >= 10
    with torch.no_grad():  # a no-grad pass (log-probs, a reference model) takes the product alone
        assert ONEDNN_OP in ops_called(lambda: _loss(ours, batches[0]))
        assert (_loss(ours, batches[0])[0] - _loss(megatrons, batches[0])[0]).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("case", ["bf16", "frozen-weights-under-autograd", "only-biases-trained"])
def test_what_oneDNN_does_not_cover_is_megatrons_own_bit_for_bit(one_rank_world, case):
    ours, megatrons = _megatron_pair()
    if case == "bf16":
        ours, megatrons = ours.bfloat16(), megatrons.bfloat16()
    else:  # LoRA's base layers: a frozen weight whose input needs a gradient; or a frozen weight, its bias trained
        for model in (ours, megatrons):
            for name, p in model.named_parameters():
                p.requires_grad_(("embedding" if case == "frozen-weights-under-autograd" else "bias") in name)
    tokens = torch.randint(3, 2048, (2, 9), generator=torch.Generator().manual_seed(2))
    assert ONEDNN_OP not in ops_called(lambda: _loss(ours, tokens)[1].backward())
    _loss(megatrons, tokens)[1].backward()
    assert torch.equal(_loss(ours, tokens)[0], _loss(megatrons, tokens)[0])
    for (name, p), (_, q) in zip(ours.named_parameters(), megatrons.named_parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
