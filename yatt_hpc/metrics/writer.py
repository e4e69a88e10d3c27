"""Where step metrics and sample tables go: JSON lines in the run directory and the configured trackers,
from the leader only.

    metrics = build_metrics(run_dir, is_writer=world.is_leader, settings=TrackerSettings(names=[...], ...))
    metrics.resume_at(step)                              # the checkpoint's step (-1: none); opens the trackers
    metrics.log(step, {"reward/mean": 0.4, ...})
    metrics.log_samples(step, "train", [{"prompt": ..., "response": ..., ...}, ...])
    metrics.close("complete")                            # report.png to every tracker, then each run ends

RUN_DIR/metrics.jsonl (one object per step) and RUN_DIR/samples.jsonl (one object per table) are always
written, fsynced, and cut back to the checkpoint's step on resume; the trackers (`metrics/tracking.py`)
get the same. Every other rank gets `NullMetrics`, which does nothing: ranks never check "am I the
writer?" themselves, never import a tracker's library, and there is no global logger to configure.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from yatt_hpc.metrics.tables import table_of
from yatt_hpc.metrics.tracking import BaseTracker, TrackerFailed, TrackerSettings, TrackerState, TrackerThread, build_trackers

ENDS = {"complete": "complete", "already_complete": "complete", "stopped": "stopped", "requeue": "stopped"}
"""A run's outcome (the step loop's) as the trackers see it: complete, or stopped to be resumed."""


def step_rows(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl for finished training steps (step >= 1), in order: the validation
    before training (its row is step 0) is left out, and so is a line cut by a crash mid-write. [] when
    there is no file yet."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) >= 1:
            rows.append(row)
    return rows


class BaseMetrics:
    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_samples(self, step: int, table: str, samples: list[dict]) -> None:
        """A sample table (`train`, `val/<source>`) of step `step`."""

    def resume_at(self, step: int) -> None:
        """Forget anything logged for steps after `step` (a restart redoes them)."""

    def close(self, outcome: str | None = None) -> None:
        """End: `complete`, `stopped` (to be resumed), None (failed). Closing twice is closing once."""


class NullMetrics(BaseMetrics):
    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        pass


class JsonLines:
    """An append-only JSON-lines file, one object per line with a `step`, fsynced per write."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def read(self) -> list[dict]:
        """Every whole line (a line cut by a crash is left out)."""
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def keep_through(self, step: int) -> None:
        """Drop the lines of steps after `step` (and lines cut by a crash)."""
        self._file.close()
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class RunMetrics(BaseMetrics):
    """RUN_DIR/metrics.jsonl, RUN_DIR/samples.jsonl, and the trackers of `settings`."""

    def __init__(self, run_dir: Path, settings: TrackerSettings | None = None, failed=None,
                 build=build_trackers) -> None:
        self.run_dir = Path(run_dir)
        self.settings = settings or TrackerSettings(names=[], run_dir=self.run_dir)
        self.steps = JsonLines(self.run_dir / "metrics.jsonl")
        self.samples = JsonLines(self.run_dir / "samples.jsonl")
        self.state = TrackerState(self.run_dir)
        # what earlier attempts sent each tracker (read before this attempt sends anything)
        self.sent_before = {name: self.state.logged_through(name) for name in self.settings.names}
        self.failed = failed or TrackerFailed()
        self.build = build  # settings -> trackers (tests hand in their own)
        self.trackers: list[TrackerThread] | None = None  # opened at resume_at (or the first log)
        self.last_step = -1
        self.closed = False

    # ------------------------------------------------------------------ trackers

    def _open(self, resume_step: int) -> None:
        self.trackers = []
        for tracker in self.build(self.settings):
            thread = TrackerThread(tracker, self.failed)
            saved = self.state.get(tracker.name)
            thread.submit("open", lambda t, saved=saved: self._opened(t, resume_step, saved))
            self.trackers.append(thread)

    def _opened(self, tracker: BaseTracker, resume_step: int, saved: dict | None) -> None:
        entry = tracker.open(resume_step, saved)
        self.state.update(tracker.name, **entry)

    def _due(self, thread: TrackerThread, step: int) -> bool:
        """Whether `step` is new to this tracker: a stopped attempt may have sent the step being redone."""
        return thread.tracker.purges_on_resume or step > self.sent_before.get(thread.name, -1)

    def _each(self, what: str, step: int, fn, record: bool = False) -> None:
        if self.trackers is None:
            self._open(-1)
        for thread in self.trackers:
            if self._due(thread, step):
                after = (lambda name=thread.name: self.state.update(name, logged_through=step)) if record else None
                thread.submit(what, fn, after)

    # ------------------------------------------------------------------ the interface

    def resume_at(self, step: int) -> None:
        self.steps.keep_through(step)
        self.samples.keep_through(step)
        if self.trackers is None:
            self._open(step)
        self._catch_up(step)

    def _catch_up(self, step: int) -> None:
        """Send a tracker the steps up to the checkpoint that it had not taken when the last attempt ended
        (still queued at a kill): the resume will not redo them, and metrics.jsonl holds them."""
        behind = [t for t in self.trackers if not t.tracker.purges_on_resume and self.sent_before.get(t.name, -1) < step]
        if not behind:
            return
        start = min(self.sent_before.get(t.name, -1) for t in behind)
        tables = [r for r in self.samples.read() if start < r["step"] <= step]
        for row in self.steps.read():
            if not start < row["step"] <= step:
                continue
            s, scalars = row["step"], {k: v for k, v in row.items() if k != "step"}
            for table in (t for t in tables if t["step"] == s):
                columns, rows = table_of(table["rows"])
                for thread in behind:
                    if s > self.sent_before.get(thread.name, -1):
                        thread.submit(f"sample table {table['table']} of step {s}",
                                      lambda t, c=columns, r=rows, s=s, n=table["table"]: t.log_table(s, n, c, r))
            for thread in behind:
                if s > self.sent_before.get(thread.name, -1):
                    thread.submit(f"step {s}", lambda t, s=s, v=scalars: t.log(s, v),
                                  lambda name=thread.name, s=s: self.state.update(name, logged_through=s))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in sorted(scalars.items()) if v is not None and math.isfinite(float(v))}
        self._each(f"step {step}", step, lambda t: t.log(step, clean), record=True)
        self.steps.write({"step": step, **clean})
        self.last_step = max(self.last_step, step)

    def log_samples(self, step: int, table: str, samples: list[dict]) -> None:
        if not samples:
            return
        columns, rows = table_of(samples)
        self._each(f"sample table {table} of step {step}", step, lambda t: t.log_table(step, table, columns, rows))
        self.samples.write({"step": step, "table": table, "rows": samples})

    def close(self, outcome: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        outcome = ENDS.get(outcome) if outcome is not None else None
        if self.trackers and outcome == "complete" and self.last_step >= 0:
            self._send_report()
        for thread in self.trackers or []:
            thread.close(outcome)
        self.steps.close()
        self.samples.close()

    def _send_report(self) -> None:
        from yatt_hpc.metrics.report import ReportError, write_report

        try:
            path = write_report(self.run_dir)
        except (ReportError, OSError, ValueError) as err:
            self.failed("report", "report.png", err)
            return
        step = self.last_step
        for thread in self.trackers:
            thread.submit("report.png", lambda t: t.log_image(step, "report", path))


def build_metrics(run_dir: Path, *, is_writer: bool, settings: TrackerSettings | None = None) -> BaseMetrics:
    return RunMetrics(run_dir, settings) if is_writer else NullMetrics()
