"""Notice a rank that stops answering, or a world that stopped moving, and end the job naming the rank.

    monitor = HealthMonitor.build(world, heartbeat_s=5, stall_timeout_s=120, run_dir=RUN_DIR)  # collective
    ...                                                  # the step loop runs; ACTIVITY is marked
    monitor.close()                                      # collective (None when disabled)

One thread per rank, over its own duplicate of the world communicator (never the data plane):

    every rank  --beat [seq, progress count, waiting?, done?, label]-->  leader (world rank 0)
    leader      --beat ----------------------------------------------->  every rank

A beat is sent every `heartbeat_s` by the monitor thread, whatever the loop thread is doing, and
carries what the loop thread last marked in `activity.ACTIVITY`. The leader applies `find_stall`:

  * **silent**: no beat from a rank for `stall_timeout_s`: the process is stopped (SIGSTOP), frozen,
    or stuck in a call that holds the interpreter lock. The others notice the leader the same way.
  * **stuck**: no rank made progress for `stall_timeout_s`. If some rank is busy (not waiting on
    peers) it is named: the one whose progress stopped first (a hung engine or library call). If
    every rank waits on peers it is a deadlock: the rank that has waited longest is named, with
    what each rank waits in.

Then the noticing rank logs it, writes `RUN_DIR/logs/stall_<job>_<restart>.json`, prints the
worker's failure line naming the stalled group and rank (the launchers pick it up as the first
failure) and aborts the MPI world (exit code 3): the job ends as for a crash, the last committed
checkpoint is intact, and the requeue/resubmit path resumes from it.

Progress points: every MPI wait in `wire` (its end), step boundaries, each decode step of the HF
engine, each trainer micro-batch, each weight bucket and checkpoint file. An SGLang `generate` is
one call: keep `health.stall_timeout_s` above the longest one, or set it to null.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from yatt_hpc.metrics.activity import ACTIVITY, Activity
from yatt_hpc.sched.stall import RankView, Stall, find_stall

log = logging.getLogger(__name__)
TAG_BEAT = 11
EXIT_STALLED = 3
_LABEL_WORDS = 8  # int64 words of label text in a beat
_BEAT_WORDS = 4 + _LABEL_WORDS


def encode_beat(seq: int, activity: Activity) -> np.ndarray:
    beat = np.zeros(_BEAT_WORDS, np.int64)
    beat[:4] = (seq, activity.count, int(activity.is_waiting), int(activity.done))
    text = activity.label.encode("utf-8", "replace")[: 8 * _LABEL_WORDS].ljust(8 * _LABEL_WORDS, b"\0")
    beat[4:] = np.frombuffer(text, np.int64)
    return beat


def decode_label(beat: np.ndarray) -> str:
    return beat[4:].tobytes().rstrip(b"\0").decode("utf-8", "replace")


class HealthMonitor:
    """The heartbeat thread of one rank. `on_stall(stall)` ends the job (tests pass their own)."""

    def __init__(self, comm, heartbeat_s: float, stall_timeout_s: float,
                 on_stall: Callable[[Stall], None], *, activity: Activity = ACTIVITY, leader: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.comm, self.heartbeat_s, self.timeout_s = comm, heartbeat_s, stall_timeout_s
        self.on_stall, self.activity, self.leader, self.clock = on_stall, activity, leader, clock
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        now = clock()
        peers = range(self.size) if self.rank == leader else [leader]
        self.views = {r: RankView(now, now) for r in peers}
        self.stall: Stall | None = None
        self._sends: list = []
        self._seq = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._main, name="health-monitor", daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, world, heartbeat_s: float, stall_timeout_s: float | None, run_dir: Path | None = None,
              job_tag: str = "local_0", **kw) -> HealthMonitor | None:
        """Collective over the world. None when disabled or MPI lacks THREAD_MULTIPLE (said on the leader)."""
        from mpi4py import MPI

        if stall_timeout_s is None or world.comm.Get_size() == 1:
            return None
        threads_ok = world.comm.allreduce(int(MPI.Query_thread() == MPI.THREAD_MULTIPLE), op=MPI.MIN)
        if not threads_ok:
            if world.is_leader:
                log.warning("health.stall_timeout_s needs MPI THREAD_MULTIPLE (level %d here): a stalled rank is "
                            "not detected", MPI.Query_thread())
            return None
        on_stall = kw.pop("on_stall", None) or _abort_world(world, run_dir, job_tag)
        return cls(world.comm.Dup(), heartbeat_s, stall_timeout_s, on_stall, **kw)

    def close(self) -> None:
        """Collective: keep beating until every rank is here, then stop the thread."""
        from yatt_hpc.comm.transport import wait_all

        self.activity.done = True
        wait_all([self.comm.Ibarrier()], 0.01)
        self._closing.set()
        self._thread.join()
        wait_all([self.comm.Ibarrier()], 0.01)  # no beat is sent any more: drain what arrived, then free
        self._receive()
        if all(req.Test() for req in self._sends):
            self.comm.Free()

    # ------------------------------------------------------------------ the thread

    def _main(self) -> None:
        try:
            next_beat = self.clock()
            while not self._closing.is_set():
                now = self.clock()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + self.heartbeat_s
                self._receive()
                stall = self._check(self.clock())
                if stall is not None:
                    self.stall = stall
                    self.on_stall(stall)
                    return
                self._closing.wait(min(0.2, self.heartbeat_s / 4))
        except BaseException:  # noqa: BLE001 - the worker's failure policy: a broken monitor takes the world down
            log.exception("health monitor failed")
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)

    def _beat(self) -> None:
        self._seq += 1
        beat = encode_beat(self._seq, self.activity)
        targets = [r for r in range(self.size) if r != self.rank] if self.rank == self.leader else [self.leader]
        self._sends = [req for req in self._sends if not req.Test()]
        for r in targets:
            self._sends.append(self.comm.Isend(beat, dest=r, tag=TAG_BEAT))

    def _receive(self) -> None:
        from mpi4py import MPI

        status, beat = MPI.Status(), np.zeros(_BEAT_WORDS, np.int64)
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_BEAT, status=status):
            self.comm.Recv(beat, source=status.Get_source(), tag=TAG_BEAT)
            self._saw(status.Get_source(), int(beat[1]), bool(beat[2]), bool(beat[3]), decode_label(beat))

    def _saw(self, rank: int, count: int, waiting: bool, done: bool, label: str) -> None:
        view = self.views.get(rank)
        if view is None:
            return
        now = self.clock()
        view.last_heard = now
        if count != view.count:
            view.count, view.last_progress = count, now
        view.waiting, view.done, view.label = waiting, done, label

    def _check(self, now: float) -> Stall | None:
        if self.rank != self.leader:
            view = self.views[self.leader]
            if now - view.last_heard > self.timeout_s:
                return Stall(self.leader, "silent", now - view.last_heard,
                             f"no heartbeat from the leader for {now - view.last_heard:.0f}s (last seen in "
                             f"'{view.label}'): the process is stopped, frozen, or holds the interpreter lock")
            return None
        a = self.activity
        self._saw(self.rank, a.count, a.is_waiting, a.done, a.label)  # the leader's own loop thread
        return find_stall(now, self.views, self.timeout_s)


def stall_record_name(job_tag: str) -> str:
    return f"stall_{job_tag}.json"


def _abort_world(world, run_dir: Path | None, job_tag: str) -> Callable[[Stall], None]:
    def act(stall: Stall) -> None:
        from mpi4py import MPI

        group = world.plan.group_of(stall.rank)
        text = f"stalled ({stall.kind}): {stall.cause}; noticed by world rank {world.rank}"
        log.error("%s rank %d %s", group, stall.rank, text)
        if run_dir is not None:
            record = {**asdict(stall), "group": group, "noticed_by": world.rank, "time": time.time()}
            try:
                (run_dir / "logs" / stall_record_name(job_tag)).write_text(json.dumps(record) + "\n")
            except OSError as err:
                log.error("could not write the stall record: %s", err)
        print(f"yatt-hpc [{group} rank {stall.rank}] failed: {text}", file=sys.stderr, flush=True)
        for handler in logging.getLogger().handlers:
            handler.flush()
        MPI.COMM_WORLD.Abort(EXIT_STALLED)

    return act
