"""The step loop every rank runs, whatever its group, and the leader's per-step review.

    StepLoop(world, cfg, controller, stats, metrics, console).run()

Each step: the leader decides (continue/stop) and broadcasts one int; every rank runs its
controller's step; every rank sends a small report (times, sums, peaks: no samples) to the leader,
which turns them into the run's metrics and the progress line. The leader holds decisions and
numbers, never the batch.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from yatt_hpc.control.summary import step_scalars

CONTINUE, STOP = 1, 0


class StepLoop:
    def __init__(self, world, cfg, controller, stats, metrics, console=None, run_dir: Path | None = None):
        self.world, self.cfg, self.controller, self.stats = world, cfg, controller, stats
        self.metrics, self.console, self.run_dir = metrics, console, run_dir
        self.history: list[dict] = []

    def decide(self, step: int) -> int:
        """Leader only: whether to run `step` (later: stop/requeue on signals)."""
        return CONTINUE if step < self.cfg.train.steps else STOP

    def run(self, start_step: int = 0) -> None:
        step = start_step
        started = time.perf_counter()
        while True:
            decision = np.array([self.decide(step) if self.world.is_leader else 0], dtype=np.int64)
            self.world.comm.Bcast(decision, root=0)
            if decision[0] == STOP:
                break
            t0 = time.perf_counter()
            self.controller.step(step)
            elapsed = time.perf_counter() - t0
            reports = self.world.comm.gather(self.stats.step_report(), root=0)
            if self.world.is_leader:
                self.review(step, elapsed, reports)
            step += 1
        if self.world.is_leader:
            self.finish(time.perf_counter() - started)

    def review(self, step: int, elapsed: float, reports: list[dict]) -> None:
        scalars = step_scalars(reports, elapsed, leader_report=reports[0])
        self.metrics.log(step + 1, scalars)
        self.history.append(scalars)
        if self.console is not None and self.cfg.logging.progress:
            s = scalars
            self.console.print(
                f"[bold]step {step + 1}/{self.cfg.train.steps}[/]  reward [green]{s['reward/mean']:.3f}[/]  "
                f"acc {s['reward/accuracy']:.3f}  judge-agree {s['reward/genrm_agreement']:.2f}  "
                f"loss {s['train/loss']:+.4f}  {elapsed:.1f}s = rollout {s['time/rollout']:.1f} | "
                f"reward {s['time/reward']:.1f} | train {s['time/train']:.1f} | sync {s['time/weight_sync']:.2f}",
                highlight=False)

    def finish(self, wall: float) -> None:
        from yatt_hpc.control.summary import print_summary, run_summary

        summary = run_summary(self.history, wall)
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.console is not None:
            print_summary(summary, self.run_dir, self.console)
