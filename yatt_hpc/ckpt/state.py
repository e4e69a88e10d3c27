"""``state.h5``: everything of a checkpoint that is not a tensor of the model or optimizer (h5py only).

    write_state(path, step, shared, records, manifest, created)   # the leader, once per save
    read_manifest(path); read_shared(path); read_record(path, "trainer/dp1/tp0/pp0")

Layout of the file:

    /                 attrs: format, step, created, config_sha256
    /config           the resolved config YAML (string dataset)
    /counters         attrs: step counters (ints)
    /sampling         dynamic-sampling state: a free-form tree (see ``write_tree``)
    /ranks/r<world>   attrs: identity, world_rank, coords (JSON), files (JSON)
        rng/          torch_cpu, torch_cuda/<i>, generators/<name> (uint8); attrs numpy, python (JSON)
        data/         this rank's data position (free-form tree)
        extra/        anything else the rank passed (free-form tree)
    /manifest         name, size, sha256 of every other file in the checkpoint

Free-form trees hold dicts (groups) of None, bool, int, float, str, numpy arrays and CPU torch
tensors (datasets, their kind in an attribute). Nothing is pickled, so reading runs no code.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from yatt_hpc.ckpt.manifest import FileEntry
from yatt_hpc.ckpt.rng import RngState

FORMAT = "yatt-hpc-ckpt/1"
_STR = h5py.string_dtype("utf-8")


@dataclass
class SharedState:
    """What one checkpoint holds once, for the whole job (the leader's copy is the one saved)."""

    counters: dict[str, int] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    config_yaml: str = ""


@dataclass
class RankRecord:
    """What one rank contributed, keyed by its global identity (e.g. ``trainer/dp1/tp0/pp0``)."""

    identity: str
    world_rank: int
    coords: dict[str, int] = field(default_factory=dict)
    rng: RngState | None = None
    data_position: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- free-form trees


def write_tree(group: h5py.Group, tree: dict[str, Any]) -> None:
    for key, value in tree.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"state key {key!r} must be a non-empty string without '/'")
        if isinstance(value, dict):
            write_tree(group.create_group(key), value)
            continue
        kind, data = _encode(value, key)
        ds = group.create_dataset(key, data=data, dtype=_STR if kind == "str" else None)
        ds.attrs["kind"] = kind


def _encode(value: Any, key: str) -> tuple[str, Any]:
    if value is None:
        return "none", np.zeros((), np.int8)
    if isinstance(value, (bool, np.bool_)):
        return "bool", np.asarray(bool(value))
    if isinstance(value, (int, np.integer)):
        return "int", np.asarray(int(value), dtype=np.int64)
    if isinstance(value, (float, np.floating)):
        return "float", np.asarray(float(value), dtype=np.float64)
    if isinstance(value, str):
        return "str", value
    torch = sys.modules.get("torch")  # a process without torch holds no tensors: it is not imported for this
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            raise ValueError(f"state {key!r}: bfloat16 tensors belong in safetensors, not state.h5")
        return "torch", value.detach().cpu().numpy()
    if isinstance(value, np.ndarray) and value.dtype != object:
        return "array", value
    raise TypeError(f"state {key!r}: cannot store {type(value).__name__} without pickle; use dicts, "
                    "scalars, str, numpy arrays or CPU tensors")


def read_tree(group: h5py.Group) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in group.items():
        if isinstance(item, h5py.Group):
            out[key] = read_tree(item)
            continue
        kind = item.attrs.get("kind", "array")
        if kind == "none":
            out[key] = None
        elif kind == "str":
            out[key] = item.asstr()[()]
        elif kind in ("bool", "int", "float"):
            out[key] = {"bool": bool, "int": int, "float": float}[kind](item[()])
        elif kind == "torch":
            import torch

            out[key] = torch.from_numpy(np.asarray(item[()]))
        else:
            out[key] = np.asarray(item[()])
    return out


# ----------------------------------------------------------------------------- write


def config_sha256(config_yaml: str) -> str:
    return hashlib.sha256(config_yaml.encode()).hexdigest()


def write_state(path: Path, step: int, shared: SharedState, records: list[RankRecord],
                manifest: list[FileEntry], created: float) -> None:
    """Write ``state.h5`` (the caller fsyncs it and digests it into the commit marker)."""
    with h5py.File(path, "w", track_order=True) as f:
        f.attrs.update(format=FORMAT, step=step, created=created,
                       config_sha256=config_sha256(shared.config_yaml))
        f.create_dataset("config", data=shared.config_yaml, dtype=_STR)
        counters = f.create_group("counters")
        counters.attrs.update({k: int(v) for k, v in shared.counters.items()})
        write_tree(f.create_group("sampling"), shared.sampling)
        ranks = f.create_group("ranks")
        for rec in sorted(records, key=lambda r: r.world_rank):
            _write_record(ranks.create_group(f"r{rec.world_rank}"), rec)
        m = f.create_group("manifest")
        m.create_dataset("name", data=[e.name for e in manifest], dtype=_STR)
        m.create_dataset("size", data=np.asarray([e.size for e in manifest], dtype=np.int64))
        m.create_dataset("sha256", data=[e.sha256 for e in manifest], dtype=_STR)


def _write_record(g: h5py.Group, rec: RankRecord) -> None:
    g.attrs.update(identity=rec.identity, world_rank=rec.world_rank,
                   coords=json.dumps(rec.coords, sort_keys=True), files=json.dumps(rec.files))
    if rec.rng is not None:
        r = g.create_group("rng")
        r.create_dataset("torch_cpu", data=rec.rng.torch_cpu)
        r.attrs.update(numpy=rec.rng.numpy_json, python=rec.rng.python_json)
        cuda = r.create_group("torch_cuda")
        for i, s in enumerate(rec.rng.torch_cuda):
            cuda.create_dataset(str(i), data=s)
        gens = r.create_group("generators")
        for name, s in rec.rng.generators.items():
            gens.create_dataset(name, data=s)
    write_tree(g.create_group("data"), rec.data_position)
    write_tree(g.create_group("extra"), rec.extra)


# ----------------------------------------------------------------------------- read


def read_manifest(path: Path) -> list[FileEntry]:
    with h5py.File(path, "r") as f:
        m = f["manifest"]
        names, sizes, shas = m["name"].asstr()[()], m["size"][()], m["sha256"].asstr()[()]
        return [FileEntry(str(n), int(s), str(h)) for n, s, h in zip(names, sizes, shas, strict=True)]


def read_shared(path: Path) -> tuple[int, SharedState]:
    """The step and the job-wide state of one ``state.h5``."""
    with h5py.File(path, "r") as f:
        shared = SharedState(counters={k: int(v) for k, v in f["counters"].attrs.items()},
                             sampling=read_tree(f["sampling"]), config_yaml=f["config"].asstr()[()])
        return int(f.attrs["step"]), shared


def identities(path: Path) -> dict[str, dict]:
    """identity -> {"world_rank", "coords"} for every rank recorded in ``state.h5``."""
    with h5py.File(path, "r") as f:
        return {g.attrs["identity"]: {"world_rank": int(g.attrs["world_rank"]),
                                      "coords": json.loads(g.attrs["coords"])} for g in f["ranks"].values()}


def read_record(path: Path, identity: str) -> RankRecord:
    """The record saved under ``identity``; ``KeyError`` listing the saved identities if absent."""
    with h5py.File(path, "r") as f:
        for g in f["ranks"].values():
            if g.attrs["identity"] == identity:
                return _read_record(g)
        saved = sorted(g.attrs["identity"] for g in f["ranks"].values())
    raise KeyError(f"no rank with identity {identity!r} in {path}; saved: {saved}")


def read_records(path: Path) -> list[RankRecord]:
    """Every rank's record, in the order they were saved."""
    with h5py.File(path, "r") as f:
        return [_read_record(g) for g in f["ranks"].values()]


def _read_record(g: h5py.Group) -> RankRecord:
    rng = None
    if "rng" in g:
        r = g["rng"]
        rng = RngState(torch_cpu=r["torch_cpu"][()], numpy_json=str(r.attrs["numpy"]),
                       python_json=str(r.attrs["python"]),
                       torch_cuda=[r["torch_cuda"][k][()] for k in sorted(r["torch_cuda"], key=int)],
                       generators={k: v[()] for k, v in r["generators"].items()})
    return RankRecord(identity=str(g.attrs["identity"]), world_rank=int(g.attrs["world_rank"]),
                      coords=json.loads(g.attrs["coords"]), rng=rng, data_position=read_tree(g["data"]),
                      extra=read_tree(g["extra"]), files=json.loads(g.attrs["files"]))
