"""The multi-rank commit protocol of one save (every rank calls ``write_rank_files`` then ``commit``).

    entries = write_rank_files(incomplete_dir, snap)        # this rank's safetensors, fsynced
    commit(comm, leader, ckpt_dir, step, snap, shared, entries, error, keep_last)   # collective

Sequence (the leader is one rank of ``comm``; every other rank only writes its own files):

    all ranks:  write own files into step-N.incomplete/ -> fsync files -> fsync dir
    all ranks:  gather (record, [name, size, sha256], error) to the leader (each collective of a save
                behind a polled barrier: ranks that wait sleep, see ``quiet_barrier``)
    leader:     any error? -> leave .incomplete, report it (the next start removes it)
                write state.h5 (records + manifest) -> fsync -> fsync dir
                rename step-N.incomplete -> step-N -> fsync checkpoints/
                write COMMITTED (temp, fsync, rename, fsync dir)   <- the commit point
                   (fails? rename step-N back to step-N.incomplete: no step-N without its marker)
                prune committed checkpoints beyond keep_last
    all ranks:  bcast the outcome; every rank raises the same CheckpointError on failure
                (DiskFullError, a subclass, when the disk was full)

A full disk (ENOSPC/EDQUOT on any rank) is worded as such: where, how much is free, how much a
checkpoint takes, the fix, and which committed step a rerun resumes from.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.errors import (
    DISK_FULL,
    CheckpointError,
    DiskFullError,
    describe_write_error,
    dir_size,
    free_space,
)
from yatt_hpc.ckpt.manifest import (
    FileEntry,
    digest_file,
    fsync_dir,
    fsync_file,
    write_marker,
)
from yatt_hpc.ckpt.state import RankRecord, SharedState, write_state
from yatt_hpc.ckpt.writer import RankState, TensorFile
from yatt_hpc.metrics.activity import ACTIVITY

log = logging.getLogger(__name__)


def rank_files(inc: Path, snap: RankState) -> dict[str, TensorFile]:
    """This rank's tensor files in ``inc`` by slot ("model", "optim"), not written yet."""
    c = snap.coords
    files = {}
    if snap.model is not None:
        files["model"] = (layout.model_file(c.get("tp", 0), c.get("pp", 0), c.get("ep", 0)), snap.model, {})
    if snap.optim is not None:
        files["optim"] = (layout.optim_file(c.get("tp", 0), c.get("pp", 0), c.get("dp", 0)), snap.optim,
                          snap.optim_meta)
    if snap.critic is not None:
        files["critic"] = (layout.critic_file(c.get("tp", 0), c.get("pp", 0)), snap.critic, {})
    if snap.critic_optim is not None:
        files["critic_optim"] = (layout.critic_optim_file(c.get("tp", 0), c.get("pp", 0), c.get("dp", 0)),
                                 snap.critic_optim, snap.critic_optim_meta)
    # One metadata key, its JSON sorted: identical saves are identical bytes.
    return {slot: TensorFile(inc / name, tensors, {layout.METADATA_KEY: json.dumps(
        {"identity": snap.identity, **meta}, sort_keys=True)}) for slot, (name, tensors, meta) in files.items()}


def write_unstaged(inc: Path, files: dict[str, TensorFile], unstaged: set[tuple[str, str]]) -> None:
    """Before the step goes on: the tensors a capped staging left live, written into their files."""
    for slot, f in files.items():
        names = [name for s, name in unstaged if s == slot]
        if names:
            inc.mkdir(parents=True, exist_ok=True)
            f.write(names)


def write_rank_files(inc: Path, snap: RankState, files: dict[str, TensorFile] | None = None) -> list[FileEntry]:
    """Write what this rank's tensor files in ``inc`` still lack (all of `rank_files` by default), make
    them durable; return their digests."""
    inc.mkdir(parents=True, exist_ok=True)
    entries = []
    for f in (rank_files(inc, snap) if files is None else files).values():
        f.write()
        fsync_file(f.path)
        entries.append(digest_file(f.path))
        ACTIVITY.progress("checkpoint file")  # a long save keeps the health monitor informed
    fsync_dir(inc)
    return entries


def quiet_barrier(comm, poll_s: float = 0.005) -> None:
    """Wait for every rank of ``comm`` sleeping between tests of an Ibarrier. The collectives of a
    save are reached seconds apart (each rank writes its own shard first; the others then wait for
    the leader's fsyncs), often on the writer thread while the main thread computes: a blocking
    Open MPI collective would spin there and take the core it needs. Not `comm.transport`'s: that
    one marks the loop thread's activity for the health monitor, which the writer thread must not,
    and this one also runs without MPI (`LocalComm`)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)


def commit(comm, leader: int, ckpt_dir: Path, step: int, snap: RankState, shared: SharedState | None,
           entries: list[FileEntry], error: str | None, keep_last: int) -> None:
    """Collective over ``comm``: gather to the leader, which commits; raise on every rank on failure."""
    record = RankRecord(snap.identity, comm.Get_rank(), dict(snap.coords), snap.rng, snap.data_position,
                        snap.extra, [e.name for e in entries])
    quiet_barrier(comm)
    payloads = comm.gather((record, entries, error), root=leader)
    outcome = None
    if comm.Get_rank() == leader:
        try:
            outcome = _leader_commit(ckpt_dir, step, shared or SharedState(), payloads, keep_last)
        except Exception as err:
            log.exception("checkpoint step %d: commit failed on the leader", step)
            outcome = f"leader: {describe_write_error(err)}"
        if outcome and DISK_FULL in outcome:
            outcome += disk_full_advice(ckpt_dir, step, keep_last)
    quiet_barrier(comm)
    outcome = comm.bcast(outcome, root=leader)
    if outcome:
        error = DiskFullError if DISK_FULL in outcome else CheckpointError
        raise error(f"checkpoint step {step} was not committed: {outcome}")


def _leader_commit(ckpt_dir: Path, step: int, shared: SharedState, payloads, keep_last: int) -> str | None:
    problems = [f"rank {rec.world_rank} ({rec.identity}): {err}" for rec, _, err in payloads if err]
    records = [rec for rec, _, _ in payloads]
    entries = sorted((e for _, es, _ in payloads for e in es), key=lambda e: e.name)
    for what, names in (("identity", [r.identity for r in records]), ("file", [e.name for e in entries])):
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"duplicate {what} {dupes} (each shard's model file comes from one rank only)")
    if problems:
        return "; ".join(problems)
    inc, final = layout.incomplete_dir(ckpt_dir, step), layout.step_dir(ckpt_dir, step)
    inc.mkdir(parents=True, exist_ok=True)  # a job where no rank writes tensors
    created = time.time()
    state_path = inc / layout.STATE_FILE
    write_state(state_path, step, shared, records, entries, created)
    fsync_file(state_path)
    state_entry = digest_file(state_path)
    fsync_dir(inc)
    if final.exists():
        log.warning("checkpoint step %d already exists at %s; replacing it", step, final)
        shutil.rmtree(final)
    os.rename(inc, final)
    try:
        fsync_dir(ckpt_dir)
        write_marker(final, step, state_entry, created)
    except BaseException:
        _uncommit(final, inc)
        raise
    log.info("checkpoint step %d committed: %s (%d files)", step, final, len(entries) + 1)
    prune(ckpt_dir, keep_last, protect=step)
    return None


def _uncommit(final: Path, inc: Path) -> None:
    """The marker could not be written (e.g. no room even for it): make the directory an
    ``.incomplete`` leftover again, so no ``step-N`` without its marker is ever left behind."""
    try:
        (final / f".{layout.COMMIT_MARKER}.tmp").unlink(missing_ok=True)
        os.rename(final, inc)
        fsync_dir(final.parent)
    except OSError:
        log.exception("could not move %s back to %s; it has no commit marker, so it is never loaded", final, inc)


def disk_full_advice(ckpt_dir: Path, step: int, keep_last: int) -> str:
    """The rest of a disk-full message: where, how much is free and needed, the fix, where a rerun resumes."""
    latest = max((s.step for s in layout.list_steps(ckpt_dir) if s.committed), default=None)
    where = f". Writing {layout.incomplete_dir(ckpt_dir, step)}: {free_space(ckpt_dir)}"
    need = ""
    if latest is not None:
        need = (f"; checkpoint step {latest} takes {dir_size(layout.step_dir(ckpt_dir, latest))} and "
                f"checkpoint.keep_last={keep_last} keeps {keep_last} of them plus the one being written")
    resume = (f"it resumes from step {latest}, the latest committed checkpoint" if latest is not None
              else "no checkpoint was committed yet, so it starts from step 0")
    return (f"{where}{need}. Fix: free space on that filesystem (or copy the run directory to one with room "
            f"and pass that --run-dir), then run the same command again: {resume}")


def prune(ckpt_dir: Path, keep_last: int, protect: int | None = None) -> list[int]:
    """Remove committed checkpoints beyond the newest ``keep_last``; return the pruned steps."""
    pruned = []
    for old in layout.steps_to_prune(layout.list_steps(ckpt_dir), keep_last):
        if old.step == protect:
            continue
        shutil.rmtree(old.path, ignore_errors=True)
        pruned.append(old.step)
    if pruned:
        fsync_dir(ckpt_dir)
        log.info("pruned checkpoints %s (keep_last=%d)", pruned, keep_last)
    return pruned


def clean_incomplete(ckpt_dir: Path) -> list[Path]:
    """Remove ``step-N.incomplete`` leftovers of a crashed save (call only when no save runs)."""
    stale = layout.list_incomplete(ckpt_dir)
    for path in stale:
        log.warning("removing %s: a save that never committed (crash or kill during the write)", path)
        shutil.rmtree(path, ignore_errors=True)
    return stale
