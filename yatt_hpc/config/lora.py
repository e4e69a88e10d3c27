"""`train.lora`: low-rank adapters on the policy's linear layers instead of training every parameter.

    train:
      lora: {rank: 8, alpha: 16, target_modules: [all-linear]}

The module names are the Hugging Face ones PEFT users write (`yatt_hpc/lora/targets.py` maps them onto the
Megatron layers); which of them a model has is checked against its config.json before launch
(`runtime/inputs.py`), since this section does not read the model.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from yatt_hpc.config.section import Section

ALL_LINEAR = "all-linear"
LLAMA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama, Qwen2(.5) or Qwen3 decoder layer, as HF names them."""
GPT2_MODULES = ("c_attn", "c_proj", "c_fc")
"""GPT-2's (HF `Conv1D`s); `c_proj` is both the attention output and the MLP's down projection, as in PEFT."""


class LoraConfig(Section):
    """LoRA (Hu et al. 2021, arXiv 2106.09685) as PEFT defines it: each targeted linear layer W keeps its weights
    frozen and adds (alpha / rank) x B A x, A [rank, in] and B [out, rank] trained (B starts at zero, so step 1
    starts from the base model). Only the adapters are in the optimizer, the data-parallel all-reduce and the
    checkpoint; the rollout engines receive the merged weights W + (alpha / rank) B A. docs/lora.md."""

    rank: int = Field(0, ge=0)
    """The adapters' rank r (PEFT `r`); 0 turns LoRA off and trains every parameter."""
    alpha: float = Field(16.0, gt=0)
    """PEFT `lora_alpha`: an adapter's output is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """PEFT `lora_dropout`: dropout on an adapter's input during the update's forward (the scoring forwards,
    the merged weights and the engines have none)."""
    target_modules: list[str] = [ALL_LINEAR]
    """The linear layers that get adapters, by their Hugging Face names: `q_proj`, `k_proj`, `v_proj`, `o_proj`,
    `gate_proj`, `up_proj`, `down_proj` (Llama, Qwen2, Qwen3), `c_attn`, `c_proj`, `c_fc` (GPT-2), or
    `all-linear` (every linear layer of the decoder, not the output head: PEFT's meaning)."""

    @model_validator(mode="after")
    def _adapters_agree(self) -> LoraConfig:
        default = LoraConfig.model_fields
        if self.rank == 0:
            given = [f for f in ("alpha", "dropout", "target_modules") if getattr(self, f) != default[f].get_default()]
            if given:
                raise ValueError(f"train.lora.{given[0]}={getattr(self, given[0])} shapes the adapters, but "
                                 "train.lora.rank=0 turns LoRA off; set train.lora.rank > 0 (8 is a common choice), "
                                 f"or drop train.lora.{given[0]}")
            return self
        known = (ALL_LINEAR, *LLAMA_MODULES, *GPT2_MODULES)
        unknown = [m for m in self.target_modules if m not in known]
        if unknown:
            raise ValueError(f"train.lora.target_modules={self.target_modules}: {unknown[0]!r} is not a linear layer "
                             f"name this trainer maps; use names from {list(known)}")
        if not self.target_modules:
            raise ValueError("train.lora.target_modules=[] gives no layer an adapter; list the layers (or all-linear), "
                             "or set train.lora.rank=0 to train every parameter")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"train.lora.target_modules={self.target_modules} names a layer twice; list each once")
        if ALL_LINEAR in self.target_modules and len(self.target_modules) > 1:
            raise ValueError(f"train.lora.target_modules={self.target_modules}: all-linear already takes every linear "
                             "layer; give all-linear alone, or only the names you want")
        families = {"llama": set(self.target_modules) & set(LLAMA_MODULES),
                    "gpt2": set(self.target_modules) & set(GPT2_MODULES)}
        if all(families.values()):
            raise ValueError(f"train.lora.target_modules={self.target_modules} mixes GPT-2 names "
                             f"{sorted(families['gpt2'])} with Llama/Qwen names {sorted(families['llama'])}; "
                             "no model has both, use the names of your model's family")
        return self

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor of every adapter's output (PEFT `scaling`; rsLoRA is not offered)."""
        return self.alpha / self.rank


def family_modules(model_type: str) -> tuple[str, ...] | None:
    """The linear-layer names of a model of HF `model_type` (None: LoRA is not mapped for it)."""
    if model_type == "gpt2":
        return GPT2_MODULES
    if model_type in ("llama", "qwen2", "qwen3"):
        return LLAMA_MODULES
    return None


def targets_problem(lora: LoraConfig, model_type: str) -> str | None:
    """Why `train.lora.target_modules` cannot act on a model of HF `model_type` (None: it can)."""
    if not lora.enabled:
        return None
    names = family_modules(model_type)
    if names is None:
        return (f"train.lora.rank={lora.rank}: LoRA is mapped for gpt2, llama, qwen2 and qwen3 policies, not "
                f"model_type={model_type!r}; set train.lora.rank=0 to train every parameter")
    missing = [m for m in lora.target_modules if m != ALL_LINEAR and m not in names]
    if missing:
        return (f"train.lora.target_modules={lora.target_modules}: a {model_type} model has no {missing[0]!r}; its "
                f"linear layers are {list(names)} (or use all-linear)")
    return None
