"""Weights between HF causal-LM layout and Megatron GPTModel tensor-parallel shards, both directions.

    shard = hf_to_megatron(hf_model.state_dict(), hf_config, tp_rank, tp_size)    # init the trainer
    hf_sd = megatron_to_hf([shard_0, shard_1], hf_config)                          # offline merge
    for name, tensor in iter_gathered_hf_weights(model, hf_config, tp_group):      # weight sync
        bucket.add(name, tensor)

Pure functions on state dicts (torch only, no megatron import); the one collective helper takes the
TP group explicitly. Layout facts, checked against megatron-core 0.16 ``SelfAttention`` and ``MLP``:

* ``linear_qkv`` rows are grouped per KV head: ``[q heads of group 0, k_0, v_0, q heads of group 1,
  k_1, v_1, ...]``; TP rank r owns a contiguous run of groups, so the concatenated shards equal the
  TP=1 layout.
* ``linear_fc1`` of a SwiGLU MLP holds ``[gate_r; up_r]`` per rank: the concatenated shards are
  NOT the TP=1 layout, so gate/up are split per shard.
* Row-parallel weights (``linear_proj``, ``linear_fc2``) split the input dim; their biases and all
  norms are replicated, Qwen3's per-head ``q_norm``/``k_norm`` (``q_layernorm``/``k_layernorm``,
  ``head_dim`` wide) too. Vocab rows are zero-padded to a multiple of ``tp_size``, then split.
* GPT-2 stores linears as ``Conv1D`` ([in, out]); Megatron as [out, in].
* Mixture of experts (Qwen3-MoE), names as saved on disk (``mlp.experts.{e}.{gate,up,down}_proj.weight``,
  ``mlp.gate.weight``; transformers fuses them into 3-D parameters in memory: `models.hf_experts`): the
  router ``mlp.router.weight`` is replicated; expert e is ``mlp.experts.local_experts.{e - first}`` of the
  expert-parallel rank that owns it (`Experts`: rank r of ep holds experts r*E/ep .. (r+1)*E/ep - 1, Megatron's
  ``SequentialMLP``), split over TP like a dense SwiGLU MLP. Qwen2-MoE's shared expert
  (``mlp.shared_expert.{gate,up,down}_proj.weight``) is ``mlp.shared_experts.linear_fc1/linear_fc2`` on every rank,
  split over TP like a dense SwiGLU MLP; its gate ``mlp.shared_expert_gate.weight`` [1, H] is the replicated
  ``mlp.shared_experts.gate_weight``.
* A vision-language checkpoint (Qwen2-VL, names as saved on disk and loaded by SGLang): the language
  model converts as above from ``model.*``; the HF vision tower is not converted: ``visual.X`` is the
  trainer model's ``visual.X`` (the same HF module, replicated over TP), copied as is both ways.
* Pipeline stages (a `Stage`): stage s of S holds layers s*L/S .. (s+1)*L/S - 1, or with uneven stages the
  first and last stage their own counts and the stages between the rest evenly (`Stage.layers`), under their
  local numbers (``decoder.layers.0`` is its first), the first stage the embeddings, the last the final norm
  and the head. With tied embeddings and S > 1 the last stage holds its own copy of the word embeddings
  as ``output_layer.weight`` (Megatron's ``setup_embeddings_and_output_layer``): it is loaded from the
  HF embedding and never written back (the first stage's is the one HF gets).
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from yatt_hpc.config.placement import stage_layers
from yatt_hpc.train.hf_arch import HFArch, describe_hf_config

StateDict = dict[str, torch.Tensor]
# Buffers some HF checkpoints carry that hold no weights (recomputed by the model).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
HF_VISION = MEGATRON_VISION = "visual."  # a checkpoint's vision tower, and the trainer model's


class Split(enum.Enum):
    """How a Megatron tensor is laid out across TP ranks."""

    REPLICATED = "replicated"
    COLUMN = "column"  # output dim 0 split
    ROW = "row"  # input dim 1 split
    VOCAB = "vocab"  # dim 0 split after zero-padding the vocab
    QKV = "qkv"  # dim 0 split by KV group after interleaving q/k/v per group
    GATE_UP = "gate_up"  # each shard is [gate_r; up_r]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of."""

    megatron: str
    hf: tuple[str, ...]
    split: Split
    conv1d: bool = False
    """HF stores this weight transposed (GPT-2 ``Conv1D``)."""
    copy: bool = False
    """A copy of a tensor another stage owns (the last stage's tied head): loaded from HF, never written back."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """Pipeline stage `index` of `count` (the default: the whole model on one stage); `split` the layers of the
    first and last stage when they are uneven (`placement.trainer.pp_layers`), None for layers/count each."""

    index: int = 0
    count: int = 1
    split: tuple[int, int] | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def layers(self, num_layers: int) -> range:
        """The global layer numbers this stage holds (`config.placement.stage_layers`, Megatron's split)."""
        return stage_layers(self.index, self.count, num_layers, self.split)

    def all(self) -> list[Stage]:
        """Every stage of this stage's pipeline, in order."""
        return [Stage(i, self.count, self.split) for i in range(self.count)]


def _contiguous_share(index: int, count: int, total: int, refusal: str) -> range:
    """Part `index` of `total` items split evenly into `count` contiguous parts; ValueError(`refusal`) when
    `count` does not divide `total`."""
    if total % count:
        raise ValueError(refusal)
    per = total // count
    return range(index * per, (index + 1) * per)


@dataclasses.dataclass(frozen=True)
class Experts:
    """Expert-parallel rank `index` of `count` (the default: every expert on this rank)."""

    index: int = 0
    count: int = 1

    def owned(self, num_experts: int) -> range:
        """The global expert numbers this rank holds (Megatron's contiguous split)."""
        return _contiguous_share(self.index, self.count, num_experts,
                                 f"{num_experts} experts do not split over placement.trainer.ep={self.count}; use an "
                                 f"ep that divides {num_experts}")


_EXPERT_NAME = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def is_expert(name: str) -> bool:
    """A Megatron name of one routed expert's tensor (SequentialMLP's ``local_experts.{e}``)."""
    return _EXPERT_NAME.match(name) is not None


def experts_global(shard: StateDict, experts: Experts) -> StateDict:
    """An expert-parallel rank's shard with its experts under their model-wide numbers (a checkpoint's names)."""
    per = 1 + max((int(m[2]) for m in map(_EXPERT_NAME.match, shard) if m), default=-1)
    return {_renumber(name, lambda e: e + experts.index * per): t for name, t in shard.items()}


def experts_local(shard: StateDict, experts: Experts) -> StateDict:
    """The inverse of `experts_global` from a shard with every expert: rank `experts`'s own, renumbered from 0."""
    total = 1 + max((int(m[2]) for m in map(_EXPERT_NAME.match, shard) if m), default=-1)
    owned = experts.owned(total) if total else range(0)
    out = {}
    for name, tensor in shard.items():
        m = _EXPERT_NAME.match(name)
        if m is None:
            out[name] = tensor
        elif int(m[2]) in owned:
            out[_renumber(name, lambda e: e - owned.start)] = tensor
    return out


def _renumber(name: str, number) -> str:
    m = _EXPERT_NAME.match(name)
    return name if m is None else f"{m[1]}{number(int(m[2]))}{m[3]}"


def weight_rules(arch: HFArch, stage: Stage = Stage(), experts: Experts = Experts()) -> list[list[Rule]]:
    """The rules of `stage`'s tensors grouped in units (embeddings, each layer, head) that stream in model
    order; Megatron names are the stage's own (local layer numbers, local expert numbers of `experts`), HF
    names the model's."""
    layers = stage.layers(arch.num_layers)

    def layer_rules(i: int) -> list[Rule]:
        if arch.family == "gpt2":
            return _gpt2_layer_rules(arch, i)
        return _llama_layer_rules(arch, i, experts)

    units = [[dataclasses.replace(r, megatron=_local_layer(r.megatron, i, i - layers.start)) for r in layer_rules(i)]
             for i in layers]
    if stage.first:
        units.insert(0, _embedding_rules(arch))
    if stage.last:
        units.append(_head_rules(arch, tied_copy=stage.count > 1))
    return units


def _local_layer(name: str, layer: int, local: int) -> str:
    prefix = f"decoder.layers.{layer}."
    assert name.startswith(prefix), name
    return f"decoder.layers.{local}.{name[len(prefix):]}"


def _embedding_rules(arch: HFArch) -> list[Rule]:
    if arch.family == "gpt2":
        return [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), Split.VOCAB),
                Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",),
                     Split.REPLICATED)]
    return [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB)]


def _head_rules(arch: HFArch, tied_copy: bool = False) -> list[Rule]:
    norm = "transformer.ln_f" if arch.family == "gpt2" else "model.norm"
    params = ("weight", "bias") if arch.family == "gpt2" else ("weight",)
    rules = [Rule(f"decoder.final_layernorm.{p}", (f"{norm}.{p}",), Split.REPLICATED) for p in params]
    if not arch.tied_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), Split.VOCAB))
    elif tied_copy:
        rules.append(Rule("output_layer.weight", _embedding_rules(arch)[0].hf, Split.VOCAB, copy=True))
    return rules


def _gpt2_layer_rules(arch: HFArch, i: int) -> list[Rule]:
    m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
    rules = []
    for p in ("weight", "bias"):
        is_w = p == "weight"
        rules += [
            Rule(f"{m}input_layernorm.{p}", (f"{h}ln_1.{p}",), Split.REPLICATED),
            Rule(f"{m}self_attention.linear_qkv.{p}", (f"{h}attn.c_attn.{p}",), Split.QKV, is_w),
            Rule(f"{m}self_attention.linear_proj.{p}", (f"{h}attn.c_proj.{p}",),
                 Split.ROW if is_w else Split.REPLICATED, is_w),
            Rule(f"{m}pre_mlp_layernorm.{p}", (f"{h}ln_2.{p}",), Split.REPLICATED),
            Rule(f"{m}mlp.linear_fc1.{p}", (f"{h}mlp.c_fc.{p}",), Split.COLUMN, is_w),
            Rule(f"{m}mlp.linear_fc2.{p}", (f"{h}mlp.c_proj.{p}",),
                 Split.ROW if is_w else Split.REPLICATED, is_w),
        ]
    return rules


def _llama_layer_rules(arch: HFArch, i: int, experts: Experts = Experts()) -> list[Rule]:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn, mlp = f"{h}self_attn.", f"{h}mlp."

    def qkv(param: str) -> tuple[str, ...]:
        return tuple(f"{attn}{x}_proj.{param}" for x in "qkv")

    rules = [
        Rule(f"{m}input_layernorm.weight", (f"{h}input_layernorm.weight",), Split.REPLICATED),
        Rule(f"{m}self_attention.linear_qkv.weight", qkv("weight"), Split.QKV),
    ]
    if arch.qkv_bias:
        rules.append(Rule(f"{m}self_attention.linear_qkv.bias", qkv("bias"), Split.QKV))
    if arch.qk_norm:
        rules += [Rule(f"{m}self_attention.{x}_layernorm.weight", (f"{attn}{x}_norm.weight",),
                       Split.REPLICATED) for x in "qk"]
    rules += [
        Rule(f"{m}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), Split.ROW),
        Rule(f"{m}pre_mlp_layernorm.weight", (f"{h}post_attention_layernorm.weight",),
             Split.REPLICATED),
    ]
    if arch.moe is not None:
        return rules + _expert_rules(arch, m, mlp, experts)
    return rules + _mlp_rules(f"{m}mlp.", mlp)


def _mlp_rules(m: str, h: str) -> list[Rule]:
    """A SwiGLU MLP: Megatron module `m`, HF module `h` (both with their trailing dot)."""
    return [Rule(f"{m}linear_fc1.weight", (f"{h}gate_proj.weight", f"{h}up_proj.weight"), Split.GATE_UP),
            Rule(f"{m}linear_fc2.weight", (f"{h}down_proj.weight",), Split.ROW)]


def _expert_rules(arch: HFArch, m: str, mlp: str, experts: Experts) -> list[Rule]:
    """The router and the experts `experts` owns of one MoE layer (Megatron's ``MoELayer``)."""
    owned = experts.owned(arch.moe.num_experts)
    rules = [Rule(f"{m}mlp.router.weight", (f"{mlp}gate.weight",), Split.REPLICATED)]
    for e in owned:
        rules += _mlp_rules(f"{m}mlp.experts.local_experts.{e - owned.start}.", f"{mlp}experts.{e}.")
    if arch.moe.shared_ffn_hidden_size:  # Qwen2-MoE: on every rank, a dense MLP over tp
        rules += _mlp_rules(f"{m}mlp.shared_experts.", f"{mlp}shared_expert.")
        rules.append(Rule(f"{m}mlp.shared_experts.gate_weight", (f"{mlp}shared_expert_gate.weight",), Split.REPLICATED))
    return rules


# ----------------------------------------------------------------------------- HF -> Megatron


def hf_to_megatron(hf_state_dict: StateDict, hf_config: Any, tp_rank: int, tp_size: int,
                   stage: Stage = Stage(), experts: Experts = Experts()) -> StateDict:
    """TP rank ``tp_rank``'s Megatron shard of pipeline `stage` (and of expert-parallel rank `experts`) of an HF
    state dict (same dtype, contiguous); a MoE model's experts as saved on disk (`unfuse_hf_experts`).

    Replicated tensors may share storage with the input. Raises ``KeyError`` for HF tensors that
    are missing or that no rule consumes, so a checkpoint of another architecture cannot load
    silently.
    """
    arch = describe_hf_config(hf_config, tp_size)
    rules = [rule for unit in weight_rules(arch) for rule in unit]
    if arch.vision:
        if stage.count > 1:
            raise ValueError("pipeline parallelism with a vision-language model is not supported: set "
                             "placement.trainer.pp=1")
        rules += vision_rules([k for k in hf_state_dict if k.startswith(HF_VISION)], HF_VISION)
    required = {name for rule in rules for name in rule.hf}
    # A tied head is listed by state_dict() but dropped by save_pretrained: accept either.
    optional = {"lm_head.weight"} if arch.tied_embeddings else set()
    known = required | optional
    unknown = [k for k in hf_state_dict if k not in known and not k.endswith(_IGNORED_HF_SUFFIXES)]
    missing = sorted(required - set(hf_state_dict))
    if unknown or missing:
        raise KeyError(f"HF state dict does not match {arch.family}: missing={missing}, "
                       f"unexpected={unknown}")
    if stage.count > 1 or experts.count > 1:
        rules = [rule for unit in weight_rules(arch, stage, experts) for rule in unit]
    return {rule.megatron: _to_megatron(rule, [hf_state_dict[n] for n in rule.hf], arch, tp_rank,
                                        tp_size).contiguous()
            for rule in rules}


def vision_rules(names: Sequence[str], prefix: str) -> list[Rule]:
    """Replicated one-to-one rules for the vision tower's tensors, from names under ``prefix``
    (``visual.`` on both sides)."""
    tails = sorted(n[len(prefix):] for n in names if n.startswith(prefix))
    if not tails:
        raise KeyError(f"a vision-language checkpoint holds no {prefix}* tensors (its vision tower)")
    return [Rule(f"{MEGATRON_VISION}{t}", (f"{HF_VISION}{t}",), Split.REPLICATED) for t in tails]


def _to_megatron(rule: Rule, hf: list[torch.Tensor], arch: HFArch, rank: int, tp: int) -> torch.Tensor:
    if rule.conv1d:
        hf = [t.t() for t in hf]

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim)[rank]

    if rule.split is Split.REPLICATED:
        return hf[0]
    if rule.split is Split.COLUMN:
        return shard(hf[0], 0)
    if rule.split is Split.ROW:
        return shard(hf[0], 1)
    if rule.split is Split.VOCAB:
        pad = arch.padded_vocab_size - hf[0].shape[0]
        return shard(torch.cat([hf[0], hf[0].new_zeros(pad, *hf[0].shape[1:])]), 0)
    if rule.split is Split.GATE_UP:
        return torch.cat([shard(hf[0], 0), shard(hf[1], 0)])
    q, k, v = hf if len(hf) == 3 else _split_fused_hf_qkv(hf[0], arch)
    return shard(_interleave_qkv(q, k, v, arch), 0)


def split_tensor(rule: Rule, hf: list[torch.Tensor], arch: HFArch, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of the Megatron tensor `rule` makes of the HF tensors `hf` (contiguous): the
    split weights take, for tensors laid out like them (LoRA's adapters, `yatt_hpc/lora/`)."""
    return _to_megatron(rule, hf, arch, tp_rank, tp_size).contiguous()


def _split_fused_hf_qkv(qkv: torch.Tensor, arch: HFArch) -> list[torch.Tensor]:
    """GPT-2's ``c_attn`` (already [out, in]) is [all q; all k; all v]."""
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return list(qkv.split([q_rows, kv_rows, kv_rows]))


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArch) -> torch.Tensor:
    groups, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest),
                       v.reshape(groups, d, *rest)], dim=1)
    return fused.reshape(-1, *rest)


# ----------------------------------------------------------------------------- Megatron -> HF


def megatron_to_hf(shards: Sequence[StateDict], hf_config: Any, emit_tied_lm_head: bool = True) -> StateDict:
    """Merge all TP shards (ordered by TP rank) into one HF state dict with HF names and layout."""
    return dict(iter_megatron_to_hf(shards, hf_config, emit_tied_lm_head))


def stages_to_hf(stage_shards: Sequence[Sequence[StateDict]], hf_config: Any,
                 emit_tied_lm_head: bool = True, split: tuple[int, int] | None = None) -> StateDict:
    """Merge the TP shards of every pipeline stage (``stage_shards[pp][tp]``, stages split as `split` says: see
    `Stage`) into one HF state dict."""
    stages = Stage(0, len(stage_shards), split).all()
    return {name: tensor for stage, shards in zip(stages, stage_shards, strict=True)
            for name, tensor in iter_megatron_to_hf(shards, hf_config, emit_tied_lm_head, stage)}


def iter_megatron_to_hf(
    shards: Sequence[StateDict], hf_config: Any, emit_tied_lm_head: bool = True, stage: Stage = Stage(),
    experts: Experts = Experts(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` of pipeline `stage`'s TP shards in model order (embeddings, its layers, head);
    of a MoE model, the experts expert-parallel rank `experts` holds (the router and the rest: every rank's).

    With tied embeddings HF also lists ``lm_head.weight`` (the same tensor as the embedding);
    ``emit_tied_lm_head=False`` skips it, e.g. for inference engines that tie on load.
    """
    arch = describe_hf_config(hf_config, len(shards))
    yield from _iter_hf(arch, lambda rule: [shard[rule.megatron] for shard in shards],
                        emit_tied_lm_head, list(shards[0]), stage=stage, experts=experts)


def _iter_hf(arch: HFArch, shards_of, emit_tied_lm_head: bool, megatron_names: Sequence[str],
             vision: bool = True, stage: Stage = Stage(), experts: Experts = Experts(), copy: bool = True,
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Drive ``_to_hf`` over every rule of `stage` (and expert rank `experts`); ``shards_of(rule)`` returns that
    tensor's TP shards. ``megatron_names`` (the trainer-side names) list a vision model's tower tensors (none:
    ``vision``)."""
    units = weight_rules(arch, stage, experts)
    if arch.vision and vision:
        units.insert(0, vision_rules(megatron_names, MEGATRON_VISION))
    for unit in units:
        for rule in unit:
            if not rule.copy:
                yield from _to_hf(rule, shards_of(rule), arch, copy)
    if arch.tied_embeddings and emit_tied_lm_head and stage.first:
        rule = Rule("embedding.word_embeddings.weight", ("lm_head.weight",), Split.VOCAB)
        yield from _to_hf(rule, shards_of(rule), arch, copy)


def _to_hf(rule: Rule, shards: list[torch.Tensor], arch: HFArch, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of one rule's TP shards; `copy=False`: one shard's tensors that need no reorder (all but the
    fused QKV and GPT-2's transposed Conv1D) come as views of it instead of copies."""
    cat = torch.cat if copy else lambda ts, dim=0: ts[0] if len(ts) == 1 else torch.cat(ts, dim=dim)
    if rule.split is Split.REPLICATED:
        tensors = [shards[0]]
    elif rule.split is Split.ROW:
        tensors = [cat(shards, dim=1)]
    elif rule.split is Split.COLUMN:
        tensors = [cat(shards)]
    elif rule.split is Split.VOCAB:
        tensors = [cat(shards)[: arch.vocab_size]]
    elif rule.split is Split.GATE_UP:
        halves = [s.chunk(2) for s in shards]
        tensors = [cat([h[0] for h in halves]), cat([h[1] for h in halves])]
    else:
        tensors = _deinterleave_qkv(torch.cat(shards), arch)
        if len(rule.hf) == 1:
            tensors = [torch.cat(tensors)]
    for name, tensor in zip(rule.hf, tensors, strict=True):
        yield name, (tensor.t() if rule.conv1d else tensor).contiguous()


def merge_tensor(rule: Rule, shards: list[torch.Tensor], arch: HFArch) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors (name, tensor) of a Megatron tensor's TP shards: the inverse of `split_tensor`."""
    yield from _to_hf(rule, shards, arch)


def _deinterleave_qkv(fused: torch.Tensor, arch: HFArch) -> list[torch.Tensor]:
    groups, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


# ----------------------------------------------------------------------------- live model gather


def iter_gathered_hf_weights(
    model: torch.nn.Module, hf_config: Any, tp_group: Any, emit_tied_lm_head: bool = True, vision: bool = True,
    stage: Stage = Stage(), local: Mapping[str, torch.Tensor] | None = None, experts: Experts = Experts(),
    experts_only: bool = False, copy: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """All-gather the live model's TP shards one tensor at a time and yield full HF tensors (of the
    model's pipeline `stage`: its layers under their HF names).

    ``model`` is the bare GPTModel (unprefixed state-dict names, not a DDP wrapper).
    Collective: every rank of ``tp_group`` must drain the iterator in lockstep. Every rank gets the
    full tensors; callers usually keep them on TP rank 0 only. Peak extra memory is one tensor; at tp 1
    none for the tensors that need no reorder: those come as views of the live parameters (read each
    before the next optimizer step; `gather_hf_state_dict` copies).
    ``vision=False`` leaves out a vision model's tower (frozen: the engines already hold it). ``local`` stands in
    for the model's state dict (LoRA's merged weights, computed as each tensor is asked for). A MoE model yields
    the experts its expert-parallel rank `experts` owns: each expert comes from the ranks that hold it;
    ``experts_only``: those and nothing else (the rest of the model comes from another rank).
    """
    tp_size = torch.distributed.get_world_size(tp_group)
    arch = describe_hf_config(hf_config, tp_size)
    local = model.state_dict() if local is None else local

    def shards_of(rule: Rule) -> list[torch.Tensor]:
        tensor = local[rule.megatron].detach()
        if rule.split is Split.REPLICATED:
            return [tensor]
        return _all_gather(tensor, tp_group, tp_size)

    names = list(local) if vision else [n for n in local if not n.startswith(MEGATRON_VISION)]
    if experts_only:
        for rule in (r for unit in weight_rules(arch, stage, experts) for r in unit if is_expert(r.megatron)):
            yield from _to_hf(rule, shards_of(rule), arch, copy)
        return
    yield from _iter_hf(arch, shards_of, emit_tied_lm_head, names, vision, stage, experts, copy)


def gather_hf_state_dict(
    model: torch.nn.Module, hf_config: Any, tp_group: Any, emit_tied_lm_head: bool = True
) -> StateDict:
    """The full HF state dict of the live TP-sharded model, on every rank of ``tp_group``."""
    return dict(iter_gathered_hf_weights(model, hf_config, tp_group, emit_tied_lm_head, copy=True))


def _all_gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]  # the one shard is the tensor: no gather, no copy
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(out, tensor, group=group)
    return out
