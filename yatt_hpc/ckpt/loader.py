"""Finding the latest checkpoint that verifies, and reading one rank's part of it (no MPI here).

    step, skipped = find_latest(ckpt_dir)                 # highest committed step whose manifest verifies
    restored = read_rank(step_dir, "trainer/dp0/tp1/pp0")  # tensors, RNG, data position, shared state
    weights = read_weights(step_dir, tp=1, pp=0)           # parameters of one shard only

Reading uses safetensors and h5py only: no pickle, so loading a checkpoint runs no code.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.errors import CheckpointError
from yatt_hpc.ckpt.manifest import verify_step
from yatt_hpc.ckpt.rng import RngState
from yatt_hpc.ckpt.state import SharedState, read_records, read_shared

log = logging.getLogger(__name__)
if TYPE_CHECKING:  # torch is imported where weights are read: a rank without any never needs it
    import torch

    StateDict = dict[str, torch.Tensor]


@dataclass
class Restored:
    """One rank's view of a loaded checkpoint."""

    step: int
    identity: str
    coords: dict[str, int]
    model: StateDict = field(default_factory=dict)
    optim: StateDict = field(default_factory=dict)
    optim_meta: dict[str, str] = field(default_factory=dict)
    critic: StateDict = field(default_factory=dict)  # the value model's, when the run had one
    critic_optim: StateDict = field(default_factory=dict)
    critic_optim_meta: dict[str, str] = field(default_factory=dict)
    rng: RngState | None = None
    data_position: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    shared: SharedState = field(default_factory=SharedState)
    saved_world_rank: int = -1
    step_dir: Path | None = None
    trainers: list = field(default_factory=list)  # every trainer rank's record (layout, data positions)
    found: bool = True  # False: this identity was not saved (the checkpoint has another layout)

    @property
    def trainer_layout(self) -> dict[str, int]:
        """The saved trainer's parallel sizes {"dp", "tp", "pp", "ep"}."""
        return {axis: 1 + max((r.coords.get(axis, 0) for r in self.trainers), default=0)
                for axis in ("dp", "tp", "pp", "ep")}

    @property
    def pipeline_split(self) -> tuple[int, int] | None:
        """The saved trainer's uneven stages (`placement.trainer.pp_layers`: the first and last stage's layers), or
        None for even ones (`pipeline_record`)."""
        return saved_split(self.trainers)


PIPELINE_KEY = "pipeline"  # a trainer record's `extra` entry: {"first": layers, "last": layers} of uneven stages


def pipeline_record(split: tuple[int, int] | None) -> dict[str, dict[str, int]]:
    """What a trainer rank's record carries of its stage split (`RankRecord.extra`): nothing for even stages."""
    return {} if split is None else {PIPELINE_KEY: {"first": int(split[0]), "last": int(split[1])}}


def saved_split(trainers: list) -> tuple[int, int] | None:
    """The stage split a checkpoint's trainer records (`RankRecord`s) were written with (`pipeline_record`)."""
    found = {(r.extra[PIPELINE_KEY]["first"], r.extra[PIPELINE_KEY]["last"]) if PIPELINE_KEY in r.extra else None
             for r in trainers}
    if len(found) > 1:
        raise CheckpointError(f"the trainer ranks of one checkpoint recorded different pipeline splits {sorted(found, key=str)}")
    return next(iter(found), None)


def recorded_split(step_dir: Path) -> tuple[int, int] | None:
    """The stage split of the checkpoint in `step_dir`, from its trainer records (`saved_split`)."""
    return saved_split([r for r in read_records(step_dir / layout.STATE_FILE) if r.identity.startswith("trainer/")])


def split_text(split: tuple[int, int] | None) -> str:
    """A stage split as the messages name it: even stages, or the `placement.trainer.pp_layers` value."""
    return "even stages" if split is None else f"placement.trainer.pp_layers={list(split)}"


def find_latest(ckpt_dir: Path, quarantine: bool = False) -> tuple[int | None, list[tuple[int, str]]]:
    """The highest step that verifies, and the (step, reason) of every newer one that did not.

    Each skipped checkpoint is logged as a warning. ``quarantine=True`` (the leader at resume)
    renames them to ``step-N.corrupt`` so that pruning by step order can never keep a corrupt
    checkpoint in place of a good one.
    """
    skipped = []
    for entry in reversed(layout.list_steps(ckpt_dir)):
        problem = verify_step(entry.path)
        if problem is None:
            return entry.step, skipped
        log.warning("checkpoint %s is not usable (%s); trying the previous one", entry.path, problem)
        skipped.append((entry.step, problem))
        if quarantine:
            target = entry.path.with_name(entry.path.name + layout.CORRUPT_SUFFIX)
            if not target.exists():
                os.rename(entry.path, target)
                log.warning("moved %s aside to %s", entry.path, target)
    return None, skipped


def read_weights(step_dir: Path, tp: int = 0, pp: int = 0, prefix: str = "model") -> StateDict:
    """The parameters of shard (tp, pp): the policy's (`prefix` "model") or the critic's ("critic"); an
    expert-parallel run's other experts (`layout.model_file`'s ep files) merged in."""
    path = step_dir / f"{prefix}-tp{tp}-pp{pp}.safetensors"
    if not path.is_file():
        have = sorted(p.name for p in step_dir.glob(f"{prefix}-*.safetensors"))
        raise CheckpointError(f"{step_dir} has no parameters for tp={tp} pp={pp} ({path.name}); "
                              f"it has {have}: was it saved with another parallel layout?")
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    for part in sorted(step_dir.glob(f"{prefix}-tp{tp}-pp{pp}-ep*.safetensors")):
        more = load_file(str(part))
        if set(more) & set(tensors):
            raise CheckpointError(f"{part} repeats tensors of shard tp={tp} pp={pp}: {sorted(set(more) & set(tensors))[:3]}")
        tensors.update(more)
    return tensors


def _read_safetensors(path: Path) -> tuple[StateDict, dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(layout.METADATA_KEY, "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    meta.pop("identity", None)
    return tensors, meta


def read_rank(step_dir: Path, identity: str) -> Restored:
    """Everything saved for ``identity`` in a (verified) step directory, and every trainer rank's record (the
    saved layout, `Restored.trainer_layout`). An identity the checkpoint does not hold (it was written with
    another layout) gets ``found=False`` and the shared state only."""
    state = step_dir / layout.STATE_FILE
    step, shared = read_shared(state)
    records = read_records(state)
    trainers = [r for r in records if r.identity.startswith("trainer/")]
    rec = next((r for r in records if r.identity == identity), None)
    if rec is None:  # a rank of a layout the checkpoint was not written with: its caller decides what it needs
        return Restored(step=step, identity=identity, coords={}, shared=shared, step_dir=step_dir,
                        trainers=trainers, found=False)
    out = Restored(step=step, identity=identity, coords=rec.coords, rng=rec.rng,
                   data_position=rec.data_position, extra=rec.extra, shared=shared,
                   saved_world_rank=rec.world_rank, step_dir=step_dir, trainers=trainers)
    if "tp" in rec.coords:  # a trainer shard: its parameters come from that shard's dp-rank-0 file
        out.model = read_weights(step_dir, rec.coords.get("tp", 0), rec.coords.get("pp", 0))
    tp, pp = rec.coords.get("tp", 0), rec.coords.get("pp", 0)
    if "tp" in rec.coords and (step_dir / layout.critic_file(tp, pp)).is_file():  # the value model, like the policy
        out.critic = read_weights(step_dir, tp, pp, prefix="critic")
        out.critic_optim, out.critic_optim_meta = read_optimizer(step_dir, tp, pp, prefix="critic-optim")
    for name in rec.files:
        if name.startswith("optim-"):
            out.optim, out.optim_meta = _read_safetensors(step_dir / name)
            if "rows" in out.optim_meta:  # a sharded optimizer: this shard's DP ranks' files together
                out.optim, out.optim_meta = read_optimizer(step_dir, rec.coords.get("tp", 0), rec.coords.get("pp", 0))
    return out


def read_optimizer(step_dir: Path, tp: int = 0, pp: int = 0, prefix: str = "optim") -> tuple[StateDict, dict[str, str]]:
    """The whole-parameter optimizer state of tensor shard (tp, pp): its DP ranks' files put together
    (`ckpt/optim.py::assemble_state`); an unsharded run's dp-rank-0 file as it is."""
    from yatt_hpc.ckpt.optim import assemble_state

    names = sorted(step_dir.glob(f"{prefix}-tp{tp}-pp{pp}-dp*.safetensors"), key=lambda p: int(p.stem.rpartition("dp")[2]))
    if not names:
        raise CheckpointError(f"{step_dir} has no optimizer state for tp={tp} pp={pp}: was it saved with "
                              "another parallel layout?")
    first = _read_safetensors(names[0])
    if "rows" not in first[1]:
        return first
    try:
        return assemble_state([first] + [_read_safetensors(n) for n in names[1:]])
    except ValueError as err:
        raise CheckpointError(f"{step_dir}: {err}") from None


# ------------------------------------------------------------------ another trainer layout
#
# Resuming a checkpoint with another trainer layout: the tensors of shard (tp_rank, pp_rank) of a `Shards`
# layout from a checkpoint written with another `Shards` and any number of data-parallel ranks.
#
#     model = reshard_weights(step_dir, hf_config, Shards(tp=1, pp=1), tp_rank=0, pp_rank=1, now=Shards(2, 2))
#     optim, meta = reshard_optimizer(step_dir, hf_config, Shards(1, 1), 0, 1, Shards(2, 2))
#
# The data-parallel size needs no tensor work: parameters are the same on every DP rank, and the optimizer
# state is read whole (`read_optimizer` puts a sharded optimizer's rows back together) for the new
# ranks to keep what they own. A new tensor or pipeline split (another pp, or other uneven stages) goes through
# the HF layout: the saved shards are merged, by the stage split the checkpoint records (`pipeline_record`), as
# `ckpt export-hf` merges them and split as a fresh start splits an HF model
# (`train/convert.py`). AdamW's moments and a bf16 run's fp32 masters have the parameters' shapes, so the
# same merge and split apply to them, tensor by tensor. Every rank reads all saved shards of the tensors
# it reshards: a resume's memory peak is the whole model's state once per rank (the data positions move in
# `sched/overdispatch.py::relayout_positions`).


@dataclass(frozen=True)
class Shards:
    """A trainer's model-parallel split: `tp` tensor shards in each of `pp` pipeline stages, the first and last
    stage holding `split` layers when uneven (`placement.trainer.pp_layers`; None: layers/pp each)."""

    tp: int = 1
    pp: int = 1
    split: tuple[int, int] | None = None

    def stages_text(self) -> str:
        return split_text(self.split)


def _convert():
    from yatt_hpc.train import convert

    return convert


def _reshard(parts: list[list[StateDict]], hf_config: Any, saved: Shards, tp_rank: int, pp_rank: int,
             now: Shards) -> StateDict:
    """`parts[pp][tp]` (the shards of layout `saved`) merged to HF and split into shard (tp_rank, pp_rank) of `now`
    (a LoRA run's adapters through their PEFT layout, `lora/peft.py`)."""
    from yatt_hpc.lora import peft, targets

    convert = _convert()  # torch and the model code: only a trainer rank that reshards imports them here
    stage = convert.Stage(pp_rank, now.pp, now.split)
    if any(targets.is_adapter(name) for name in parts[0][0]):
        return peft.reshard(parts, hf_config, tp_rank, now.tp, saved.split, stage)
    merged = convert.stages_to_hf(parts, hf_config, split=saved.split)
    return convert.hf_to_megatron(merged, hf_config, tp_rank, now.tp, stage)


def reshard_weights(step_dir: Path, hf_config: Any, saved: Shards, tp_rank: int, pp_rank: int,
                    now: Shards) -> StateDict:
    """Shard (tp_rank, pp_rank) of `now` of the parameters saved in the `saved` layout."""
    if saved == now:
        return read_weights(step_dir, tp_rank, pp_rank)
    parts = [[read_weights(step_dir, t, p) for t in range(saved.tp)] for p in range(saved.pp)]
    return _reshard(parts, hf_config, saved, tp_rank, pp_rank, now)


def reshard_optimizer(step_dir: Path, hf_config: Any, saved: Shards, tp_rank: int, pp_rank: int,
                      now: Shards) -> tuple[StateDict, dict[str, str]]:
    """The whole-parameter optimizer state (``<param>.<key>``) of shard (tp_rank, pp_rank) of `now`."""
    if saved == now:
        return read_optimizer(step_dir, tp_rank, pp_rank)
    parts = [[read_optimizer(step_dir, t, p) for t in range(saved.tp)] for p in range(saved.pp)]
    first = parts[0][0][0]
    keys = sorted({k.rpartition(".")[2] for k in first} - {"step"})
    out: StateDict = {}
    for key in keys:  # exp_avg, exp_avg_sq, master: one parameter-shaped tensor per parameter
        per_shard = [[{k.rpartition(".")[0]: v for k, v in tensors.items() if k.rpartition(".")[2] == key}
                      for tensors, _ in stage] for stage in parts]
        out.update({f"{name}.{key}": t for name, t in _reshard(per_shard, hf_config, saved, tp_rank, pp_rank, now).items()})
    steps = [v for k, v in first.items() if k.endswith(".step")]
    if steps:  # one count for every parameter: the optimizer steps them together
        out.update({f"{name.rpartition('.')[0]}.step": steps[0] for name in out if name.endswith(".exp_avg")})
    return out, parts[0][0][1]
