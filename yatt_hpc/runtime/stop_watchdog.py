"""Stop within a bounded time even when one step is long: give up the running step, keep the last one.

    guard = StepGuard()                                  # the loop: begin_step / end_step / enter_mutation
    controller.watch_mutations(guard)                    # trainer: optimizer pre-step hook -> enter_mutation
    dog = StopWatchdog.build(world.comm, guard, stop_flag, grace_s=60.0, abandon=loop.abandon)  # collective
    ...
    dog.close()                                          # collective (None when disabled)

A stop signal normally waits for the next step boundary (`StepLoop.agree_stop`). When the leader's
step is still running `checkpoint.stop_grace_s` seconds after the signal, its watchdog thread asks
every rank, point to point over a duplicate of the world communicator (polled), to give up the step:

    leader's watchdog                          every other rank's watchdog
      freeze its own guard (in step N, clean)
      PROPOSE N  ----------------------------->  freeze(N): is this rank's state still step N's start?
      <----------------------------------------  VOTE yes / no
      all yes: DECIDE abandon ---------------->  abandon(record): commit checkpoint N (CheckpointManager,
               (leader: stop record, say why)      on the writer's communicator), barrier, exit 0
      any no:  DECIDE release ---------------->  release: the step runs on; the leader retries later

"Still step N's start": what changes early in a step (RNG, data position, sampler state) is copied
into a `StepRecord` when the step begins; parameters and optimizer state change only in the
optimizer step, which the trainer marks with `enter_mutation` (as the loop does before a boundary
save). A frozen rank's loop thread parks at its next `enter_mutation`, `begin_step` or `end_step`,
so a snapshot never races an update. A "no" comes from a trainer already inside its optimizer step
(the boundary is close: the normal path stops there) or from a rank whose loop is over (`close`
keeps answering until every rank is there). Ranks that finish a step early wait for the others
before a periodic save (`StepLoop.run`), so they stay clean meanwhile. After an abandon the processes exit
without finishing the step; messages of the step still in flight are dropped with the process
(the launchers treat the exit as a normal stop: see `launch/local.py` and `launch/launcher.py`).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
TAG_PROPOSE, TAG_VOTE, TAG_DECIDE = 1, 2, 3  # on the watchdog's own communicator


@dataclass(frozen=True)
class StepRecord:
    """What a rank's checkpoint of `step` needs besides live parameters/optimizer, as the step began."""

    step: int
    light: dict[str, Any]  # RankState fields (rng, data_position, extra): a private copy
    saved: bool  # checkpoint `step` was already handed to the writer at the boundary
    counters: dict[str, int] = field(default_factory=dict)  # the shared counters of checkpoint `step`


class StepGuard:
    """Per rank, thread-safe: whether this rank's checkpointed state still equals its step record.

    The loop thread calls `begin_step`, `enter_mutation` (before checkpointed state changes) and
    `end_step`; each of them waits while the watchdog holds the guard frozen. The watchdog `freeze`s
    only a clean guard, then `release`s it or abandons the step (the process then exits frozen).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._record: StepRecord | None = None
        self._clean = self._in_step = self._frozen = False

    # ------------------------------------------------------------------ the loop thread

    def begin_step(self, record: StepRecord) -> None:
        with self._cond:
            self._wait_thawed()
            self._record, self._clean, self._in_step = record, True, True

    def enter_mutation(self) -> None:
        """Checkpointed state is about to change (optimizer step, a save): step N's start is gone."""
        with self._cond:
            self._wait_thawed()
            self._clean = False

    def end_step(self) -> None:
        with self._cond:
            self._wait_thawed()
            self._in_step = False

    def _wait_thawed(self) -> None:
        while self._frozen:
            self._cond.wait()

    # ------------------------------------------------------------------ the watchdog thread

    def freeze(self, step: int | None = None, *, in_step: bool = False) -> StepRecord | None:
        """Hold the loop at its next guard call if the state still equals the record of `step`
        (any step if None; and only inside the step if `in_step`). The record, or None if not."""
        with self._cond:
            r = self._record
            ok = (r is not None and self._clean and not self._frozen and (step is None or r.step == step)
                  and (self._in_step or not in_step))
            self._frozen = ok
            return r if ok else None

    def release(self) -> None:
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    @property
    def frozen(self) -> bool:
        return self._frozen


def should_abandon(now: float, since: float | None, grace_s: float) -> bool:
    """The leader's rule: a stop signal arrived at `since` and the step outlasted the grace."""
    return since is not None and now - since >= grace_s


class StopWatchdog:
    """One thread per rank. The leader times the grace and decides; the others answer and follow.

    ``comm`` is the watchdog's own communicator (None: a job of one rank). ``abandon(record, waited)``
    commits checkpoint ``record.step`` (collective); ``exit`` ends the process after it (tests pass
    their own and see `abandoned`).
    """

    def __init__(self, comm, guard: StepGuard, flag, grace_s: float, abandon: Callable[[StepRecord, float], None],
                 *, leader: int = 0, poll_s: float = 0.05, retry_s: float = 0.5,
                 exit: Callable[[int], None] = os._exit):
        self.comm, self.guard, self.flag, self.grace_s = comm, guard, flag, grace_s
        self.abandon, self.leader, self.poll_s, self.retry_s, self.exit = abandon, leader, poll_s, retry_s, exit
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.abandoned: StepRecord | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._main, name="stop-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, comm, guard: StepGuard, flag, grace_s: float | None, abandon, **kw) -> StopWatchdog | None:
        """Collective over ``comm`` (the world). None when ``grace_s`` is None or MPI lacks THREAD_MULTIPLE
        (then a stop waits for the step boundary, as the leader logs)."""
        from mpi4py import MPI

        if grace_s is None:
            return None
        threads_ok = comm.allreduce(int(MPI.Query_thread() == MPI.THREAD_MULTIPLE), op=MPI.MIN)
        if not threads_ok:
            if comm.Get_rank() == kw.get("leader", 0):
                log.warning("checkpoint.stop_grace_s=%s needs MPI THREAD_MULTIPLE (this MPI gives level %d): "
                            "a stop signal waits for the step boundary however long the step", grace_s,
                            MPI.Query_thread())
            return None
        return cls(comm.Dup(), guard, flag, grace_s, abandon, **kw)

    def close(self) -> None:
        """Collective (every rank, after its loop): stop the thread and free the communicator.

        The thread keeps answering until every rank is here: the leader may still be inside the
        last step, asking, when the others are done (their guards, no longer clean, say no)."""
        self.guard.enter_mutation()  # waits out a question in progress; nothing to give up any more
        if self.comm is not None:
            self._wait([self.comm.Ibarrier()])
        self._closing.set()
        self._thread.join()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    # ------------------------------------------------------------------ the thread

    def _main(self) -> None:
        try:
            while not self._closing.is_set() and self.abandoned is None:
                self._lead() if self.rank == self.leader else self._follow()
        except BaseException:  # noqa: BLE001 - the failure policy of the worker: take the world down
            log.exception("stop watchdog failed")
            if self.comm is not None:
                from mpi4py import MPI

                MPI.COMM_WORLD.Abort(1)
            raise

    def _lead(self) -> None:
        since = self.flag.since
        if since is None:
            self.flag.wait(self.poll_s)
            return
        waited = time.monotonic() - since
        if not should_abandon(time.monotonic(), since, self.grace_s):
            self._closing.wait(min(self.poll_s, self.grace_s - waited))
            return
        record = self.guard.freeze(in_step=True)
        if record is None:  # between steps, or past its optimizer step: the boundary path stops
            self._closing.wait(self.poll_s)
            return
        if self._agree(record.step):
            self._abandon(record, waited)
            return
        self.guard.release()
        log.info("stop: a rank is past step %d's start (inside its optimizer step); waiting for the boundary",
                 record.step)
        self._closing.wait(self.retry_s)

    def _agree(self, step: int) -> bool:
        if self.size == 1:
            return True
        others = [r for r in range(self.size) if r != self.leader]
        for r in others:
            self.comm.Send(np.array([step], np.int64), dest=r, tag=TAG_PROPOSE)
        votes = {r: np.zeros(1, np.int64) for r in others}
        self._wait([self.comm.Irecv(votes[r], source=r, tag=TAG_VOTE) for r in others])
        agreed = all(int(v[0]) for v in votes.values())
        for r in others:
            self.comm.Send(np.array([int(agreed)], np.int64), dest=r, tag=TAG_DECIDE)
        return agreed

    def _follow(self) -> None:
        if not self.comm.Iprobe(source=self.leader, tag=TAG_PROPOSE):
            self._closing.wait(self.poll_s)
            return
        msg = np.zeros(1, np.int64)
        self.comm.Recv(msg, source=self.leader, tag=TAG_PROPOSE)
        record = self.guard.freeze(int(msg[0]))
        self.comm.Send(np.array([int(record is not None)], np.int64), dest=self.leader, tag=TAG_VOTE)
        self._wait([self.comm.Irecv(msg, source=self.leader, tag=TAG_DECIDE)])
        if msg[0]:
            self._abandon(record, 0.0)
        elif record is not None:
            self.guard.release()

    def _abandon(self, record: StepRecord, waited: float) -> None:
        log.warning("stop: giving up step %d; committing checkpoint step-%d", record.step + 1, record.step)
        self.abandon(record, waited)
        if self.comm is not None:  # nobody leaves before every rank committed and the leader wrote its record
            self._wait([self.comm.Ibarrier()])
        self.abandoned = record
        log.warning("stop: exiting without finishing step %d", record.step + 1)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit(0)

    def _wait(self, requests: list) -> None:
        from yatt_hpc.comm.transport import wait_all

        wait_all(requests, self.poll_s / 10)
