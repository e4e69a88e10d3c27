"""What a rollout rank streaming finished results (`rollout.streaming`) sends, and when.

    stream = FinishedResults(group_of, n=8, by_sample=False)      # group_of: sample id -> prompt group
    for results in stream.take(new_results, now=time.monotonic(), ended=False):
        send(results)                                               # each a list of finished results

`finished_groups`: a prompt group goes out once all n of its samples have finished.
`finished_samples`: finished samples go out a group's worth (n) at a time, or once the first of
them has waited `SAMPLE_HOLD_S`, and whatever is left when the engine call ends. A message per
sample cost the engine's decode loop ~50 ms of a 0.5 s B4 rollout (the sender shares the engine's
process); the bound keeps the long tail's stragglers from waiting for company. The rollout rank
feeds `take` on the engine's thread as each result comes and wakes its sender only for what is
due, and the sender flushes held samples when it wakes (at least every SAMPLE_HOLD_S / 2), so a
held sample waits at most ~1.5 x SAMPLE_HOLD_S.
"""
from __future__ import annotations

from collections.abc import Callable

SAMPLE_HOLD_S = 0.02


class FinishedResults:
    def __init__(self, group_of: Callable[[int], int], n: int, by_sample: bool):
        self.group_of, self.n, self.by_sample = group_of, n, by_sample
        self.groups: dict[int, list] = {}  # finished_groups: the samples of each group so far
        self.ready: list = []  # finished_samples: finished, not sent yet
        self.since = 0.0  # when the first of `ready` came

    def take(self, results: list, now: float, ended: bool) -> list[list]:
        """Add newly finished results (anything with a `sample_id`); returns what to send now.
        `ended`: the engine call returned, nothing more will come."""
        if self.by_sample:
            if not self.ready:
                self.since = now
            self.ready += results
            if self.ready and (ended or len(self.ready) >= self.n or now - self.since >= SAMPLE_HOLD_S):
                out, self.ready = [self.ready], []
                return out
            return []
        out = []
        for result in results:
            group = self.groups.setdefault(self.group_of(result.sample_id), [])
            group.append(result)
            if len(group) == self.n:
                out.append(group)
        return out
