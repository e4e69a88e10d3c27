"""What each rank measures about itself: phase times, samples held, peak RSS.

    stats = RankStats("rollout")
    with stats.phase("rollout"):
        ...
    stats.hold(+len(batch)); ...; stats.hold(-len(batch))
    stats.samples += rows               # a trainer owner's rows of a sample table, sent with the report
    report = stats.step_report()        # small dict the leader gathers once per step

With a timeline path, every phase is also appended as {"step", "phase", "start", "end"} (wall
clock) to RUN_DIR/timeline/rank-NNNN-GROUP.jsonl, the raw material of `yatt-hpc report`'s phase plot.
Once the process has used CUDA, each event also carries `cuda_mb`, the device memory this process
holds when the phase ends: in full colocation a released group must show (nearly) none.

Peak held samples is the proof of the parallel-controller design: no rank ever holds more than
its shard plus what is in flight to it, and the leader is no exception.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def cuda_held_mb() -> float | None:
    """Device memory reserved by this process's caching allocator (MiB); None before CUDA is used."""
    torch = sys.modules.get("torch")  # never import torch (or initialise CUDA) just to measure
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.memory_reserved() / 2**20


class RankStats:
    def __init__(self, group: str, timeline_path: Path | None = None):
        self.group = group
        self.held = 0
        self.peak_held = 0
        self.times: dict[str, float] = {}
        self.values: dict[str, float] = {}
        self.samples: list[dict] = []  # sample-table rows (a few per table), kept through `aside`
        self.step = 0
        self._aside: str | None = None  # the timeline's phase name while numbers are set aside
        self._timeline = open(timeline_path, "a", encoding="utf-8") if timeline_path else None

    def hold(self, delta: int) -> None:
        self.held += delta
        assert self.held >= 0, self.held
        self.peak_held = max(self.peak_held, self.held)

    @contextmanager
    def phase(self, name: str):
        """Time a phase; with a timeline file, also record its wall-clock start and end."""
        start, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
            if self._timeline is not None:
                event = {"step": self.step, "phase": self._aside or name, "start": wall, "end": time.time()}
                held = cuda_held_mb()
                if held is not None:
                    event["cuda_mb"] = held
                self._timeline.write(json.dumps(event) + "\n")

    @contextmanager
    def aside(self, label: str):
        """Work that is not the step's (validation): its phase times and sums are dropped afterwards, so the
        step's metrics stay the training step's; its phases show on the timeline as `label`."""
        times, values = dict(self.times), dict(self.values)
        self._aside = label
        try:
            yield
        finally:
            self._aside = None
            self.times, self.values = times, values

    def add(self, key: str, value: float) -> None:
        self.values[key] = self.values.get(key, 0.0) + float(value)

    def step_report(self) -> dict:
        """This step's numbers (then reset); peaks are kept for the whole run."""
        from yatt_hpc.comm.transport import LEDGER  # here: this module is imported without MPI too

        self.values.update(LEDGER.take())
        report = {"group": self.group, "times": self.times, "values": self.values,
                  "peak_held": self.peak_held, "peak_rss_mb": peak_rss_mb()}
        if self.samples:
            report["samples"] = self.samples
        self.times, self.values, self.samples = {}, {}, []
        self.step += 1
        if self._timeline is not None:
            self._timeline.flush()
        return report
