"""The checkpoint component's exceptions, and how a failed write is worded (stdlib only, so the CLI imports fast).

    from yatt_hpc.ckpt.errors import CheckpointError, DiskFullError, describe_write_error, free_space
    describe_write_error(err)        # "disk full (No space left on device)" or "OSError: ..." on one line
    free_space(path)                 # "1.8 MiB free of 5.0 MiB on that filesystem"
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

DISK_FULL = "disk full"
# ENOSPC: no blocks (or no inodes) left; EDQUOT: the user's quota is spent. Same remedy.
_FULL_ERRNOS = tuple(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if code is not None)


class CheckpointError(RuntimeError):
    """A save could not be committed, or a checkpoint cannot be loaded; the message says why."""


class DiskFullError(CheckpointError):
    """A save did not fit on its filesystem (ENOSPC/EDQUOT): the user's to fix, the message says how."""


def disk_full_reason(err: BaseException) -> str | None:
    """``os.strerror`` of ENOSPC/EDQUOT when ``err`` (or what caused it) is one, else None.

    safetensors reports the OS error only in its text ("... (os error 28)"), h5py as an OSError
    with the errno set, plain writes as an OSError: all three are recognized.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        code = getattr(err, "errno", None)
        if code in _FULL_ERRNOS:
            return os.strerror(code)
        text = str(err)
        for code in _FULL_ERRNOS:
            if os.strerror(code) in text or f"os error {code})" in text:
                return os.strerror(code)
        err = err.__cause__ or err.__context__
    return None


def describe_write_error(err: BaseException) -> str:
    """One line for a failed checkpoint write: ``disk full (...)`` says so; anything else keeps its type."""
    reason = disk_full_reason(err)
    if reason:
        return f"{DISK_FULL} ({reason})"
    return f"{type(err).__name__}: {' '.join(str(err).split())}"  # h5py messages span several lines


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def dir_size(path: Path) -> str:
    """The total size of the files directly in ``path``, human-readable."""
    return _size(sum(p.stat().st_size for p in path.iterdir() if p.is_file()))


def free_space(path: Path) -> str:
    """What is free on the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage, vfs = shutil.disk_usage(path), os.statvfs(path)
    except OSError as err:
        return f"free space unknown ({err.strerror})"
    inodes = ", and no inodes (files) are left" if vfs.f_files and not vfs.f_favail else ""
    return f"{_size(usage.free)} free of {_size(usage.total)} on that filesystem{inodes}"
