"""LoRA adapters on a Megatron GPTModel's linear layers, under tensor parallelism.

    lora = Lora.attach(model, arch, cfg.train.lora, seed=0, tp_rank=0, tp_size=1, stage=Stage())  # base frozen
    loss.backward()                        # gradients reach the adapters only
    with lora.disabled(): ...              # the base model (the KL reference)
    merged = lora.merged_state(model)      # {megatron name: tensor}, base + (alpha/r) B A where adapted

Each adapted linear layer gets an ``adapters`` ModuleDict (one `LoraAdapter` per HF module it fuses,
`lora/targets.py`) and a forward hook that adds their output to the layer's:
``y += scaling * B (A dropout(x))``, as PEFT computes it. Under tensor parallelism (Megatron's own region
functions, as its layers use them):

* column-parallel layer: x is replicated, A [r, in] replicated, B holds this rank's output rows. ``A x`` passes
  through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so every rank gets A's
  whole gradient (each rank's B rows contribute a part) and the same input gradient.
* row-parallel layer: x holds this rank's input columns, A [r, in / tp] the same columns, B [out, r] replicated.
  ``A x`` (a partial sum) passes through ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity
  backward) before B: r numbers per token cross the group, never the layer's output.

Replicated adapter tensors get the same gradient on every TP rank; split ones carry Megatron's
``tensor_model_parallel`` attributes, which the trainer's gradient-norm reads. A starts as PEFT's
(``kaiming_uniform_(a=sqrt(5))``: uniform in +-1/sqrt(in)), drawn whole from a generator seeded by (train.seed,
layer, module) and then split, so every layout (tp, pp, dp) starts from the same adapters; B starts at zero.
Dropout masks are drawn whole-width from the default generator (the same on the TP ranks of a replica, which run
the same operations) and a row-parallel rank takes its columns, so they do not depend on tp either.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from yatt_hpc.lora.targets import ADAPTERS, Site, Slot, adapter_name, layer_sites, resolve_targets
from yatt_hpc.train.convert import Split, Stage
from yatt_hpc.train.hf_arch import HFArch
from yatt_hpc.train.mcore import parallel_state, tensor_parallel


class LoraAdapter(torch.nn.Module):
    """One HF module's adapter: this rank's shards of A [r, in] and B [out, r]."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, slot: Slot, tp_size: int) -> None:
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        for param, split, dim in ((self.lora_A, slot.a_split, 1), (self.lora_B, slot.b_split, 0)):
            if split is not Split.REPLICATED and tp_size > 1:
                tensor_parallel.set_tensor_model_parallel_attributes(param, True, dim, 1)


def initial_a(seed: int, layer: int, site: Site, slot: Slot, rank: int) -> torch.Tensor:
    """The whole A of an adapter at the start: PEFT's kaiming_uniform_(a=sqrt(5)) bound, 1/sqrt(in), drawn from a
    generator of its own so that it depends on (seed, global layer, module) only."""
    key = f"{seed}/{layer}/{site.module}/{slot.name}".encode()
    generator = torch.Generator().manual_seed(zlib.crc32(key))
    bound = 1.0 / math.sqrt(slot.in_features)
    return torch.empty(rank, slot.in_features).uniform_(-bound, bound, generator=generator)


class Lora:
    """The adapters of one model shard, their hooks and the switch that turns them off."""

    def __init__(self, sites: list[tuple[int, Site, torch.nn.Module]], scaling: float, dropout: float,
                 arch: HFArch, tp_rank: int, tp_size: int) -> None:
        self.sites = sites  # (local layer, site, the Megatron linear module)
        self.scaling, self.dropout = scaling, dropout
        self.arch, self.tp_rank, self.tp_size = arch, tp_rank, tp_size
        self.active = True
        self.group = parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None

    @classmethod
    def attach(cls, model: torch.nn.Module, arch: HFArch, cfg: Any, seed: int, tp_rank: int, tp_size: int,
               stage: Stage | None = None, recompute_full: bool = False) -> Lora:
        """Freeze every parameter of `model` and add `cfg`'s adapters (a `LoraConfig`) to this stage's layers."""
        model.requires_grad_(False)
        targets = resolve_targets(arch, cfg.target_modules)
        first = (stage or Stage()).layers(arch.num_layers).start
        sites = []
        for local, layer in enumerate(model.decoder.layers):
            for site in layer_sites(arch, targets):
                linear = layer.get_submodule(site.module)
                weight = linear.weight
                adapters = {}
                for slot in site.slots:
                    a = initial_a(seed, first + local, site, slot, cfg.rank)
                    if slot.row_parallel:
                        a = a.chunk(tp_size, 1)[tp_rank]
                    out = slot.out_features if slot.b_split is Split.REPLICATED else slot.out_features // tp_size
                    b = torch.zeros(out, cfg.rank)
                    adapters[slot.name] = LoraAdapter(a.to(weight), b.to(weight), slot, tp_size)
                linear.add_module(ADAPTERS, torch.nn.ModuleDict(adapters))
                sites.append((local, site, linear))
        lora = cls(sites, cfg.scaling, cfg.dropout, arch, tp_rank, tp_size)
        for _, site, linear in sites:
            linear.register_forward_hook(lora._hook(site), with_kwargs=True)
        if recompute_full and getattr(model, "pre_process", True):
            # a checkpointed chunk's output has a gradient only if one of its inputs has one: with the embeddings
            # frozen the first chunk's input has none, so it is marked (PEFT's enable_input_require_grads)
            model.embedding.register_forward_hook(_require_grad)
        return lora

    # ------------------------------------------------------------------ forward

    def _hook(self, site: Site):
        def hook(module, args, kwargs, output):
            if not self.active:
                return output
            x = args[0] if args else kwargs["input_"]
            out, bias = output
            return out + self.delta(site, module.adapters, x).to(out.dtype), bias

        return hook

    def delta(self, site: Site, adapters: torch.nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        """What the adapters add to the layer's local output for input `x`."""
        parts = {}
        for slot in site.slots:
            adapter = adapters[slot.name]
            h = F.linear(self._dropped(x, slot), adapter.lora_A)
            if self.group is not None:
                h = tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=self.group) if slot.row_parallel \
                    else tensor_parallel.copy_to_tensor_model_parallel_region(h, group=self.group)
            parts[slot.name] = F.linear(h, adapter.lora_B) * self.scaling
        return self.assemble(site, parts, x.shape[:-1], x)

    def _dropped(self, x: torch.Tensor, slot: Slot) -> torch.Tensor:
        if not self.dropout or not torch.is_grad_enabled():
            return x
        keep = 1.0 - self.dropout
        width = slot.in_features
        mask = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device).bernoulli_(keep)
        if slot.row_parallel and self.tp_size > 1:
            local = width // self.tp_size
            mask = mask[..., self.tp_rank * local:(self.tp_rank + 1) * local]
        return x * mask / keep

    def assemble(self, site: Site, parts: dict[str, torch.Tensor], lead: torch.Size, like: torch.Tensor,
                 dim: int = -1) -> torch.Tensor:
        """The layer's local output (along `dim`) from its slots' parts: a slot without an adapter adds zeros;
        ``qkv`` interleaves q, k, v per KV group, ``gate_up`` concatenates. `lead`: a part's other dims, in order."""
        if site.kind == "single":
            return parts[site.slots[0].name]
        widths = self._local_widths(site)
        full = [parts[name].movedim(dim, -1) if name in parts else
                like.new_zeros(*lead, widths[name]) for name in site.all_slots]
        if site.kind == "gate_up":
            return torch.cat(full, dim=-1).movedim(-1, dim)
        groups = self.arch.num_kv_heads // self.tp_size
        q, k, v = (t.reshape(*t.shape[:-1], groups, -1) for t in full)
        fused = torch.cat([q, k, v], dim=-1)
        return fused.reshape(*fused.shape[:-2], -1).movedim(-1, dim)

    def _local_widths(self, site: Site) -> dict[str, int]:
        arch, tp = self.arch, self.tp_size
        if site.kind == "qkv":
            q, kv = arch.num_heads * arch.head_dim // tp, arch.num_kv_heads * arch.head_dim // tp
            return {"q_proj": q, "k_proj": kv, "v_proj": kv}
        return {name: arch.ffn_hidden_size // tp for name in site.all_slots}

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: every adapter off (the frozen reference of the KL term)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def delta_weight(self, site: Site, adapters: torch.nn.ModuleDict) -> torch.Tensor:
        """scaling x B A of every slot laid out as the layer's local weight [out / tp, in] (or [out, in / tp]),
        in float32."""
        parts = {s.name: (adapters[s.name].lora_B.float() @ adapters[s.name].lora_A.float()) * self.scaling
                 for s in site.slots}
        like = next(iter(parts.values()))
        return self.assemble(site, parts, like.shape[1:], like, dim=0)

    def merged_state(self, model: torch.nn.Module) -> MergedState:
        """The model's state dict with every adapted weight merged (each computed when it is asked for)."""
        return MergedState(self, model.state_dict())

    def adapter_names(self) -> list[str]:
        return [adapter_name(local, site, slot, which) for local, site, _ in self.sites for slot in site.slots
                for which in ("A", "B")]

    def load(self, model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy adapter tensors (a checkpoint's) into the model; every adapter covered, nothing else given."""
        names = self.adapter_names()
        missing = sorted(set(names) - set(tensors))
        unexpected = sorted(set(tensors) - set(names))
        if missing or unexpected:
            raise KeyError(f"the adapters do not match the model's: missing={missing[:4]}, unexpected={unexpected[:4]}")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in names:
                params[name].copy_(tensors[name])


class MergedState(Mapping):
    """A model state dict in which the weight of every adapted layer reads as base + scaling x B A (in the base's
    dtype, summed in float32), computed on access: the weight sync gathers one tensor at a time."""

    def __init__(self, lora: Lora, state: dict[str, torch.Tensor]) -> None:
        self.lora, self.state = lora, state
        self.merged = {f"decoder.layers.{local}.{site.module}.weight": (site, linear)
                       for local, site, linear in lora.sites}

    def __getitem__(self, name: str) -> torch.Tensor:
        base = self.state[name]
        if name not in self.merged:
            return base
        site, linear = self.merged[name]
        return (base.float() + self.lora.delta_weight(site, linear.adapters)).to(base.dtype)

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def _require_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output
