"""Doorbells: a rank waiting for its peers sleeps until one on its node rings, not until its next poll.

    DOORBELL.open(world_comm, nonce)      # once per rank, after MPI init (runtime/worker.py)
    DOORBELL.ring(comm, dest)             # after a send to `dest` (comm/transport.py does it)
    DOORBELL.ring_all(comm)               # on entering a collective of `comm`
    woken = DOORBELL.sleep(delay)         # instead of time.sleep in a polled wait: True if rung

Why: waiting ranks never block in MPI (a blocked Open MPI call spins and takes the core a working
rank needs, `transport.py`); they probe, then sleep, backing off to `poll_s` (2 ms). So every
hand-off of a step (prompts out, samples to GenRM, scores back, the phase gates of colocation, the
weights, the step report) waited for the receiver's next poll: up to 2 ms each, and a polled
collective needs a poll per round. On the demo that was ~10% of a 0.17 s step; polling every
0.2 ms instead bought it back but cost the compute-heavy B9 shape ~10% (waiting ranks waking 5000
times a second). A doorbell is both: the sleeper sleeps in `select` on its own socket, and the
peer that sends, or enters a collective, writes one byte to it.

Each rank binds an abstract Unix datagram socket (no file; named by a nonce of the launch and the
world rank) and knows the sockets of the ranks on its node (`COMM_TYPE_SHARED`). Ringing is one
non-blocking `sendto` per peer; a full socket means it is already rung. A bell only shortens a wait:
a waiter still wakes after `poll_s` without one, so a rank on another node (no bell), a bell missed
by a second waiting thread of the same process, or a socket that could not be bound (then
`enabled` is False and `sleep` is `time.sleep`) cost latency, never progress.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import time

log = logging.getLogger(__name__)


class Doorbell:
    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._addresses: dict[int, bytes] = {}  # world rank -> its socket, for the other ranks of this node
        self._world = None
        self.rung = 0  # sleeps a bell ended (for tests and profiles)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def open(self, world_comm, nonce: str) -> None:
        """Bind this rank's socket and learn its node's peers. Collective over `world_comm`."""
        from mpi4py import MPI

        rank = world_comm.Get_rank()
        node = world_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            local = node.allgather(rank)
        finally:
            node.Free()
        name = f"\0yatt-{nonce}-{{}}".format
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(name(rank).encode())
            sock.setblocking(False)
        except OSError as err:  # then no rank rings: every wait polls, as without doorbells
            log.warning("doorbell: no socket (%s); waits poll only", err)
            if sock is not None:
                sock.close()
            sock = None
        if not world_comm.allreduce(int(sock is not None), op=MPI.MIN):  # all bound before anyone rings
            if sock is not None:
                sock.close()
            return
        self._sock, self._world = sock, world_comm
        self._addresses = {r: name(r).encode() for r in local if r != rank}

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._addresses = None, {}

    def ring(self, comm, dest: int) -> None:
        """Wake rank `dest` of `comm` if it waits on this node."""
        if self._sock is not None and self._addresses:
            self._ring_world(_world_ranks(comm, [dest], self._world))

    def ring_all(self, comm) -> None:
        """Wake every other rank of `comm` on this node."""
        if self._sock is not None and self._addresses:
            self._ring_world(_world_ranks(comm, range(comm.Get_size()), self._world))

    def _ring_world(self, ranks) -> None:
        sock, addresses = self._sock, self._addresses
        for r in ranks:
            address = addresses.get(r)
            if address is None or sock is None:
                continue
            with contextlib.suppress(OSError):  # full (already rung), closed here or by the peer at the end
                sock.sendto(b"\1", address)

    def sleep(self, timeout: float) -> bool:
        """Sleep up to `timeout` s; True if a peer rang (the bell is cleared)."""
        sock = self._sock  # one read: `close` may run on another thread at the end of the run
        if sock is None:
            time.sleep(timeout)
            return False
        try:
            ready, _, _ = select.select([sock], [], [], timeout)
        except (OSError, ValueError):  # closed meanwhile: the run is ending; wait as without a bell
            time.sleep(timeout)
            return False
        if not ready:
            return False
        try:
            while sock.recv(64):
                pass
        except OSError:  # drained (BlockingIOError), or closed by another thread at the end
            pass
        self.rung += 1
        return True


def _world_ranks(comm, ranks, world) -> list[int]:
    """`ranks` of `comm` as ranks of the world (bell addresses are by world rank)."""
    from mpi4py import MPI

    if comm is world or comm == MPI.COMM_WORLD:
        return list(ranks)
    group, world_group = comm.Get_group(), world.Get_group()
    try:
        return [r for r in MPI.Group.Translate_ranks(group, list(ranks), world_group) if r != MPI.UNDEFINED]
    finally:
        group.Free()
        world_group.Free()


DOORBELL = Doorbell()
"""The process's doorbell (one socket per rank, shared by its threads)."""

__all__ = ["DOORBELL", "Doorbell"]


def launch_nonce() -> str:
    """A name part unique to this launch (rank 0 draws it; `open` callers broadcast it)."""
    return os.urandom(6).hex()
