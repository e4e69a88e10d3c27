"""Where LoRA adapters sit in a Megatron GPTModel, and which PEFT tensor each of their shards is.

    sites = layer_sites(arch, resolve_targets(arch, ["all-linear"]))   # per decoder layer, the same
    rules = adapter_rules(arch, targets, stage)                        # convert.Rule per adapter tensor

An adapter is PEFT's: one per Hugging Face linear module (`q_proj`, `c_attn`, ...), with its own A [r, in] and
B [out, r]. Megatron fuses some of those modules into one linear layer, so a `Site` (a Megatron linear layer) holds
one `Slot` per HF module it is made of:

* ``linear_qkv`` of a Llama-family model holds q_proj, k_proj and v_proj. Its output rows are grouped per KV head
  (`train/convert.py`: q heads of group g, k_g, v_g); TP rank t owns a run of whole groups, so each slot's B is
  split by rows like a column-parallel weight (its q, k or v rows of those groups) and the three outputs are
  interleaved per group into the layer's order (`layers.assemble`). GPT-2's ``c_attn`` is one HF module (and one
  adapter) over the fused [q; k; v]: its B takes the weight's own QKV split.
* ``linear_fc1`` of a SwiGLU MLP holds gate_proj and up_proj; a rank's output is [gate_r; up_r], so each B is
  split by rows and the two outputs are concatenated.
* Column-parallel layers (the two above, GPT-2's ``c_fc``): A is replicated, B split like the weight. Row-parallel
  layers (``linear_proj`` = o_proj / attn.c_proj, ``linear_fc2`` = down_proj / mlp.c_proj): A is split along the
  input like the weight, B replicated, and A's partial products are summed over the TP group before B.

The split of every adapter tensor is a `convert.Split`, so the HF <-> Megatron code of `train/convert.py` moves them
between layouts exactly as it moves weights (`lora/peft.py`).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from yatt_hpc.config.lora import ALL_LINEAR, family_modules
from yatt_hpc.train.convert import Rule, Split, Stage
from yatt_hpc.train.hf_arch import HFArch

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before an HF module's name in adapter_model.safetensors (its `PeftModel` wrapping the model)."""
ADAPTERS = "adapters"
"""The attribute of a Megatron linear layer that holds its adapters (an `nn.ModuleDict` by slot name)."""
_ADAPTER_NAME = re.compile(rf"\.{ADAPTERS}\.([A-Za-z0-9_]+)\.lora_[AB]$")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One HF linear module's adapter inside a Megatron linear layer."""

    name: str
    """The HF module's own name (`q_proj`, `c_proj`): the adapter's key under the layer's `adapters`."""
    hf: str
    """The HF module's path inside a decoder layer (`self_attn.q_proj`, `mlp.c_proj`)."""
    in_features: int
    out_features: int
    a_split: Split
    b_split: Split

    @property
    def row_parallel(self) -> bool:
        return self.a_split is Split.ROW


@dataclasses.dataclass(frozen=True)
class Site:
    """A Megatron linear layer with adapters: its path inside a decoder layer and how its slots' outputs make
    the layer's (local) output: ``qkv`` (interleaved per KV group), ``gate_up`` (concatenated), ``single``."""

    module: str
    kind: str
    slots: tuple[Slot, ...]
    all_slots: tuple[str, ...]
    """Every slot the layer is made of, in output order (an untargeted one adds nothing)."""


def resolve_targets(arch: HFArch, target_modules: Iterable[str]) -> frozenset[str]:
    """The HF module names `train.lora.target_modules` selects in a model of `arch` (all-linear: all of them)."""
    names = family_modules(arch.family)
    wanted = list(target_modules)
    if ALL_LINEAR in wanted:
        return frozenset(names)
    missing = [m for m in wanted if m not in names]
    if missing:
        raise ValueError(f"train.lora.target_modules={wanted}: a {arch.family} model has no {missing[0]!r}; its "
                         f"linear layers are {list(names)} (or use all-linear)")
    return frozenset(wanted)


def targets_of(names: Iterable[str]) -> frozenset[str]:
    """The HF module names that adapter tensors (Megatron state-dict names) belong to."""
    return frozenset(m[1] for m in map(_ADAPTER_NAME.search, names) if m)


def is_adapter(name: str) -> bool:
    return _ADAPTER_NAME.search(name) is not None


def _all_sites(arch: HFArch) -> list[Site]:
    h, ffn = arch.hidden_size, arch.ffn_hidden_size
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    col, row, rep = Split.COLUMN, Split.ROW, Split.REPLICATED
    if arch.family == "gpt2":
        return [
            Site("self_attention.linear_qkv", "single", (Slot("c_attn", "attn.c_attn", h, 3 * h, rep, Split.QKV),),
                 ("c_attn",)),
            Site("self_attention.linear_proj", "single", (Slot("c_proj", "attn.c_proj", h, h, row, rep),), ("c_proj",)),
            Site("mlp.linear_fc1", "single", (Slot("c_fc", "mlp.c_fc", h, ffn, rep, col),), ("c_fc",)),
            Site("mlp.linear_fc2", "single", (Slot("c_proj", "mlp.c_proj", ffn, h, row, rep),), ("c_proj",)),
        ]
    return [
        Site("self_attention.linear_qkv", "qkv", (
            Slot("q_proj", "self_attn.q_proj", h, q_rows, rep, col),
            Slot("k_proj", "self_attn.k_proj", h, kv_rows, rep, col),
            Slot("v_proj", "self_attn.v_proj", h, kv_rows, rep, col)), ("q_proj", "k_proj", "v_proj")),
        Site("self_attention.linear_proj", "single", (Slot("o_proj", "self_attn.o_proj", q_rows, h, row, rep),),
             ("o_proj",)),
        Site("mlp.linear_fc1", "gate_up", (
            Slot("gate_proj", "mlp.gate_proj", h, ffn, rep, col),
            Slot("up_proj", "mlp.up_proj", h, ffn, rep, col)), ("gate_proj", "up_proj")),
        Site("mlp.linear_fc2", "single", (Slot("down_proj", "mlp.down_proj", ffn, h, row, rep),), ("down_proj",)),
    ]


def layer_sites(arch: HFArch, targets: frozenset[str]) -> list[Site]:
    """The adapted linear layers of every decoder layer, each with its targeted slots only."""
    out = []
    for site in _all_sites(arch):
        slots = tuple(s for s in site.slots if s.name in targets)
        if slots:
            out.append(dataclasses.replace(site, slots=slots))
    return out


def hf_layer_prefix(arch: HFArch) -> str:
    return "transformer.h." if arch.family == "gpt2" else "model.layers."


def adapter_name(local_layer: int, site: Site, slot: Slot, which: str) -> str:
    """The Megatron state-dict name of an adapter tensor (`which`: "A" or "B") of a stage's local layer."""
    return f"decoder.layers.{local_layer}.{site.module}.{ADAPTERS}.{slot.name}.lora_{which}"


def adapter_rules(arch: HFArch, targets: frozenset[str], stage: Stage | None = None) -> list[Rule]:
    """A `convert.Rule` for each adapter tensor of `stage`'s layers: Megatron name (local layer numbers), the PEFT
    name without its `PEFT_PREFIX` (global layer numbers) and its split."""
    rules = []
    layers = (stage or Stage()).layers(arch.num_layers)
    for layer in layers:
        for site in layer_sites(arch, targets):
            for slot in site.slots:
                hf = f"{hf_layer_prefix(arch)}{layer}.{slot.hf}"
                for which, split in (("A", slot.a_split), ("B", slot.b_split)):
                    rules.append(Rule(adapter_name(layer - layers.start, site, slot, which),
                                      (f"{hf}.lora_{which}.weight",), split))
    return rules


def peft_shapes(arch: HFArch, targets: frozenset[str], rank: int) -> dict[str, tuple[int, int]]:
    """The whole shape of every adapter tensor by its PEFT name (without `PEFT_PREFIX`): A [r, in], B [out, r]."""
    out = {}
    for layer in range(arch.num_layers):
        for site in layer_sites(arch, targets):
            for slot in site.slots:
                hf = f"{hf_layer_prefix(arch)}{layer}.{slot.hf}"
                out[f"{hf}.lora_A.weight"] = (rank, slot.in_features)
                out[f"{hf}.lora_B.weight"] = (slot.out_features, rank)
    return out
