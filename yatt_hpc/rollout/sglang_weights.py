"""What `SGLangEngine` does to an `sglang.Engine`'s weights, apart from the engine so a CPU test can drive it.

    weights = SGLangWeights(engine, checkpoint_tensor_shapes(model_dir), device, before_load=resume_weights)
    weights.load_tensors(bucket, final=False)   # update_weights_from_tensor: device tensors, shared by CUDA IPC
    weights.join_group(rendezvous)              # init_weights_update_group: once per (trainer owner, engine) pair
    weights.load_from_group(manifest)           # update_weights_from_distributed: the owner broadcasts the tensors
    weights.version, weights.mid_update

Test it: tests/unit/test_sglang_weights.py drives it against a stand-in with sglang.Engine's methods whose
worker is a spawned child that joins the Gloo group and receives by broadcast, as SGLang's TP workers do.

`engine` is anything with these methods of `sglang.Engine` (source read: sglang/srt/entrypoints/engine.py,
managers/scheduler.py, model_executor/model_runner.py), each returning (success, message):
`init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name, backend)` (every
TP worker joins at rank_offset + its tp rank; blocks until the group forms),
`update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache)` (every worker allocates
each tensor, receives it by broadcast from rank 0 in name order, then loads the bucket),
`update_weights_from_tensor(named_tensors, load_format, flush_cache)`, and `flush_cache()`.
The radix cache is flushed once per version (`flush_cache=final`), not per bucket. Names and shapes are
checked against the checkpoint's safetensors headers before SGLang sees a bucket, so a bad bucket changes
nothing (SGLang's loaders take checkpoint names; a tied `lm_head.weight` is accepted and skipped by it).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from yatt_hpc.device.weight_group import BucketManifest, Rendezvous
from yatt_hpc.rollout.engine import validate_bucket


class SGLangWeights:
    def __init__(self, engine, shapes: Mapping[str, tuple[int, ...]], device: torch.device,
                 before_load: Callable[[], None] = lambda: None) -> None:
        """`before_load` runs before any load (SGLangEngine: resume released weights first)."""
        self.engine, self.shapes, self.device, self.before_load = engine, shapes, device, before_load
        self.version = 0
        self.mid_update = False
        self.groups: set[str] = set()

    def load_tensors(self, bucket: list[tuple[str, torch.Tensor]], *, final: bool, version: int | None = None) -> None:
        validate_bucket(bucket, self.shapes)
        self.before_load()
        self.mid_update = True
        if bucket:
            # On the engine's device the bucket travels to SGLang's scheduler as CUDA IPC handles
            # (torch's multiprocessing reductions): device to device, no pickled host bytes.
            bucket = [(name, t.to(self.device, non_blocking=True)) for name, t in bucket]
            torch.cuda.synchronize(self.device)
            _check(self.engine.update_weights_from_tensor(named_tensors=bucket, load_format=None, flush_cache=final),
                   "update_weights_from_tensor")
        elif final:
            self.engine.flush_cache()  # an empty final bucket still ends the version: drop stale prefixes
        self._finish(final, version)

    def join_group(self, rendezvous: Rendezvous) -> None:
        r = rendezvous
        _check(self.engine.init_weights_update_group(
            master_address=r.master_address, master_port=r.master_port, rank_offset=r.rank_offset,
            world_size=r.world_size, group_name=r.group_name, backend=r.backend), "init_weights_update_group")
        self.groups.add(r.group_name)

    def load_from_group(self, manifest: BucketManifest, *, version: int | None = None) -> None:
        if manifest.group_name not in self.groups:
            raise RuntimeError(f"update_weights_from_group: no weight group {manifest.group_name!r} joined; "
                               "join_weight_group comes first")
        validate_bucket(manifest.placeholders(), self.shapes)
        self.before_load()
        self.mid_update = True
        if manifest.names:
            _check(self.engine.update_weights_from_distributed(
                names=list(manifest.names), dtypes=list(manifest.dtypes), shapes=[list(s) for s in manifest.shapes],
                group_name=manifest.group_name, flush_cache=manifest.final), "update_weights_from_distributed")
        elif manifest.final:
            self.engine.flush_cache()
        self._finish(manifest.final, version)

    def _finish(self, final: bool, version: int | None) -> None:
        if final:
            self.version = self.version + 1 if version is None else int(version)
            self.mid_update = False


def _check(result, call: str) -> None:
    success, message = result
    if not success:
        raise RuntimeError(f"SGLang {call} failed: {message}")
