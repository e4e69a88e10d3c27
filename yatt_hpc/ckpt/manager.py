"""The checkpoint facade the training loop calls on every rank of the MPI world.

    mgr = CheckpointManager(run_dir, MPI.COMM_WORLD, keep_last=2, async_save=True)   # collective
    restored = mgr.load_latest(identity)            # collective; None on a fresh run
    ...
    if should_save(step, cfg.checkpoint.interval, cfg.train.steps):
        mgr.save(step, RankState(identity, coords, model=..., optim=..., rng=capture_rng(), ...),
                 SharedState(counters, sampling, config_yaml))   # collective; blocks for the snapshot only
    mgr.commit_now(step, state, shared)             # collective; another thread, the loop parked
    mgr.close()                                     # collective; waits for the save in flight

Every rank of ``comm`` calls the collective methods in the same order. ``comm=None`` is a one-rank
job (tests, tools). Threads: the background writer runs the commit collectives (gather, bcast)
on its own duplicate of ``comm`` (``comm.Dup()``), so they can never match a collective the
training loop issues on ``comm`` meanwhile. That needs ``MPI.Query_thread() == THREAD_MULTIPLE``
(mpi4py's default request); with a lower level the thread only writes and fsyncs files, and the
commit collectives run on the calling thread at the next ``save``/``wait``/``close``.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Self

from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.commit import clean_incomplete, commit, quiet_barrier, rank_files, write_rank_files, write_unstaged
from yatt_hpc.ckpt.errors import CheckpointError, describe_write_error
from yatt_hpc.ckpt.loader import Restored, find_latest, read_rank, read_weights, recorded_split, split_text
from yatt_hpc.ckpt.state import SharedState
from yatt_hpc.ckpt.writer import BackgroundWriter, RankState, Staging, snapshot
from yatt_hpc.metrics.activity import ACTIVITY

log = logging.getLogger(__name__)


class _Done:
    """A request that has completed (LocalComm's collectives)."""

    def Test(self) -> bool:
        return True


class LocalComm:
    """The communicator of a one-rank job: the few MPI calls the checkpoint code uses."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def gather(self, obj, root: int = 0):
        return [obj]

    def bcast(self, obj, root: int = 0):
        return obj

    def Barrier(self) -> None:
        pass

    def Dup(self) -> LocalComm:
        return self

    def Ibarrier(self) -> _Done:
        return _Done()

    def Free(self) -> None:
        pass


def _thread_collectives_ok(comm) -> bool:
    if isinstance(comm, LocalComm):
        return True
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


class CheckpointManager:
    def __init__(self, run_dir: str | Path, comm=None, *, keep_last: int = 2, async_save: bool = True,
                 leader: int = 0, thread_collectives: bool | None = None, staging_bytes: int | None = None):
        """Collective: the leader removes stale ``.incomplete`` dirs before anyone writes.

        ``staging_bytes``: the most host memory an async save's snapshot holds (None: all of the state);
        tensors past it are written before ``save`` returns.

        ``thread_collectives`` None: commit from the writer thread iff MPI is THREAD_MULTIPLE;
        False: always commit on the calling thread at the next save/wait/close.
        """
        layout.steps_to_prune([], keep_last)  # validates keep_last >= 2
        self.ckpt_dir = layout.checkpoints_dir(run_dir)
        self.comm = comm if comm is not None else LocalComm()
        self.leader, self.keep_last, self.async_save = leader, keep_last, async_save
        self.is_leader = self.comm.Get_rank() == leader
        if self.is_leader:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            clean_incomplete(self.ckpt_dir)
        self.comm.Barrier()
        auto = _thread_collectives_ok(self.comm)
        self._threaded_commit = auto if thread_collectives is None else (thread_collectives and auto)
        self._wcomm = self.comm.Dup() if self._threaded_commit else None
        self._writer = BackgroundWriter()
        self._staging = Staging(staging_bytes)
        self._deferred: tuple | None = None
        self.last_stall_s = 0.0
        self.skipped: list[tuple[int, str]] = []  # (step, why) of checkpoints latest_step passed over

    # ------------------------------------------------------------------ saving

    def prepare(self, state: RankState) -> None:
        """Optional, local: allocate and fault in the snapshot buffers for tensors shaped like ``state``'s.

        Without it the first async save pays for that (seconds per GiB on some VMs). Call once
        after the first optimizer step (AdamW creates its state lazily). Idempotent.
        """
        if self.async_save:
            self.wait()
            snapshot(state, self._staging)

    def save(self, step: int, state: RankState, shared: SharedState | None = None) -> None:
        """Collective. Snapshot this rank's state and write checkpoint ``step``.

        Blocks for: the previous save in flight (at most one), then the host-memory snapshot.
        ``async_save=False`` writes and commits before returning. ``shared`` counts on the leader only.
        Raises ``CheckpointError`` (on every rank alike) if a previous save failed to commit
        (``DiskFullError``, a subclass, when it did not fit on its filesystem).
        """
        start = time.perf_counter()
        self.wait()
        if not self.async_save:
            self._write_and_commit(step, snapshot(state, None), shared, self.comm)
            self.last_stall_s = time.perf_counter() - start
            log.info("checkpoint step %d written and committed before the step ended (checkpoint.async=false)", step)
            return
        snap = snapshot(state, self._staging)
        inc = layout.incomplete_dir(self.ckpt_dir, step)
        files, error = rank_files(inc, snap), None
        try:  # what did not fit under checkpoint.staging_mb, from the live tensors, before they change
            write_unstaged(inc, files, self._staging.unstaged)
        except Exception as err:  # reported by the commit, on every rank alike
            log.exception("checkpoint step %d: writing this rank's unstaged tensors failed", step)
            error = describe_write_error(err)
        comm = self._wcomm if self._threaded_commit else None
        self._writer.submit(lambda: self._write_and_commit(step, snap, shared, comm, files, error))
        self.last_stall_s = time.perf_counter() - start
        if self._staging.unstaged:
            log.info("checkpoint step %d: %d tensors past checkpoint.staging_mb written before the step went on; "
                     "the writer thread writes the rest in the background", step, len(self._staging.unstaged))
        else:
            log.info("checkpoint step %d snapshot taken; the writer thread writes it in the background", step)

    def _write_and_commit(self, step: int, snap: RankState, shared: SharedState | None, comm,
                          files=None, error: str | None = None) -> None:
        entries = []
        try:
            if error is None:
                entries = write_rank_files(layout.incomplete_dir(self.ckpt_dir, step), snap, files)
        except Exception as err:
            log.exception("checkpoint step %d: writing this rank's files failed", step)
            error = describe_write_error(err)
        if comm is None:  # no THREAD_MULTIPLE: the calling thread runs the collectives in wait()
            self._deferred = (step, snap, shared, entries, error)
            return
        commit(comm, self.leader, self.ckpt_dir, step, snap, shared, entries, error, self.keep_last)

    def commit_now(self, step: int, state: RankState | None, shared: SharedState | None = None) -> None:
        """Collective over the writer's communicator, from a thread other than the training loop's
        while that loop makes no checkpoint call (the stop watchdog; the loop is parked or busy in a
        step). Finish the save in flight; then, if ``state`` is given, write and commit ``step`` now.

        ``state`` is written from the tensors as they are (no staging copy): the caller guarantees
        they do not change meanwhile. Needs commits off the loop thread (MPI THREAD_MULTIPLE).
        """
        if not self._threaded_commit:
            raise CheckpointError("commit_now needs MPI THREAD_MULTIPLE (commit collectives off the loop thread)")
        self._writer.wait()
        if state is not None:
            self._write_and_commit(step, snapshot(state, None), shared, self._wcomm)

    def wait(self) -> None:
        """Collective while a save is in flight. Block until it is committed; re-raise its failure."""
        with ACTIVITY.waiting("checkpoint writer"):  # the writer thread ticks per file (health monitor)
            self._writer.wait()
        if self._deferred is not None:
            step, snap, shared, entries, error = self._deferred
            self._deferred = None
            commit(self.comm, self.leader, self.ckpt_dir, step, snap, shared, entries, error, self.keep_last)

    @property
    def in_flight(self) -> bool:
        return self._writer.busy or self._deferred is not None

    def close(self) -> None:
        """Collective. Wait for the save in flight, then free the writer's communicator."""
        try:
            self.wait()
        finally:
            if self._wcomm is not None and self._wcomm is not self.comm:
                self._wcomm.Free()
            self._wcomm = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ loading

    def latest_step(self) -> int | None:
        """Collective. The leader verifies (sizes + sha256) from the newest down; all ranks get its answer.

        Newer checkpoints that did not verify are moved aside to ``step-N.corrupt``; ``skipped`` then
        holds their (step, reason) on every rank, for the caller to report.
        """
        self.wait()
        answer: tuple[int | None, list[tuple[int, str]]] = (None, [])
        if self.is_leader:
            answer = find_latest(self.ckpt_dir, quarantine=True)
        quiet_barrier(self.comm)  # others sleep while the leader checks sizes and sha256 of every shard
        step, self.skipped = self.comm.bcast(answer, root=self.leader)
        return step

    def load_latest(self, identity: str) -> Restored | None:
        """Collective. This rank's part of the latest verified checkpoint, or None on a fresh run."""
        step = self.latest_step()
        if step is None:
            return None
        restored = read_rank(layout.step_dir(self.ckpt_dir, step), identity)
        log.info("resumed %s from checkpoint step %d", identity, step)
        return restored

    def load_from(self, source: str | Path, tp: int = 0, pp: int = 0,
                  split: tuple[int, int] | None = None) -> tuple[int, dict]:
        """Collective. Weights only (shard tp, pp of stages split as `split` says) of the latest verified checkpoint
        of another run, which must have the same layout.

        ``source`` is a run directory, its ``checkpoints/`` directory, or one ``step-N`` directory.
        """
        answer: tuple[int | None, str] = (None, "")
        if self.is_leader:
            answer = resolve_source(Path(source))
        quiet_barrier(self.comm)
        step, where = self.comm.bcast(answer, root=self.leader)
        if step is None:
            raise CheckpointError(where)
        saved = recorded_split(Path(where))
        if saved != split:
            raise CheckpointError(f"checkpoint.load_from={source} was written with {split_text(saved)} and this run has "
                                  f"{split_text(split)}; use its split, or export it with `yatt-hpc ckpt export-hf` and point "
                                  "model.path at the export")
        return step, read_weights(Path(where), tp, pp)


def resolve_source(source: Path) -> tuple[int | None, str]:
    """(step, step dir) of the checkpoint ``source`` names, or (None, why not)."""
    if (source / layout.COMMIT_MARKER).exists() or source.name.startswith("step-"):
        from yatt_hpc.ckpt.manifest import verify_step

        problem = verify_step(source)
        if problem:
            return None, f"checkpoint.load_from={source}: {problem}"
        return int(source.name.split("-", 1)[1]), str(source)
    ckpt_dir = layout.resolve_checkpoints_dir(source)
    step, skipped = find_latest(ckpt_dir)
    if step is None:
        why = f"; skipped: {skipped}" if skipped else ""
        return None, f"checkpoint.load_from={source}: no verified checkpoint under {ckpt_dir}{why}"
    return step, str(layout.step_dir(ckpt_dir, step))
