"""The step loop every rank runs, whatever its group, and the leader's per-step review.

    StepLoop(world, cfg, controller, stats, metrics, ckpt, stop_flag, protocol, console, run_dir, slurm).run()

Per step (every collective is the step protocol's, `roles/protocol.py`): all ranks agree whether to
stop (the max of each rank's stop code: a signal seen by any rank, or the leader's wall-time
deadline); with a dynamic split, take the leader's split of the next step (see sched/split.py) and
set the step's routes; run their controller's step; send a small report (times, sums, peaks: no
samples) to the leader; save a checkpoint when one is due (with the split, if any). On a stop the
ranks save (unless the step was just saved), wait for the write, and the leader requeues the job
or says how to continue. The leader holds decisions and numbers, never the batch.

A step that is still running `checkpoint.stop_grace_s` after a stop signal is given up: the stop
watchdog (`stop_watchdog.py`) has every rank commit the last completed step from what the loop
recorded at the step's start (`abandon`; the split too), then the processes exit; the stop record
says so.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from yatt_hpc.ckpt import SharedState, should_save
from yatt_hpc.ckpt.manifest import complete_message
from yatt_hpc.metrics.activity import ACTIVITY
from yatt_hpc.roles.base import eval_due
from yatt_hpc.runtime.allocator import give_back_freed_memory
from yatt_hpc.runtime.health import HealthMonitor
from yatt_hpc.runtime.stop_watchdog import StepGuard, StepRecord, StopWatchdog
from yatt_hpc.runtime.summary import step_scalars
from yatt_hpc.sched.requeue import DEADLINE, NONE, REASONS, SIGNAL, decide_requeue, past_deadline, stop_record_name
from yatt_hpc.sched.routing import RoleSplit, Routes
from yatt_hpc.sched.split import SplitSchedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlurmFacts:
    """What the loop needs from the Slurm environment (read at the edge, in the worker)."""

    job_id: str | None = None
    restart_count: int = 0
    end_time: float | None = None


class StepLoop:
    def __init__(self, world, cfg, controller, stats, metrics, ckpt, stop_flag, protocol, console=None,
                 run_dir: Path | None = None, slurm: SlurmFacts = SlurmFacts(), config_yaml: str = ""):
        self.world, self.cfg, self.controller, self.stats, self.protocol = world, cfg, controller, stats, protocol
        self.metrics, self.ckpt, self.stop_flag = metrics, ckpt, stop_flag
        self.console, self.run_dir, self.slurm, self.config_yaml = console, run_dir, slurm, config_yaml
        self.history: list[dict] = []
        self.pending_eval: dict[str, float] = {}  # validation after a step, logged with the step's metrics
        self.step_seconds = 0.0
        self.outcome = "complete"
        self.split = SplitSchedule.from_config(cfg, world.plan) if world.plan.dynamic_split else None
        self.guard = StepGuard()  # what the stop watchdog may save while a step runs
        controller.watch_mutations(self.guard)

    # ------------------------------------------------------------------ the loop

    def run(self) -> str:
        step = self.resume()
        give_back_freed_memory()  # start-up's and resume's transients: no step needs them (runtime/allocator.py)
        last_saved, started = step, time.perf_counter()
        watchdog = StopWatchdog.build(self.world.comm, self.guard, self.stop_flag, self.cfg.checkpoint.stop_grace_s,
                                      self.abandon)
        health = HealthMonitor.build(self.world, self.cfg.health.heartbeat_s, self.cfg.health.stall_timeout_s,
                                     self.run_dir, f"{self.slurm.job_id or 'local'}_{self.slurm.restart_count}")
        while step < self.cfg.train.steps:
            self.protocol.begin_step(step)
            reason = self.agree_stop()
            if reason != NONE:
                self.guard.enter_mutation()  # from here on the loop saves; the watchdog keeps out
                if last_saved != step:
                    self.save(step)
                self.stop(reason, step)
                break
            light = copy.deepcopy(self.controller.light_state(step))
            # the counters a checkpoint of `step` holds: the split before this step's agreement
            self.guard.begin_step(StepRecord(step, light, saved=last_saved == step, counters=self.counters(step)))
            self.agree_split()
            ACTIVITY.progress(f"step {step + 1}")
            log.info("step %d begins", step + 1)  # tests wait for this line to act inside a step
            if step == 0 and eval_due(self.cfg, 0):
                self.evaluate(0)  # the initial policy, logged at step 0
            t0 = time.perf_counter()
            self.controller.step(step)
            self.step_seconds = time.perf_counter() - t0
            if eval_due(self.cfg, step + 1):
                self.evaluate(step + 1)  # part of the step: a given-up step redoes it, a saved one does not
            self.guard.end_step()
            reports = self.protocol.report(self.stats.step_report())
            if self.split is not None:
                self.split.end_step(reports)  # the leader decides the split of step + 2 from these loads
            if self.world.is_leader:
                self.review(step, self.step_seconds, reports)
            step += 1
            if should_save(step, self.cfg.checkpoint.interval, self.cfg.train.steps):
                # Ranks done early (GenRM, while the trainers train) wait for the rest before saving:
                # until then their state is still the step start the stop watchdog may save instead.
                self.protocol.save_barrier()
                self.guard.enter_mutation()
                self.save(step)
                last_saved = step
            self.protocol.end_step()
        if watchdog is not None:
            watchdog.close()
        if health is not None:
            health.close()
        self.ckpt.close()
        if self.world.is_leader and self.outcome == "complete":
            self.finish(time.perf_counter() - started)
        self.metrics.close(self.outcome)  # the leader: report.png to the trackers, then their runs end
        return self.outcome

    def resume(self) -> int:
        """Load the latest verified checkpoint (or `checkpoint.load_from` weights); return the next step."""
        restored = self.ckpt.load_latest(self.controller.identity)
        start = restored.step if restored is not None else 0
        # whatever a killed attempt logged past the checkpoint is redone: forget it (without a checkpoint,
        # everything, the validation before step 1 included)
        self.controller.rewind_logs(start)
        self.metrics.resume_at(start if restored is not None else -1)
        if restored is not None:
            self.controller.restore(restored)
            self.stats.step = restored.step
            if self.split is not None and not self.split.restore(restored.shared.counters):
                log.warning("checkpoint step %d holds no usable dynamic split; starting from the configured one",
                            restored.step)
            self.set_resume_routes()
            self.controller.after_resume(restored.step)
            if self.world.is_leader:
                self.say(f"resumed from checkpoint step {restored.step} in {self.run_dir}")
            if restored.step >= self.cfg.train.steps:
                self.outcome = "already_complete"
                if self.world.is_leader:
                    self.say(complete_message(self.run_dir, restored.step, self.cfg.train.steps))
            return restored.step
        if self.cfg.checkpoint.load_from:
            self.controller.load_weights(self.ckpt.load_from(self.cfg.checkpoint.load_from, **self.controller.shard))
            self.set_resume_routes()
            self.controller.after_resume(0)
        return 0

    def agree_stop(self) -> int:
        code = self.stop_flag.reason_code()
        if self.world.is_leader and code == NONE and past_deadline(time.time(), self.slurm.end_time,
                                                                   self.step_seconds, self.ckpt.last_stall_s):
            code = DEADLINE
        return self.protocol.agree_stop(code)

    def agree_split(self) -> None:
        """Every rank takes the leader's split of the step after this one; set this step's routes."""
        if self.split is None:
            return
        pending = self.protocol.agree_split(self.split.pending)
        self.controller.set_routes(Routes(self.world.plan, self.split.agreed(pending)))

    def set_resume_routes(self) -> None:
        """Restored weights go to the ranks that generate the first step (its split is `current`)."""
        if self.split is not None:
            self.controller.set_routes(Routes(self.world.plan, RoleSplit(self.split.current, self.split.current)))

    def counters(self, step: int) -> dict[str, int]:
        """The shared counters of checkpoint `step`: the step, and the split (if any) of steps step and step + 1."""
        return {"step": step, **(self.split.counters() if self.split is not None else {})}

    def save(self, step: int) -> None:
        shared = SharedState(counters=self.counters(step), config_yaml=self.config_yaml)
        self.ckpt.save(step, self.controller.checkpoint_state(step), shared)
        log.info("checkpoint step %d handed to the writer (stall %.3fs)", step, self.ckpt.last_stall_s)

    def stop(self, reason: int, step: int) -> None:
        self.ckpt.wait()  # the final checkpoint is committed before anyone requeues or exits
        self.outcome = "stopped"
        if self.world.is_leader:
            self.announce(reason, step)

    def abandon(self, record: StepRecord, waited: float) -> None:
        """The watchdog thread of every rank, the loop parked or still busy in step `record.step`:
        commit checkpoint `record.step` from live weights and the step-start record; say why."""
        step, t0 = record.step, time.perf_counter()
        state = None if record.saved else self.controller.checkpoint_state(step, record.light)
        t1 = time.perf_counter()
        self.ckpt.commit_now(step, state, SharedState(counters=record.counters, config_yaml=self.config_yaml))
        log.info("checkpoint step %d of a given-up step: state taken in %.3fs, written and committed in %.3fs",
                 step, t1 - t0, time.perf_counter() - t1)
        self.outcome = "stopped"
        if self.world.is_leader:
            self.metrics.close("stopped")
            self.announce(SIGNAL, step, abandoned=f"gave up step {step + 1} {waited:.1f}s after the signal "
                                                  f"(checkpoint.stop_grace_s={self.cfg.checkpoint.stop_grace_s:g})")

    def announce(self, reason: int, step: int, abandoned: str = "") -> None:
        """The leader: decide whether to requeue, say it, and leave the stop record for the launcher."""
        decision = decide_requeue(reason, self.slurm.restart_count, self.cfg.slurm.max_requeues,
                                  self.slurm.job_id is not None)
        why = f"{REASONS[reason]}; {abandoned}" if abandoned else REASONS[reason]
        log.warning("stopping at step %d (%s): %s", step, why, decision.reason)
        self.say(f"stopped at step {step}/{self.cfg.train.steps} ({why}); checkpoint step-{step} saved. "
                 f"{decision.reason}")
        if self.run_dir is not None:
            # the batch-level launcher acts on it once every rank has exited (nobody is killed mid-save)
            path = self.run_dir / "logs" / stop_record_name(self.slurm.job_id, self.slurm.restart_count)
            path.write_text(json.dumps({"step": step, "requeue": decision.requeue, "reason": decision.reason,
                                        "abandoned": abandoned or None}) + "\n")
        if self.slurm.job_id is not None:
            self.outcome = "requeue" if decision.requeue else "stopped"

    # ------------------------------------------------------------------ the leader's review

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False)
        log.info(text)

    def evaluate(self, after: int) -> None:
        """Every rank: a validation round once `after` steps are done (`eval` settings); the leader logs it."""
        t0 = time.perf_counter()
        scalars = self.controller.evaluate(after)
        if not self.world.is_leader or scalars is None:
            return
        scalars["time/eval"] = time.perf_counter() - t0
        if self.console is not None and self.cfg.logging.progress:
            shown = "  ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in scalars.items()
                              if k.endswith(("/reward_mean", "/accuracy")) or "/pass@" in k)
            self.console.print(f"[bold]eval after step {after}[/]  {shown}  ({scalars['time/eval']:.1f}s)",
                               highlight=False)
        if after == 0:
            self.metrics.log(0, scalars)
        else:
            self.pending_eval = scalars

    def review(self, step: int, elapsed: float, reports: list[dict]) -> None:
        scalars = step_scalars(reports, elapsed, leader_report=reports[0])
        scalars.update(self.pending_eval)
        self.pending_eval = {}
        if self.split is not None:
            scalars.update(self.split.scalars())
            log.info("step %d split: rollout %d of %d, busy rollout %.2fs genrm %.2fs; step %d: %s", step,
                     self.split.ran, self.split.pool, *self.split.busy, step + 2, self.split.decision.reason)
        self.log_samples(reports)  # before the step's scalars: a tracker takes a step's data in step order
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

    def log_samples(self, reports: list[dict]) -> None:
        """The sample tables the trainer replicas' rows make (each replica sent its few with its report)."""
        tables: dict[tuple[int, str], list[dict]] = {}
        for report in reports:
            for row in report.get("samples", ()):
                tables.setdefault((row["step"], row["table"]), []).append(row)
        for (step, table), rows in sorted(tables.items()):
            self.metrics.log_samples(step, table, sorted(rows, key=lambda r: (r["replica"], r["sample"])))

    def finish(self, wall: float) -> None:
        from yatt_hpc.metrics.report import read_metrics
        from yatt_hpc.runtime.summary import print_summary, run_summary

        history = read_metrics(self.run_dir) if self.run_dir is not None else self.history
        summary = run_summary(history, wall)
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.console is not None:
            print_summary(summary, self.run_dir, self.console, self.cfg.logging)
