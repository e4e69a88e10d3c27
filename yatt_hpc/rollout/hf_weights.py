"""How new weights reach the `hf` engine (a mixin of `HFEngine`): whole buckets by name, or a bucket
broadcast over the pair's own process group (`device/weight_group.py`), checked against the model first.

On CPU in colocation the engine may give its weights' memory back while the trainer trains (`drop_weights`,
called by the rollout rank between its last wave and the weight sync that replaces them all): each dropped
parameter takes the tensor received for it as its storage (`take_weights`), or is allocated again as its first
bucket arrives, and the sync's final bucket must have refilled every one (a parameter left empty, or a fused
expert parameter missing an expert, raises instead of generating).

The engine provides `_model`, `_device`, `_state_shapes` (name -> shape), `_tied` (name -> the first name
sharing its storage), `_vision` (None for a text model), `_groups` (joined pair groups by name),
`_version`, `_mid_update`, `_dropped`, `_refilling`, `_adopting` and `_check_alive()`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from yatt_hpc.device.weight_group import BucketManifest, PairGroup, Rendezvous
from yatt_hpc.rollout.engine import validate_bucket


class HFWeightUpdates:
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool, version: int | None = None
    ) -> None:
        """Validate the whole bucket, then ``load_state_dict(strict=False)`` it (copies, casting dtype).

        Tied weights (e.g. GPT-2's ``lm_head.weight`` = ``transformer.wte.weight``) share storage, so
        either name updates both; sending both with different values is an error, not a silent pick. A MoE
        model's experts come one by one under their checkpoint names and are written into transformers' fused
        expert parameters (`_expert_slots`).
        """
        self._check_alive()
        bucket = [(self._memory_name(name), tensor) for name, tensor in named_tensors]
        self._check_bucket(bucket)
        self._mid_update = True
        if self._dropped:
            bucket = self._refill(bucket)
        experts = [(name, tensor) for name, tensor in bucket if name in self._expert_slots]
        for name, _ in experts:
            if self._expert_slots[name][0] in self._refilling:
                self._refilling[self._expert_slots[name][0]].add(name)
        if experts:
            fused = self._model.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, tensor in experts:
                    target, expert, rows, _ = self._expert_slots[name]
                    fused[target][expert, rows].copy_(tensor)
            bucket = [(name, tensor) for name, tensor in bucket if name not in self._expert_slots]
        self._model.load_state_dict(dict(bucket), strict=False)
        if final:
            self._check_refilled()
            self._version = self._version + 1 if version is None else int(version)
            self._mid_update = False

    def take_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool, version: int | None = None
    ) -> None:
        """As `update_weights`, for tensors given up by the caller (`comm/weight_sync.py` receives them for this
        engine): a parameter given back by `drop_weights` takes its tensor as its storage, when dtype, device, shape
        and layout match, instead of an allocation and a copy (at Qwen2.5-0.5B's size in fp32: 2 GB a sync)."""
        self._adopting = True
        try:
            self.update_weights(named_tensors, final=final, version=version)
        finally:
            self._adopting = False

    def drop_weights(self) -> int:
        """CPU: free every parameter a full weight sync sends (all but a vision tower's, which the trainer sends only
        when it trains it) until that sync refills it; the bytes freed. On a GPU, `release_memory` parks them."""
        self._check_alive()
        if self._device.type != "cpu":
            return 0
        freed = 0
        for name, param in self._model.named_parameters():  # a tied parameter once, under its first name
            if name in self._dropped or "visual." in name:
                continue
            self._dropped[name] = tuple(param.shape)
            freed += param.numel() * param.element_size()
            param.data = param.data.new_empty(0)
        return freed

    def _refill(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Give storage back to the dropped parameters this bucket writes: the received tensor itself in
        `take_weights` where it fits (that entry then needs no load), else a fresh allocation (a fused expert
        parameter: its whole tensor, whose experts must all arrive before the final bucket). The entries still to
        load."""
        params = dict(self._model.named_parameters())
        rest = []
        for name, tensor in bucket:
            key = self._expert_slots[name][0] if name in self._expert_slots else self._tied.get(name, name)
            if key not in self._dropped:
                rest.append((name, tensor))
                continue
            param, shape = params[key], self._dropped.pop(key)
            if (self._adopting and name not in self._expert_slots and tensor.dtype == param.dtype
                    and tensor.device == param.device and tuple(tensor.shape) == shape and tensor.is_contiguous()):
                param.data = tensor.detach()
                continue
            param.data = torch.empty(shape, dtype=param.dtype, device=self._device)
            if any(slot[0] == key for slot in self._expert_slots.values()):
                self._refilling[key] = set()
            rest.append((name, tensor))
        return rest

    def _check_refilled(self) -> None:
        missing = sorted(self._dropped)
        for target, written in self._refilling.items():
            want = {n for n, slot in self._expert_slots.items() if slot[0] == target}
            missing += [f"{target} (experts {sorted(want - written)[:3]})"] if want - written else []
        self._refilling = {}
        if missing:
            raise RuntimeError(f"weight sync ended with {len(missing)} parameter(s) the engine gave back for it not "
                               f"sent: {missing[:5]}; their memory holds no weights")

    def join_weight_group(self, rendezvous: Rendezvous) -> None:
        """Join the pair's group as its one engine rank (Gloo on CPU, NCCL on this engine's GPU)."""
        self._check_alive()
        if rendezvous.world_size != rendezvous.rank_offset + 1:
            raise ValueError(f"engine 'hf' is one rank, but the weight group {rendezvous.group_name} expects "
                             f"{rendezvous.world_size - rendezvous.rank_offset}")
        self._groups[rendezvous.group_name] = PairGroup.connect(rendezvous, rendezvous.rank_offset)

    def update_weights_from_group(self, manifest: BucketManifest, *, version: int | None = None) -> None:
        """Check the manifest, receive the bucket into fresh tensors on this engine's device, load it."""
        self._check_alive()
        if manifest.group_name not in self._groups:
            raise RuntimeError(f"update_weights_from_group: no weight group {manifest.group_name!r} joined; "
                               "join_weight_group comes first")
        validate_bucket([(self._memory_name(n), t) for n, t in manifest.placeholders()], self._state_shapes)
        tensors = manifest.empty(self._device)
        self._groups[manifest.group_name].broadcast(tensors)
        self.take_weights(zip(manifest.names, tensors), final=manifest.final, version=version)

    def _memory_name(self, name: str) -> str:
        """A checkpoint name (what trainers send and SGLang loads) as this model's state-dict name:
        transformers 5 holds Qwen2-VL as `model.language_model.*` / `model.visual.*` and saves it as
        `model.*` / `visual.*`."""
        if self._vision is None or name in self._state_shapes:
            return name
        if name.startswith("visual."):
            return f"model.{name}"
        if name.startswith("model."):
            return f"model.language_model.{name[len('model.'):]}"
        return name

    @property
    def weight_version(self) -> int:
        return self._version

    def _check_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        validate_bucket(bucket, self._state_shapes)
        seen: dict[str, tuple[str, torch.Tensor]] = {}
        for name, tensor in bucket:
            group = self._tied.get(name, name)
            if group in seen and not torch.equal(seen[group][1].cpu(), tensor.cpu()):
                raise ValueError(
                    f"update_weights: {name!r} and {seen[group][0]!r} are tied (one tensor) in this model "
                    "but the bucket sends different values; the trainer must tie them too"
                )
            seen[group] = (name, tensor)

    @staticmethod
    def _tied_name_groups(model: torch.nn.Module) -> dict[str, str]:
        """Map each state-dict name to the first name sharing its storage (tied parameters)."""
        first_by_storage: dict[tuple[int, tuple[int, ...]], str] = {}
        groups = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            groups[name] = first_by_storage.setdefault(key, name)
        return groups
