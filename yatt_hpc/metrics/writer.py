"""Where step metrics go: TensorBoard event files plus one JSON line per step, on the leader only.

    metrics = build_metrics(run_dir, is_writer=world.is_leader, tensorboard=cfg.logging.tensorboard)
    metrics.log(step, {"reward/mean": 0.4, ...})
    metrics.close()

Every other rank gets `NullMetrics`, which does nothing: ranks never check "am I the writer?"
themselves, and there is no global logger to configure.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path


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

    def resume_at(self, step: int) -> None:
        """Forget anything logged for steps after `step` (a restart redoes them)."""

    def close(self) -> None:
        pass


class NullMetrics(BaseMetrics):
    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        pass


class RunMetrics(BaseMetrics):
    """TensorBoard scalars under RUN_DIR/tb and RUN_DIR/metrics.jsonl (one object per step)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self._path = self.run_dir / "metrics.jsonl"
        self._jsonl = open(self._path, "a", encoding="utf-8")
        self._tensorboard = tensorboard
        self._purge_step: int | None = None
        self._tb = None

    def resume_at(self, step: int) -> None:
        # metrics.jsonl keeps steps <= step; TensorBoard drops newer events via purge_step
        self._jsonl.close()
        kept = []
        if self._path.exists():
            for line in self._path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    continue
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self._path)
        self._jsonl = open(self._path, "a", encoding="utf-8")
        self._purge_step = step + 1

    def _writer(self):
        if self._tb is None and self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), flush_secs=5, purge_step=self._purge_step)
        return self._tb

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in sorted(scalars.items()) if v is not None and math.isfinite(float(v))}
        if self._writer() is not None:
            for tag, value in clean.items():
                self._tb.add_scalar(tag, value, global_step=step)
            self._tb.flush()
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        os.fsync(self._jsonl.fileno())

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._jsonl.closed:
            self._jsonl.close()


def build_metrics(run_dir: Path, *, is_writer: bool, tensorboard: bool = True) -> BaseMetrics:
    return RunMetrics(run_dir, tensorboard) if is_writer else NullMetrics()
