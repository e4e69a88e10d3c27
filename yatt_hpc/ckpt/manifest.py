"""File digests (size + sha256), durable writes (fsync of files and directories) and verification.

    entry = digest_file(path)                    # FileEntry(name, size, sha256)
    fsync_file(path); fsync_dir(path.parent)     # data, then the directory entry naming it
    problem = verify_step(step_dir)              # None when the checkpoint is whole, else the reason

The manifest of a checkpoint lives in its ``state.h5``; ``state.h5``'s own size and sha256 live in
the commit marker, so every byte of a committed checkpoint is covered by a digest.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from yatt_hpc.ckpt.layout import COMMIT_MARKER, STATE_FILE, list_steps

_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


def digest_file(path: Path) -> FileEntry:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            h.update(view[:n])
            size += n
    return FileEntry(path.name, size, h.hexdigest())


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX needs the directory fsynced too)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(step_dir: Path, step: int, state: FileEntry, created: float) -> None:
    """The commit marker: written to a temp name, fsynced, renamed, directory fsynced — last of all."""
    tmp = step_dir / f".{COMMIT_MARKER}.tmp"
    body = {"step": step, "created": created, "state": {"name": state.name, "size": state.size,
                                                        "sha256": state.sha256}}
    with open(tmp, "w") as fh:
        json.dump(body, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, step_dir / COMMIT_MARKER)
    fsync_dir(step_dir)


def read_marker(step_dir: Path) -> dict:
    """The parsed commit marker; raises ``ValueError`` naming what is wrong with it."""
    path = step_dir / COMMIT_MARKER
    if not path.is_file():
        raise ValueError("missing commit marker")
    try:
        body = json.loads(path.read_text())
        state = body["state"]
        return {"step": int(body["step"]), "created": float(body["created"]),
                "state": FileEntry(str(state["name"]), int(state["size"]), str(state["sha256"]))}
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"unreadable commit marker ({err})") from None


def check_entry(folder: Path, entry: FileEntry) -> str | None:
    """None if ``folder/entry.name`` has the recorded size and sha256, else why not."""
    path = folder / entry.name
    if not path.is_file():
        return f"missing file {entry.name}"
    size = path.stat().st_size
    if size != entry.size:
        return f"{entry.name}: size {size} != recorded {entry.size} (truncated or overwritten)"
    if digest_file(path).sha256 != entry.sha256:
        return f"{entry.name}: sha256 mismatch (content changed)"
    return None


def verify_step(step_dir: Path) -> str | None:
    """None when ``step_dir`` is committed and every file matches its digest, else the first problem."""
    from yatt_hpc.ckpt.state import (
        read_manifest,  # state.py imports h5py; keep this module light
    )

    try:
        marker = read_marker(step_dir)
    except ValueError as err:
        return str(err)
    if marker["state"].name != STATE_FILE:
        return f"commit marker names {marker['state'].name!r}, expected {STATE_FILE}"
    problem = check_entry(step_dir, marker["state"])
    if problem:
        return problem
    try:
        entries = read_manifest(step_dir / STATE_FILE)
    except (OSError, KeyError, ValueError) as err:
        return f"{STATE_FILE}: unreadable manifest ({err})"
    for entry in entries:
        problem = check_entry(step_dir, entry)
        if problem:
            return problem
    return None


def complete_message(run_dir: Path, done: int, steps: int) -> str:
    """What running a finished run again says (its newest checkpoint `done` covers train.steps = `steps`)."""
    if done == steps:
        return f"run {run_dir} is already complete: {done} of {steps} steps; nothing to do"
    return (f"run {run_dir} is already past train.steps={steps}: its newest checkpoint is step {done}; nothing to do "
            f"(set train.steps above {done} to train on)")


def completed_step(ckpt_dir: Path, steps: int) -> int | None:
    """The step of the newest committed checkpoint when it covers ``steps`` and verifies: a run with
    nothing left to do (its launcher need not start a rank). None otherwise, also when that
    checkpoint is damaged: the ranks then resume from an older one, moving it aside as they do."""
    committed = [entry for entry in list_steps(ckpt_dir) if entry.committed]
    if not committed or committed[-1].step < steps or verify_step(committed[-1].path) is not None:
        return None
    return committed[-1].step
