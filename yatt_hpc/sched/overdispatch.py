"""Long-tail control (`rollout.over_dispatch_ratio`): the pure bookkeeping, no MPI.

    queue = PromptQueue(stride=dp, offset=d)
    positions, reused = queue.take(dispatch_count(k, ratio))   # returned prompts first, then fresh ones
    queue.give_back(unused_positions)                           # to the FRONT: next dispatch takes them first

    wave = ReplicaWave(keep=k, n=n, expected={rank: samples}, handshake=ratio > 1)   # on GenRM
    if wave.on_samples(rank, count): score(batch.select(wave.wanted(batch.prompt_id))); wave.on_scored(groups)
    wave.should_stop(); wave.target_reached; wave.kept(); wave.on_end(rank, sent); wave.finished

    work = RolloutWork(owners, prompt_ids, chunk_groups)                             # on a rollout rank
    idx = work.next_chunk(); work.mark_sent(owner, count); aborted = work.stop(owner)

A replica that needs k groups dispatches ceil(k x ratio). Its GenRM rank scores whole groups as
they stream in; once k are scored it sends STOP to every rollout rank holding the replica's work
and the k kept groups (lowest prompt ids among those scored) to the owner. A rollout rank that gets
STOP drops the replica's groups not sent yet (aborting the engine when the whole in-flight chunk is
dropped) and answers END with how many samples it sent, so GenRM knows how many are still in
flight and the next wave never sees a stale one. The owner puts every dispatched position it did
not get back scored at the front of its queue: each prompt is consumed exactly once.
With ratio 1.0 there is no handshake; GenRM waits for the counted samples, as before.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np


def dispatch_count(keep: int, ratio: float) -> int:
    """Groups to dispatch for `keep` needed: ceil(keep x ratio) (rounded first: 4 x 1.1 is not 4.4000001)."""
    return math.ceil(round(keep * ratio, 9))


class PromptQueue:
    """One replica's prompt stream: positions base + j*stride + offset, returned ones first (FRONT, ascending).
    `base` is 0 unless a checkpoint of another data-parallel layout was resumed (`relayout_positions`)."""

    def __init__(self, stride: int, offset: int, base: int = 0):
        self.stride, self.offset, self.base = stride, offset, base
        self.next_index = 0  # fresh positions handed out so far
        self.returned: deque[int] = deque()

    def take(self, count: int) -> tuple[np.ndarray, int]:
        """The next `count` positions and how many of them are reused (returned earlier)."""
        reused = [self.returned.popleft() for _ in range(min(count, len(self.returned)))]
        fresh = np.arange(self.next_index, self.next_index + count - len(reused), dtype=np.int64)
        self.next_index += len(fresh)
        return (np.concatenate([np.array(reused, np.int64), self.base + fresh * self.stride + self.offset]),
                len(reused))

    def give_back(self, positions) -> None:
        for p in sorted((int(p) for p in positions), reverse=True):
            rel = p - self.base
            assert p < self.base or (rel % self.stride == self.offset and rel // self.stride < self.next_index), p
            self.returned.appendleft(p)

    def state(self) -> dict:
        return {"next_index": self.next_index, "returned": list(self.returned), "base": self.base}

    def load_state(self, next_index: int, returned=(), base: int = 0) -> None:
        self.next_index, self.base = int(next_index), int(base)
        self.returned = deque(int(p) for p in returned)


def relayout_positions(saved: list[dict], dp: int) -> list[dict]:
    """Data positions for `dp` replicas continuing the prompt stream `saved` replicas left (each a
    `PromptQueue.state()`, in replica order). Every position not consumed yet is consumed exactly once,
    the oldest first: those below the new base (a replica's returned prompts, and those a replica
    behind the others had not reached) are dealt out in ascending order as returned prompts; fresh
    positions continue from the first one no old replica reached. With equal progress and nothing
    returned, the replicas' next prompts together are the old layout's next prompts."""
    old = len(saved)
    reached = max(int(s["next_index"]) for s in saved)
    pending: list[int] = []
    for d, s in enumerate(saved):
        base = int(s.get("base", 0))
        pending += [int(p) for p in s.get("returned", ())]
        pending += [base + j * old + d for j in range(int(s["next_index"]), reached)]
    new_base = max(int(s.get("base", 0)) for s in saved) + reached * old
    pending.sort()
    return [{"next_index": 0, "returned": pending[r::dp], "base": new_base} for r in range(dp)]


def keep_lowest(groups, keep: int) -> tuple[list[int], list[int]]:
    """(kept, surplus): the `keep` lowest group ids, deterministic whatever the arrival order."""
    ordered = sorted(int(g) for g in groups)
    return ordered[:keep], ordered[keep:]


@dataclass
class ReplicaWave:
    """GenRM's view of one trainer replica's samples in one wave.

    `expected` maps each rollout rank that got work from the replica to its sample count. Without
    the handshake the wave ends when all of them arrived; with it, once STOP went to every such
    rank, each answered END(sent), and exactly `sent` samples arrived from it.
    """

    keep: int
    n: int
    expected: dict[int, int]
    handshake: bool
    received: dict[int, int] = field(default_factory=dict)
    ended: dict[int, int] = field(default_factory=dict)
    scored_groups: set[int] = field(default_factory=set)  # every sample scored
    scored_samples: dict[int, int] = field(default_factory=dict)  # samples scored per group begun
    stopped: bool = False
    delivered: bool = False

    def __post_init__(self) -> None:
        self.expected = {r: c for r, c in self.expected.items() if c > 0}
        total = sum(self.expected.values())
        assert total % self.n == 0 and self.keep * self.n <= total, (self.keep, total)
        if not self.handshake:
            assert self.keep * self.n == total, "without over-dispatch every group is kept"

    def on_samples(self, rank: int, count: int) -> bool:
        """Count samples from `rank`; True when they should be scored (target not met yet)."""
        self.received[rank] = self.received.get(rank, 0) + count
        assert self.received[rank] <= self.expected.get(rank, 0), (rank, self.received[rank], self.expected)
        return not self.target_reached

    def wanted(self, prompt_ids: np.ndarray) -> np.ndarray:
        """Indices of the samples worth scoring: every sample of a group begun already (streamed by
        sample), then the lowest new groups, as many as the target still needs."""
        open_groups = np.array(sorted(set(self.scored_samples) - self.scored_groups), dtype=np.int64)
        fresh = np.setdiff1d(np.unique(prompt_ids), open_groups)[: max(self.keep - len(self.scored_samples), 0)]
        return np.flatnonzero(np.isin(prompt_ids, open_groups) | np.isin(prompt_ids, fresh))

    def on_scored(self, prompt_ids) -> None:
        """One prompt id per scored sample; a group counts as scored once all n of its samples are."""
        groups, counts = np.unique(np.asarray(prompt_ids, dtype=np.int64), return_counts=True)
        for g, c in zip(groups.tolist(), counts.tolist()):
            self.scored_samples[g] = self.scored_samples.get(g, 0) + c
            assert self.scored_samples[g] <= self.n, (g, self.scored_samples[g], self.n)
            if self.scored_samples[g] == self.n:
                self.scored_groups.add(g)

    @property
    def target_reached(self) -> bool:
        return len(self.scored_groups) >= self.keep

    def kept(self) -> list[int]:
        return keep_lowest(self.scored_groups, self.keep)[0]

    def should_stop(self) -> bool:
        """Send STOP now (once): handshake on, target reached, not sent yet."""
        return self.handshake and self.target_reached and not self.stopped

    def stop_targets(self) -> list[int]:
        self.stopped = True
        return sorted(self.expected)

    def on_end(self, rank: int, sent: int) -> None:
        assert self.stopped and rank in self.expected and rank not in self.ended, (rank, self.ended)
        assert sent <= self.expected[rank], (rank, sent)
        self.ended[rank] = sent

    @property
    def finished(self) -> bool:
        if not self.handshake:
            return self.received == self.expected
        return (self.stopped and self.ended.keys() == self.expected.keys()
                and all(self.received.get(r, 0) == s for r, s in self.ended.items()))


class RolloutWork:
    """A rollout rank's samples of one wave as whole groups, in sample-id order, minus stopped owners."""

    def __init__(self, owners: np.ndarray, prompt_ids: np.ndarray, chunk_groups: int):
        self.owners, self.prompt_ids, self.chunk_groups = np.asarray(owners), np.asarray(prompt_ids), chunk_groups
        starts = np.flatnonzero(np.r_[True, self.prompt_ids[1:] != self.prompt_ids[:-1]]) if len(owners) else []
        self.groups = [(int(s), int(e)) for s, e in zip(starts, [*starts[1:], len(owners)])]
        self.assigned = {int(o): int((self.owners == o).sum()) for o in np.unique(self.owners)}
        self.sent = {o: 0 for o in self.assigned}
        self.stopped: set[int] = set()
        self._cursor = 0

    def next_chunk(self) -> np.ndarray | None:
        """Sample indices of the next `chunk_groups` groups of owners not stopped, or None when done."""
        picked = []
        while self._cursor < len(self.groups) and len(picked) < self.chunk_groups:
            start, stop = self.groups[self._cursor]
            self._cursor += 1
            if int(self.owners[start]) not in self.stopped:
                picked.append(np.arange(start, stop))
        return np.concatenate(picked) if picked else None

    def mark_sent(self, owner: int, count: int) -> None:
        assert owner not in self.stopped
        self.sent[owner] += count

    def stop(self, owner: int) -> int:
        """Drop the owner's samples not sent yet; returns how many (the aborted ones)."""
        assert owner in self.assigned and owner not in self.stopped, (owner, self.stopped)
        self.stopped.add(owner)
        return self.assigned[owner] - self.sent[owner]

    def awaiting_stop(self) -> list[int]:
        return sorted(o for o in self.assigned if o not in self.stopped)
