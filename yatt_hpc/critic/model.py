"""The value model: Megatron-Core's GPTModel with a scalar head, and its Hugging Face layout both ways.

    model = build_value_model(hf_config, tp_size, params_dtype)       # after initialize_model_parallel
    shard = value_shard(load_hf_state_dict(d), hf_config, tp_rank, tp_size, seed, init_std)
    megatron_model.load_megatron_shard(model, shard)
    values = megatron_model.forward_logits(model, input_ids)[..., 0]  # [B, T]: the head's output
    hf = to_token_classification(shards, hf_config)                   # {hf name: tensor}, *ForTokenClassification

The decoder is the policy's architecture (`train/megatron_model.py`, the same converter rules); the LM head is
replaced by `ValueHead`, a Linear(hidden, 1) with a bias on the final norm's output, replicated on every tensor
rank (its input, the final norm's output, is whole on each; each rank computes the same value and the same head
gradient, and the decoder's gradient arrives whole as it does from a column-parallel head's input). That is
transformers' `*ForTokenClassification` with `num_labels: 1` (GPT-2 names the head `classifier`, Llama, Qwen2 and
Qwen3 `score`; the backbone's names are the causal LM's), so an exported critic loads there, and a reward model
saved as `*ForSequenceClassification` (`score`, no bias) gives its head as the start. The value at position t
is V of the state ending there: the position whose logit samples the next token, as the log-probabilities align.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from yatt_hpc.train import convert, megatron_model
from yatt_hpc.train.hf_arch import describe_hf_config

HEAD_NAMES = ("score", "classifier")
"""The HF names of a one-label head: `score` (Llama, Qwen2, Qwen3; every *ForSequenceClassification), `classifier`
(GPT2ForTokenClassification)."""
TOKEN_CLASSIFICATION = {"gpt2": ("GPT2ForTokenClassification", "classifier"),
                        "llama": ("LlamaForTokenClassification", "score"),
                        "qwen2": ("Qwen2ForTokenClassification", "score"),
                        "qwen3": ("Qwen3ForTokenClassification", "score")}


class ValueHead(torch.nn.Module):
    """Linear(hidden, 1) in GPTModel's `output_layer` slot: called as Megatron calls its output layer
    (`hidden, weight=..., runtime_gather_output=...` -> (output, bias)); the tied embedding it is offered is
    not used."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return F.linear(hidden, self.weight, self.bias), None


def build_value_model(hf_config: Any, tp_size: int, params_dtype: torch.dtype = torch.float32,
                      recompute: megatron_model.Recompute | None = None):
    """This rank's TP shard of its pipeline stage of the value model (random decoder, zero head on the last stage):
    `load_megatron_shard` fills it. Its head is its own, never the embedding: no tied weights to keep in step."""
    arch = describe_hf_config(hf_config, tp_size)
    if arch.moe is not None:  # its load-balancing loss, export and checks are not wired (docs/moe.md)
        raise ValueError(f"train.adv_estimator=gae with a mixture-of-experts model ({arch.family}): a value model of "
                         "routed experts is not mapped (no token-classification export, no aux-loss scaling for its "
                         "update); set train.critic.path to a dense model's directory, or use a critic-free "
                         "estimator such as grpo")
    model = megatron_model.build_gpt_model(hf_config, tp_size, params_dtype=params_dtype,
                                           recompute=recompute or megatron_model.Recompute())
    if model.post_process:
        device = next(model.parameters()).device
        model.output_layer = ValueHead(describe_hf_config(hf_config, tp_size).hidden_size, params_dtype, device)
    model.share_embeddings_and_output_weights = False
    return model


def _backbone_rules(hf_config: Any, tp_size: int, stage: convert.Stage) -> tuple[Any, list[convert.Rule]]:
    arch = describe_hf_config(hf_config, tp_size)
    rules = [rule for unit in convert.weight_rules(arch, stage) for rule in unit if rule.megatron != "output_layer.weight"]
    return arch, rules


def hf_head(hf_state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor] | None:
    """The one-label head an HF directory holds (`score.*` or `classifier.*`), as {"weight" [1, H], "bias"
    [1]} (a bias-free head gets 0), or None (a causal LM: no head). More than one label is refused."""
    for name in HEAD_NAMES:
        weight = hf_state.get(f"{name}.weight")
        if weight is None:
            continue
        if weight.ndim != 2 or weight.shape[0] != 1:
            raise ValueError(f"{where}: its head {name}.weight has shape {list(weight.shape)}, {weight.shape[0]} "
                             "labels; a value model has one (num_labels 1): use a one-label reward or value model, "
                             "or a causal LM (a new head)")
        bias = hf_state.get(f"{name}.bias")
        return {"weight": weight, "bias": torch.zeros(1, dtype=weight.dtype) if bias is None else bias.reshape(1)}
    return None


def value_shard(hf_state: dict[str, torch.Tensor], hf_config: Any, tp_rank: int, tp_size: int, seed: int,
                init_std: float, where: str, stage: convert.Stage | None = None) -> dict[str, torch.Tensor]:
    """The Megatron shard of pipeline `stage` of the value model: the decoder from `hf_state` (a causal LM's, or a
    classifier's), on the last stage the head from its one-label head, or new: N(0, init_std^2) from a generator
    seeded by `seed` (the same on every rank), bias 0. An LM head in `hf_state` is not used."""
    stage = stage or convert.Stage()
    arch, rules = _backbone_rules(hf_config, tp_size, stage)
    head = hf_head(hf_state, where)
    needed = {name for rule in rules for name in rule.hf}
    missing = sorted(needed - set(hf_state))
    if missing:
        raise ValueError(f"{where}: the value model's decoder needs {missing[:3]} (and {max(len(missing) - 3, 0)} "
                         f"more), which the directory does not hold; is it a {arch.family} model?")
    shard = {rule.megatron: convert.split_tensor(rule, [hf_state[n] for n in rule.hf], arch, tp_rank, tp_size)
             for rule in rules}
    if not stage.last:
        return shard
    dtype = next(iter(shard.values())).dtype
    if head is None:
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, arch.hidden_size, generator=gen, dtype=torch.float32) * init_std
        head = {"weight": weight, "bias": torch.zeros(1)}
    shard["output_layer.weight"] = head["weight"].to(dtype).contiguous()
    shard["output_layer.bias"] = head["bias"].to(dtype).contiguous()
    return shard


def to_token_classification(stages: list[list[dict[str, torch.Tensor]]], hf_config: Any) -> dict[str, torch.Tensor]:
    """The HF state dict of a `*ForTokenClassification` (num_labels 1) from the value model's shards (`stages[pp][tp]`):
    the decoder under the causal LM's names, the head (the last stage's) under `classifier`/`score`."""
    out = {}
    for index, shards in enumerate(stages):
        arch, rules = _backbone_rules(hf_config, len(shards), convert.Stage(index, len(stages)))
        if arch.family not in TOKEN_CLASSIFICATION:
            raise ValueError(f"no *ForTokenClassification is mapped for model_type={arch.family!r}")
        for rule in rules:
            if not rule.copy:
                out.update(convert.merge_tensor(rule, [s[rule.megatron] for s in shards], arch))
    head = TOKEN_CLASSIFICATION[arch.family][1]
    out[f"{head}.weight"] = stages[-1][0]["output_layer.weight"]
    out[f"{head}.bias"] = stages[-1][0]["output_layer.bias"]
    return out


def token_classification_config(config: dict) -> dict:
    """A causal LM's config.json made that of its `*ForTokenClassification` with one label."""
    arch = TOKEN_CLASSIFICATION.get(config.get("model_type"))
    if arch is None:
        raise ValueError(f"no *ForTokenClassification is mapped for model_type={config.get('model_type')!r}")
    out = {k: v for k, v in config.items() if k not in ("id2label", "label2id")}
    out.update(architectures=[arch[0]], num_labels=1, id2label={"0": "VALUE"}, label2id={"VALUE": 0})
    return out
