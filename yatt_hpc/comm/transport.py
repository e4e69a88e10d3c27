"""The data plane: sample batches cross MPI as raw buffers, never as pickled objects.

    send_batch(comm, dest, TAG_SAMPLES, batch)
    batch = recv_batch(comm, source, TAG_SAMPLES)        # source may be MPI.ANY_SOURCE

A `SampleBatch` (`yatt_hpc/batch.py`) is columnar: fixed-schema numpy arrays, ragged token columns
stored flat with a per-sample length column. On the wire a batch is ONE message of raw bytes: an int64
header (sample count + element count of every column) followed by the columns, the layout of
`batch.wire()`; the receiver takes it with one matched probe (`Improbe`: the message and its size),
receives it into a reused buffer (`ReceiveBuffers`) and takes zero-copy column views
(`batch.from_wire`: one slice per ragged column; the per-sample views a buffer kept from its last
message of the same sample count are taken as they are). A batch made by `select`/`concat`/`packed` (every batch
the controllers send) already lies in that layout, so it is sent as one contiguous buffer with no
copy; any other batch is read in place through an MPI datatype over its columns' addresses
(`gather_type`). B5 (bench/wire_throughput.py) measures this path against raw Send/Recv.

Receiving probes without sleeping for at most `SPIN_S` (0.2 ms: a stream's next batch is usually
closer), then polls with sleeps instead of blocking: with more controller ranks than cores, a blocked
Open MPI receive spins and steals the CPU the working rank needs. While a rank sleeps here it is
marked as waiting on peers (`activity.ACTIVITY`), which the health monitor reads. A sender on the same
node rings the receiver's doorbell (`comm/doorbell.py`), which ends its sleep at once; a rank entering
a collective rings the others (`wait_collective`).
The world-wide agreements of a step are not here: `roles/protocol.py` owns them.
"""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from yatt_hpc.batch import COLUMNS as _COLUMNS
from yatt_hpc.batch import DTYPES as _DTYPES
from yatt_hpc.batch import HEADER_WORDS, SampleBatch, WireViews, from_wire, wire_parts
from yatt_hpc.comm.doorbell import DOORBELL
from yatt_hpc.metrics.activity import ACTIVITY

# message tags of the inter-group protocol
TAG_PROMPTS = 11  # trainer -> rollout: prompts to sample
TAG_SAMPLES = 12  # rollout -> genrm: generated samples to score
TAG_SCORED = 13  # genrm -> trainer: scored samples
TAG_WEIGHTS = 14  # trainer -> rollout: weight buckets
TAG_COUNT = 16  # trainer -> genrm: groups to keep, then (rollout rank, samples) pairs of this wave
TAG_STOP = 17  # genrm -> rollout: [owner] target met, drop that replica's remaining work (over-dispatch)
TAG_END = 18  # rollout -> genrm: [owner, samples sent, samples aborted], the answer to one TAG_STOP
TAG_WEIGHTS_DONE = 19  # rollout -> trainer: [tensors] an ipc weight bucket is copied and loaded
TAG_TOOL_CALLS = 20  # rollout -> tools: a request's tool calls, numbered, JSON (agent/tools_group.py)
TAG_TOOL_RESULTS = 21  # tools -> rollout: a request's outcomes with its number, as soon as all are back
TAG_TOOLS_DONE = 22  # rollout -> every tool rank: [rollout group rank] no more calls in this wave
TAG_CODE_RUNS = 23  # rollout -> tools: the code reward's test programs, JSON (agent/tools_group.py)
TAG_CODE_RESULTS = 24  # tools -> rollout: their sandbox runs, JSON, in the programs' order


def pack(batch: SampleBatch) -> np.ndarray:
    """The whole message as one byte buffer: the batch's own `wire()` buffer, else a packed copy."""
    buffer = batch.wire()
    return buffer if buffer is not None else np.concatenate(wire_parts(batch))


def gather_type(parts: list[np.ndarray]):
    """A committed MPI datatype that reads `parts` where they lie (absolute addresses, used with
    MPI.BOTTOM): the message carries the bytes of their concatenation, and nobody concatenates.
    The caller keeps the parts alive until the send completes and frees the type."""
    parts = [p for p in parts if p.nbytes]
    return MPI.BYTE.Create_hindexed([p.nbytes for p in parts], [MPI.Get_address(p) for p in parts]).Commit()


def unpack(buffer: np.ndarray) -> SampleBatch:
    """Inverse of `pack`; the columns are views into `buffer` (no copy)."""
    return from_wire(buffer)


class WireLedger:
    """What the batches this process sent carried, for the step report (`wire/*` metrics): every byte,
    and how many of them were encoded images (the only image data a batch ever holds)."""

    def __init__(self) -> None:
        self.messages = self.batch_bytes = self.image_bytes = 0

    def count(self, batch: SampleBatch, nbytes: int | None = None) -> None:
        """One batch sent; `nbytes` is its size when the caller knows it (the wire buffer's, less the header)."""
        self.messages += 1
        self.batch_bytes += batch.nbytes if nbytes is None else nbytes
        self.image_bytes += int(batch.images.nbytes)

    def take(self) -> dict[str, float]:
        """The counts since the last take (then zero)."""
        out = {"wire_messages": float(self.messages), "wire_batch_bytes": float(self.batch_bytes),
               "wire_image_bytes": float(self.image_bytes)}
        self.__init__()
        return out


LEDGER = WireLedger()


class ReceiveBuffers:
    """Receive buffers taken again once nothing uses them: a fresh buffer per message page-faults its
    memory in during the receive (B5 measured a fresh 39 MiB buffer at half the rate of a reused one).

    A received batch's columns are views of the buffer it came in (`from_wire`), so a buffer is free
    exactly when no view of it is alive, which CPython's reference count says. At most `keep` buffers
    of at most `largest` bytes are kept; bigger messages (image shards) get a buffer of their own, so
    the pool never holds more than keep x largest bytes that nothing uses. Each kept buffer keeps its
    `WireViews` too: its typed views, so a message's columns are one slice each, and the per-sample
    columns of its last message, which the next message of the same sample count takes as they are
    (B5); a buffer whose kept views anything still holds is not free.
    """

    def __init__(self, keep: int = 4, largest: int = 64 << 20) -> None:
        self._buffers: list[np.ndarray] = []
        self._views: list[WireViews] = []  # each buffer's kept views
        self._idle: list[int] = []  # each buffer's reference count while nothing else (nor a kept view) refers to it
        self._keep, self._largest = keep, largest
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of exactly `nbytes` (a view of the smallest free pooled one that fits, if any)."""
        return self.take_typed(nbytes)[0]

    def take_typed(self, nbytes: int) -> tuple[np.ndarray, WireViews | None]:
        """As `take`, with the pooled buffer's `WireViews` for `from_wire` (None: not pooled)."""
        if nbytes > self._largest:
            return np.empty(nbytes, np.uint8), None
        with self._lock:  # one pass, no lists or lambdas: this runs once per received message (B5)
            buffers, views, best, smallest_free = self._buffers, self._views, None, None
            for i in range(len(buffers)):
                # unused: only the pool, getrefcount's argument and the kept views refer to it, and
                # nothing else holds a kept view (tests/unit/test_batch_wire.py)
                if sys.getrefcount(buffers[i]) != self._idle[i] + views[i].refs or views[i].in_use():
                    continue
                size = buffers[i].nbytes
                if size >= nbytes and (best is None or size < buffers[best].nbytes):
                    best = i
                if smallest_free is None or size < buffers[smallest_free].nbytes:
                    smallest_free = i
            if best is not None:
                return buffers[best][:nbytes], views[best]
            fresh = np.empty(nbytes, np.uint8)
            if len(buffers) < self._keep:
                return fresh[:nbytes], self._keep_buffer(len(buffers), fresh)
            if smallest_free is not None:  # too small for this message: its place goes to the new one
                return fresh[:nbytes], self._keep_buffer(smallest_free, fresh)
            return fresh[:nbytes], None

    def _keep_buffer(self, i: int, buffer: np.ndarray) -> WireViews:
        """Keep `buffer` at place `i` (a new one at the end, or in the place of a free one)."""
        before = sys.getrefcount(buffer)
        views = WireViews(buffer)
        # free: the pool's entry, getrefcount's argument and what the typed views add (measured, not assumed)
        idle = 2 + sys.getrefcount(buffer) - before
        if i == len(self._buffers):
            self._buffers.append(buffer)
            self._views.append(views)
            self._idle.append(idle)
        else:
            self._buffers[i], self._views[i], self._idle[i] = buffer, views, idle
        return views

    def __len__(self) -> int:
        return len(self._buffers)


RECEIVE_BUFFERS = ReceiveBuffers()


def send_batch(comm, dest: int, tag: int, batch: SampleBatch) -> None:
    # blocking: MPI progresses the transfer itself instead of waiting for our next poll; the receiver is
    # rung first, so a large (rendezvous) message does not wait for its next poll to be matched
    DOORBELL.ring(comm, dest)
    buffer = batch.wire()
    if buffer is not None:  # already one contiguous message: no datatype, no copy
        LEDGER.count(batch, buffer.nbytes - 8 * HEADER_WORDS)
        comm.Send(buffer, dest=dest, tag=tag)
        return
    LEDGER.count(batch)
    parts = wire_parts(batch)
    dtype = gather_type(parts)
    try:
        comm.Send([MPI.BOTTOM, 1, dtype], dest=dest, tag=tag)
    finally:
        dtype.Free()


def isend_batch(comm, dest: int, tag: int, batch: SampleBatch) -> tuple[list, list]:
    """Non-blocking send of the batch as one contiguous message (its `wire()` buffer, else a packed
    copy); returns (requests, buffers): keep the buffers alive until the requests complete. Never
    read in place through a datatype as `send_batch` can: Open MPI moves a non-contiguous message
    only while we call into it, and a stream polls with sleeps (bench/wire_throughput.py measured
    the in-place Isend 10x slower)."""
    LEDGER.count(batch)
    buffer = pack(batch)
    requests = [comm.Isend(buffer, dest=dest, tag=tag)]
    DOORBELL.ring(comm, dest)
    return requests, [buffer]


def wait_all(requests: list, poll_s: float = 0.002, label: str = "mpi wait") -> None:
    """Wait for MPI requests, backing off from a busy test to short sleeps (never a long stall).
    While it waits, the rank counts as waiting on peers (`activity`), not as stuck itself."""
    if MPI.Request.Testall(requests):
        ACTIVITY.progress()
        return
    with ACTIVITY.waiting(label):
        _sleep_until(lambda: MPI.Request.Testall(requests), poll_s)


def wait_collective(comm, request, poll_s: float = 0.002, label: str = "collective") -> None:
    """`wait_all` for a non-blocking collective just entered on `comm`: the other ranks of the node
    are rung first, so those already waiting in it make their part of its rounds now."""
    DOORBELL.ring_all(comm)
    wait_all([request], poll_s, label)


def _sleep_until(done, poll_s: float) -> None:
    """Call `done` until it is true, sleeping between calls (backing off by 50 us to `poll_s`); a
    doorbell ends a sleep, and then `done` is called without sleeping for `SPIN_S`: the peer that rang
    has just sent, or entered a collective whose next round the others are making now."""
    delay = 0.0
    while not done():
        if delay and DOORBELL.sleep(delay):
            until = time.perf_counter() + SPIN_S
            while not done():
                if time.perf_counter() >= until:
                    break
            else:
                return
            delay = 0.0
        delay = min(poll_s, delay + 0.00005)


def quiet_barrier(comm, label: str = "barrier", poll_s: float = 0.01) -> None:
    """A barrier whose waiting ranks sleep (Ibarrier polled) instead of spinning in MPI.

    Put it before a blocking collective that ranks reach at very different times (start-up, where
    one group's imports end seconds before another's; a resume, while the leader verifies the
    checkpoint): the collective then completes at once, and whoever came first has left the cores
    to whoever is still working. Measured here (4 ranks, 2 cores): a rank blocked 4 s in `bcast`
    burns ~1.5 CPU seconds of it, with `mpi_yield_when_idle` set."""
    wait_collective(comm, comm.Ibarrier(), poll_s, label)


class StreamSender:
    """A bounded queue of in-flight batch sends: `send` waits for the oldest once `max_inflight` are pending.
    `peak_inflight` is the most sends it has had pending (started, not yet waited for) at once."""

    def __init__(self, comm, max_inflight: int, poll_s: float = 0.002):
        self.comm, self.max_inflight, self.poll_s = comm, max_inflight, poll_s
        self._pending: list[tuple[list, list]] = []
        self.peak_inflight = 0

    def send(self, dest: int, tag: int, batch: SampleBatch) -> None:
        while len(self._pending) >= self.max_inflight:
            self._wait_oldest()
        self._pending.append(isend_batch(self.comm, dest, tag, batch))
        self.peak_inflight = max(self.peak_inflight, len(self._pending))

    def has_room(self) -> bool:
        """Whether `send` would start at once (never waits): the sends already done are retired first."""
        while self._pending and MPI.Request.Testall(self._pending[0][0]):
            self._pending.pop(0)
        return len(self._pending) < self.max_inflight

    def drain(self) -> None:
        while self._pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        wait_all(self._pending[0][0], self.poll_s)
        self._pending.pop(0)


def recv_batch(comm, source: int, tag: int, poll_s: float = 0.002) -> tuple[SampleBatch, int]:
    """Receive one batch; returns it with the sender's rank (useful with MPI.ANY_SOURCE).

    One matched probe gives the message and its size at once; it is received into a pooled buffer
    (`RECEIVE_BUFFERS`) and the batch's columns are views of that buffer (`from_wire`)."""
    status = MPI.Status()
    message = _improbe_spinning(comm, source, tag, status, SPIN_S)
    if message is None:  # not close: sleep between probes
        message = wait_for_matched(comm, source, tag, status, poll_s, spin_s=0.0)
    else:
        ACTIVITY.progress()
    buffer, pooled = RECEIVE_BUFFERS.take_typed(status.Get_count(MPI.BYTE))
    message.Recv(buffer)
    return from_wire(buffer, pooled), status.Get_source()


def bcast_batch(comm, batch: SampleBatch | None, root: int = 0) -> SampleBatch:
    """Broadcast a batch from `root` to every rank of `comm` (e.g. a replica's TP peers), as buffers."""
    if comm.Get_size() == 1:
        return batch
    is_root = comm.Get_rank() == root
    header = np.array([len(batch)] + [getattr(batch, c).size for c in _COLUMNS] if is_root else
                      [0] * (1 + len(_COLUMNS)), dtype=np.int64)
    comm.Bcast(header, root=root)
    cols = {}
    for c, size in zip(_COLUMNS, header[1:]):
        cols[c] = (np.ascontiguousarray(getattr(batch, c), dtype=_DTYPES[c]) if is_root
                   else np.empty(int(size), dtype=_DTYPES[c]))
        if size:
            comm.Bcast(cols[c], root=root)
    return batch if is_root else SampleBatch(**cols)


def agree_more(comm, mine: bool, poll_s: float = 0.002) -> bool:
    """Whether any rank wants another sampling wave (collective over `comm`, polled, not spinning)."""
    flag = np.array([1 if mine else 0], dtype=np.int64)
    out = np.zeros(1, dtype=np.int64)
    wait_collective(comm, comm.Iallreduce(flag, out, op=MPI.MAX), poll_s, "agree_more")
    return bool(out[0])


SPIN_S = 0.0002
"""How long a wait probes without sleeping before it starts to sleep. A stream's next batch is
usually closer than this (in B5 it came 20-30 us after the receiver started to wait), and a sleep
costs more than the spin: `time.sleep(50e-6)` returns after ~110 us here. Bounded so that spinning
never takes the core from a working rank for long (module docstring): each wait spins at most once,
so a rank that waits seconds sleeps all but SPIN_S of it, and a rank fed a stream spends at most
SPIN_S of CPU per message on it (2% of a core at 100 batches/s)."""


def wait_for_message(comm, source: int, tag: int, status=None, poll_s: float = 0.002, spin_s: float = SPIN_S) -> None:
    """Block until a matching message is pending: probe without sleeping for `spin_s` (`SPIN_S`),
    then sleep between probes, backing off to `poll_s` (see module docstring)."""
    status = status if status is not None else MPI.Status()
    _poll(lambda: comm.Iprobe(source=source, tag=tag, status=status), f"recv tag {tag}", poll_s, spin_s)


def wait_for_matched(comm, source: int, tag: int, status, poll_s: float = 0.002, spin_s: float = SPIN_S):
    """As `wait_for_message`, but the message is matched (`Improbe`): it is ours to `Recv` whatever
    other threads receive meanwhile, and MPI matches it once, not again at the receive."""
    found = []

    def probe() -> bool:
        message = comm.Improbe(source=source, tag=tag, status=status)
        if message is not None:
            found.append(message)
        return message is not None

    _poll(probe, f"recv tag {tag}", poll_s, spin_s)
    return found[0]


def _improbe_spinning(comm, source: int, tag: int, status, spin_s: float):
    """The matched message, probing without a sleep for up to `spin_s`; None if none came. No
    closure and no activity context: this is `recv_batch`'s hot path (B5)."""
    until = time.perf_counter() + spin_s
    while True:
        message = comm.Improbe(source=source, tag=tag, status=status)
        if message is not None or time.perf_counter() >= until:
            return message


def _poll(probe, label: str, poll_s: float, spin_s: float) -> None:
    """Call `probe` until it is true: at once and then without sleeping for `spin_s`; then, marked as
    waiting on peers (`ACTIVITY`), sleeping between calls, backing off by 50 us to `poll_s`."""
    until = time.perf_counter() + spin_s
    while not probe():
        if time.perf_counter() >= until:
            break
    else:
        ACTIVITY.progress()
        return
    with ACTIVITY.waiting(label):
        _sleep_until(probe, poll_s)


def send_ints(comm, dest: int, tag: int, values) -> None:
    """A small control message (a few int64); eager, so a blocking send never waits on the receiver."""
    comm.Send(np.asarray(values, dtype=np.int64), dest=dest, tag=tag)
    DOORBELL.ring(comm, dest)


def recv_ints(comm, source: int, tag: int, poll_s: float = 0.002) -> tuple[np.ndarray, int]:
    """Receive one `send_ints` message of any length; returns it with the sender's rank."""
    status = MPI.Status()
    wait_for_message(comm, source, tag, status, poll_s)
    out = np.empty(status.Get_count(MPI.INT64_T), dtype=np.int64)
    comm.Recv(out, source=status.Get_source(), tag=tag)
    return out, status.Get_source()


def wait_for_any(comm, tags: list[int], poll_s: float = 0.002, spin_s: float = SPIN_S) -> int:
    """Block until a message with one of `tags` (from anyone) is pending; returns that tag (the
    first of `tags` pending). Spins and sleeps as `wait_for_message`."""
    found = []

    def probe() -> bool:
        for tag in tags:
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag):
                found.append(tag)
                return True
        return False

    _poll(probe, f"recv tags {tags}", poll_s, spin_s)
    return found[0]
