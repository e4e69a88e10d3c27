"""What a rollout rank streaming finished results (`rollout.streaming`) sends, and when.

    stream = FinishedResults(group_of, n=8, by_sample=False, owner_of=owner_of)   # sample id -> group, owner
    for results in stream.take(new_results, now=time.monotonic(), ended=False):
        send(results)                                               # each a list of finished results

`finished_groups`: a prompt group goes out once all n of its samples have finished.
`finished_samples`: each owner's finished samples go out a group's worth (n) at a time, or once the
first of them has waited `SAMPLE_HOLD_S`, and whatever is left when the engine call ends (one owner
per message: a replica's samples go to its GenRM rank; mixed batches were split into two messages).
A message per sample cost the engine's decode loop ~50 ms of a 0.5 s B4 rollout (the sender shares the engine's
process); the bound keeps the long tail's stragglers from waiting for company. The rollout rank
feeds `take` on the engine's thread as each result comes and wakes its sender only for what is
due, and the sender flushes held samples when it wakes (at least every SAMPLE_HOLD_S / 2), so a
held sample waits at most ~1.5 x SAMPLE_HOLD_S.
"""
from __future__ import annotations

from collections.abc import Callable

SAMPLE_HOLD_S = 0.02


class FinishedResults:
    def __init__(self, group_of: Callable[[int], int], n: int, by_sample: bool, owner_of: Callable[[int], int]):
        self.group_of, self.owner_of, self.n, self.by_sample = group_of, owner_of, n, by_sample
        self.groups: dict[int, list] = {}  # finished_groups: the samples of each group so far
        self.ready: dict[int, list] = {}  # finished_samples: per owner, finished and not sent yet
        self.since: dict[int, float] = {}  # when the first of each owner's `ready` came

    def take(self, results: list, now: float, ended: bool) -> list[list]:
        """Add newly finished results (anything with a `sample_id`); returns what to send now, each
        list of one owner (a message goes to one replica's GenRM). `ended`: the engine call returned,
        nothing more will come."""
        if self.by_sample:
            for result in results:
                owner = self.owner_of(result.sample_id)
                if owner not in self.ready:
                    self.ready[owner], self.since[owner] = [], now
                self.ready[owner].append(result)
            due = [o for o, r in self.ready.items() if ended or len(r) >= self.n or now - self.since[o] >= SAMPLE_HOLD_S]
            for owner in due:
                del self.since[owner]
            return [self.ready.pop(owner) for owner in due]
        out = []
        for result in results:
            group = self.groups.setdefault(self.group_of(result.sample_id), [])
            group.append(result)
            if len(group) == self.n:
                out.append(group)
        return out
