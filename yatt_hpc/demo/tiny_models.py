"""Tiny GPT-2 models over the demo task's character tokenizer: the one builder that tests,
benchmarks and `tools/make_demo_models.py` share.

    model = char_gpt2(n_embd=32, n_positions=64, seed=0)     # random weights
    save_char_model(model, Path("out/policy"))                # safetensors + tokenizer files
    dirs = save_random_pair(Path("out"), n_embd=32)           # {"policy": ..., "judge": ...}
    set_eos_rate(model, 0.02)        # P(eos) ~ 2% per token: near-geometric (long-tail) response lengths
    moe = char_qwen3_moe(seed=0)     # a random Qwen3-MoE (4 experts, 2 per token) over the same tokenizer
    moe = char_qwen2_moe(seed=0)     # a random Qwen2-MoE: the same, plus a gated shared expert

Dropout is off (the RL loop compares trainer and rollout log-probs of the same weights) and the
embeddings are tied, as in the committed demo models.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from yatt_hpc.demo.char_tokenizer import CharTokenizer


def char_gpt2(n_embd: int = 32, n_layer: int = 2, n_head: int = 2, n_positions: int = 64, seed: int | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel  # imported here: transformers import is slow

    tok = CharTokenizer()
    config = GPT2Config(vocab_size=tok.vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        n_positions=n_positions, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                        pad_token_id=tok.pad_id)
    if seed is not None:
        torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def char_qwen3_moe(hidden: int = 32, layers: int = 2, experts: int = 4, topk: int = 2, n_positions: int = 64,
                   aux_loss_coef: float = 0.01, seed: int | None = None):
    """A random Qwen3-MoE over the character tokenizer: Qwen3 attention (2 query heads per KV head, q/k norms),
    every layer `experts` SwiGLU experts of width `hidden`, `topk` per token, renormalised (norm_topk_prob)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = CharTokenizer()
    config = Qwen3MoeConfig(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts, num_experts_per_tok=topk,
                            norm_topk_prob=True, router_aux_loss_coef=aux_loss_coef, max_position_embeddings=n_positions,
                            tie_word_embeddings=True, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                            pad_token_id=tok.pad_id)
    return _seeded_moe(Qwen3MoeForCausalLM, config, seed)


def char_qwen2_moe(hidden: int = 32, layers: int = 2, experts: int = 4, topk: int = 2, n_positions: int = 64,
                   aux_loss_coef: float = 0.01, seed: int | None = None):
    """A random Qwen2-MoE over the character tokenizer: Qwen2 attention (Q/K/V biases, 2 query heads per KV head),
    every layer `experts` SwiGLU experts of width `hidden`, `topk` per token, plus a shared expert of width
    2 * `hidden` behind its sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = CharTokenizer()
    config = Qwen2MoeConfig(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden, shared_expert_intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
                            num_experts_per_tok=topk, norm_topk_prob=True, router_aux_loss_coef=aux_loss_coef,
                            max_position_embeddings=n_positions, tie_word_embeddings=True, bos_token_id=tok.bos_id,
                            eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    return _seeded_moe(Qwen2MoeForCausalLM, config, seed)


def _seeded_moe(model_class, config, seed: int | None):
    """`model_class(config)` seeded, its routers drawn: HF starts a router at zero, every expert tied, so each
    token gets a preference."""
    if seed is not None:
        torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


def save_char_model(model, directory: Path) -> str:
    """`save_pretrained` (safetensors only) plus the tokenizer files the engines and judge read."""
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    CharTokenizer().save(directory)
    return str(directory)


def save_random_pair(root: Path, **shape) -> dict[str, str]:
    """A random policy (seed 0) and judge (seed 1) of the same shape under `root`."""
    return {name: save_char_model(char_gpt2(seed=seed, **shape), Path(root) / name)
            for seed, name in enumerate(("policy", "judge"))}


def set_eos_rate(model, eos_rate: float, seed: int = 0) -> None:
    """Push the end-of-sequence embedding along the mean final hidden state so that P(eos) is about
    `eos_rate` per token: response lengths then follow a near-geometric (exponential-tail) law."""
    tok = CharTokenizer()
    width = model.config.n_embd
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tokens = torch.randint(4, tok.vocab_size, (64, 64), generator=generator)
        hidden = model.transformer(tokens).last_hidden_state.reshape(-1, width)
        direction = hidden.mean(0) / hidden.mean(0).norm()
        logit = np.log(eos_rate * (tok.vocab_size - 1) / (1 - eos_rate))  # vs the other tokens' ~0 logits
        model.transformer.wte.weight[tok.eos_id] = direction * logit / float((hidden @ direction).mean())
