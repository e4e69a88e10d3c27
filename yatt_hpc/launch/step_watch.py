"""The launcher's watch over its srun step: srun is not trusted to return.

    watch = step_watch_for(cfg, plan, run_dir / "logs" / f"exits_{job}_{restart}", slurm)
    code = watch.wait(subprocess.Popen(srun_argv))  # srun's exit code, or the ranks' if srun had to be ended
    watch.ended_srun, watch.records()                # whether it was ended; every rank's exit record

Each task's shim (`rank_group`) writes its rank's exit record; once every rank has one, or Slurm's list
of running steps (`SlurmSteps`) no longer holds ours, srun gets `slurm.step_exit_timeout_s` to return
and is then killed, the step's code being the ranks' own (`ranks_exit_code`). Slurm before 24.11 can
leave the srun of a heterogeneous `--mpi=pmix` step waiting forever (SchedMD ticket 16817): see `StepWatch`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from yatt_hpc.launch.slurm_env import SlurmEnv
from yatt_hpc.placement import Plan

EXIT_STEP_ENDED_BY_SLURM = 1  # the code of a step Slurm ended without any rank recording a failure


class SlurmSteps:
    """Whether Slurm still runs a job step of this allocation (the batch shell's own steps aside).

    `alive()` asks `squeue --steps` for every component's job id at most every `poll_s`; None until a
    step has been seen (srun registers it a moment after it starts) and when squeue cannot answer."""

    _OWN = (".batch", ".extern", ".interactive")

    def __init__(self, job_ids: Sequence[str], poll_s: float = 5.0):
        self.job_ids, self.poll_s = [j for j in job_ids if j], poll_s
        self.seen, self._asked_at, self._last = False, None, None

    def alive(self) -> bool | None:
        now = time.monotonic()
        if not self.job_ids or (self._asked_at is not None and now - self._asked_at < self.poll_s):
            return self._last
        self._asked_at = now
        try:
            out = subprocess.run(["squeue", "-h", "--steps", "-j", ",".join(self.job_ids), "-o", "%i"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return self._last
        if out.returncode != 0:
            return self._last
        running = [s for s in out.stdout.split() if not s.endswith(self._OWN)]
        self.seen = self.seen or bool(running)
        self._last = bool(running) if self.seen else None
        return self._last


class StepWatch:
    """Wait for srun, but no longer than `timeout_s` after the step is over by other evidence.

    The step is over when every rank has written its exit record (`rank_group.write_exit_record`, one
    per world rank, written by the task's shim after the rank's process has exited), or when Slurm no
    longer runs any step of ours (`steps`): a step Slurm cancelled (MPI_Abort, --kill-on-bad-exit)
    SIGKILLs the shims too, so their records never come. srun's return is only the usual way to learn
    it. Slurm 22.05-24.05's mpi/pmix plugin starts one abort agent per heterogeneous component over
    one shared thread handle and can then wait forever for one of them at the end of the step (SchedMD
    ticket 16817, fixed in 24.11 by commit a2e9643): every rank has exited, srun has not. Then srun is
    killed (its shepherd process cancels the step) and the exit code is the ranks'.
    """

    def __init__(self, directory: Path, world_size: int, timeout_s: float, poll_s: float = 0.5,
                 steps: SlurmSteps | None = None):
        self.directory, self.world_size, self.timeout_s, self.poll_s = directory, world_size, timeout_s, poll_s
        self.steps = steps
        self.ended_srun = False

    def records(self) -> list[dict]:
        out = []
        for path in sorted(self.directory.glob("rank-*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # written atomically: only a vanished dir gets here
                continue
        return out

    def _over(self) -> str | None:
        if len(self.records()) >= self.world_size:
            return "records"
        if self.steps is not None and self.steps.alive() is False:
            return "slurm"
        return None

    def wait(self, proc: subprocess.Popen) -> int:
        over_at, how = None, None
        while True:
            try:
                return proc.wait(timeout=self.poll_s)
            except subprocess.TimeoutExpired:
                pass
            if over_at is None:
                how = self._over()
                if how is not None:
                    over_at = time.monotonic()
                continue
            if how == "slurm" and self._over() == "records":
                how = "records"
            if time.monotonic() - over_at < self.timeout_s:
                continue
            return self._end_srun(proc, how)

    def _end_srun(self, proc: subprocess.Popen, how: str) -> int:
        records = self.records()
        code = ranks_exit_code(records)
        if how == "records":
            say(f"every one of the {self.world_size} ranks has exited (records in {self.directory}) but srun has not "
                 f"returned {self.timeout_s:g}s later (a known Slurm mpi/pmix hang at the end of heterogeneous steps, "
                 f"SchedMD ticket 16817, fixed in Slurm 24.11): ending srun; the step's exit code is the ranks' ({code})")
        else:
            code = code or EXIT_STEP_ENDED_BY_SLURM  # ranks without a record were killed with their shims
            say(f"Slurm no longer runs the step ({len(records)} of {self.world_size} ranks left an exit record; "
                 f"the others were killed with the step) but srun has not returned {self.timeout_s:g}s later "
                 f"(the Slurm mpi/pmix hang of SchedMD ticket 16817, fixed in Slurm 24.11): ending srun; "
                 f"the step's exit code is {code}")
        proc.kill()
        proc.wait()
        self.ended_srun = True
        return code


def step_watch_for(cfg, p: Plan, exits: Path, slurm: SlurmEnv | None = None) -> StepWatch:
    """The watch of the step that runs plan `p`: every world rank's exit record under `exits` (or, in
    an allocation, Slurm's own list of running steps), then at most `cfg.slurm.step_exit_timeout_s`
    for srun to return."""
    steps = SlurmSteps([c.job_id for c in slurm.components]) if slurm is not None and slurm.in_allocation else None
    return StepWatch(exits, p.world_size, cfg.slurm.step_exit_timeout_s, steps=steps)


def ranks_exit_code(records: Sequence[Mapping]) -> int:
    """The step's code from the ranks' records: 0 if all are 0, else the lowest rank's non-zero code
    (a signal N counts as 128 + N, as a shell reports it)."""
    for rec in sorted(records, key=lambda r: r["rank"]):
        code = rec["code"] if rec.get("signal") is None else 128 + rec["signal"]
        if code:
            return code
    return 0


def say(text: str) -> None:
    """A line of the launcher on stderr (the job log)."""
    print(f"yatt-hpc launcher: {text}", file=sys.stderr, flush=True)
