"""What a rollout rank streaming finished results (`rollout.streaming`) sends, and when.

    stream = FinishedResults(group_of, n=8, by_sample=False, dest_of=dest_of,   # sample id -> group, GenRM rank
                             expected={genrm_rank: samples_of_the_call_bound_there})
    for results in stream.take(new_results, now=time.monotonic(), ended=False):
        send(results)                                               # each a list of finished results

`finished_groups`: a prompt group goes out once all n of its samples have finished.
`finished_samples`: the finished samples bound for one GenRM rank go out a group's worth (n) at a
time, or once the first of them has waited `SAMPLE_HOLD_S`, or at once when the rest of the wave
bound for that rank (`expected`, less those already finished) could no longer make up a group's
worth with them: in the long tail the hold would only keep the judge idle while the last rows
decode (B4's last message held up to six samples, 23 ms of judging after the rollout ended; the
judge's time after the rollout fell ~2 ms a step, within B4's noise); and whatever is left when the
engine call ends. A message goes to one GenRM rank and may hold samples of every replica that rank
scores (one batch and one hold clock per destination: a batch per replica doubled B4's messages, and its
last two went to the judge as two calls after the rollout ended).
A message per sample cost the engine's decode loop ~50 ms of a 0.5 s B4 rollout (the sender shares the engine's
process); the bound keeps the long tail's stragglers from waiting for company. The rollout rank
feeds `take` on the engine's thread once per decode step with the results that finished at it
(`roles/rollout.py`): rows finishing together go in one message (fed one by one, the last capped
rows of a wave went as one message each, each its own judge call after the rollout ended), and a
held sample waits at most SAMPLE_HOLD_S plus one decode step.
"""
from __future__ import annotations

from collections.abc import Callable

SAMPLE_HOLD_S = 0.02


class FinishedResults:
    def __init__(self, group_of: Callable[[int], int], n: int, by_sample: bool, dest_of: Callable[[int], int],
                 expected: dict[int, int] | None = None):
        self.group_of, self.dest_of, self.n, self.by_sample = group_of, dest_of, n, by_sample
        self.to_come = dict(expected or {})  # per destination: results not finished yet (unknown: never short)
        self.groups: dict[int, list] = {}  # finished_groups: the samples of each group so far
        self.ready: dict[int, list] = {}  # finished_samples: per destination, finished and not sent yet
        self.since: dict[int, float] = {}  # when the first of each destination's `ready` came

    def take(self, results: list, now: float, ended: bool) -> list[list]:
        """Add newly finished results (anything with a `sample_id`); returns what to send now, each
        list bound for one destination (`dest_of`). `ended`: the engine call returned, nothing more
        will come."""
        if self.by_sample:
            for result in results:
                dest = self.dest_of(result.sample_id)
                if dest not in self.ready:
                    self.ready[dest], self.since[dest] = [], now
                self.ready[dest].append(result)
                if dest in self.to_come:
                    self.to_come[dest] -= 1
            if not self.ready:
                return []
            due = [d for d, r in self.ready.items() if ended or len(r) + self.to_come.get(d, self.n) < self.n
                   or len(r) >= self.n or now - self.since[d] >= SAMPLE_HOLD_S]
            for dest in due:
                del self.since[dest]
            return [self.ready.pop(dest) for dest in due]
        out = []
        for result in results:
            group = self.groups.setdefault(self.group_of(result.sample_id), [])
            group.append(result)
            if len(group) == self.n:
                out.append(group)
        return out
