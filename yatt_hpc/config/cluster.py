"""The cluster side of a run's config: `slurm:` (how the job is asked for) and `health:` (a silent rank).

    from yatt_hpc.config import load_config
    cfg = load_config("configs/demo_cpu.yaml", overrides=["slurm.partition=gpu", "health.stall_timeout_s=300"])
    cfg.slurm.partition, cfg.health.stall_timeout_s

Part of the typed configuration (`yatt_hpc.config.schema` imports them into `RunConfig`); `SLURM_TIME`
is the one reading of a Slurm time limit, shared with the renderers in `launch/`.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from yatt_hpc.config.section import Section

# A Slurm time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (the renderers in launch/ read it with this).
SLURM_TIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


class SlurmConfig(Section):
    """How `yatt-hpc submit` and the `sbatch/` scripts ask Slurm for the job."""

    job_name: str = "yatt-hpc"
    """Slurm job name."""
    partition: str | None = None
    """Partition; null uses the cluster default."""
    time: str = "01:00:00"
    """Wall-time limit (Slurm format, e.g. `4:00:00` or `1-00:00:00`)."""
    account: str | None = None
    """Account to charge; null uses the user's default."""
    qos: str | None = None
    """Quality of service; null uses the default."""
    signal: str = "USR2@90"
    """Signal Slurm sends before the time limit or on preemption (`SIG@seconds`): the save-and-requeue trigger."""
    max_requeues: int = Field(3, ge=0)
    """Automatic requeues allowed after preemption or timeout."""
    step_exit_timeout_s: float = Field(20.0, gt=0, le=3600)
    """Longest the batch launcher waits for `srun` to return once every rank of the step has recorded its exit;
    past it srun is ended and the job finishes with the ranks' own exit codes (Slurm before 24.11 can leave a
    heterogeneous `--mpi=pmix` step's srun waiting forever: SchedMD ticket 16817)."""
    extra_flags: dict[Literal["trainer", "rollout", "genrm", "tools"], list[str]] = Field(default_factory=dict)
    """Extra `#SBATCH` flags per group, e.g. `{trainer: ["--constraint=h200"]}`."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables the job script exports before the launch, e.g. `{OMPI_MCA_btl: "self,tcp"}`
    (needed on the one-host dev cluster, whose virtual nodes cannot use Open MPI's shared-memory transport)."""

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.match(value):
            raise ValueError(f"slurm.time={value!r} is not a Slurm time limit; use minutes (90), H:M:S (4:00:00) "
                             "or D-H:M:S (1-00:00:00)")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_as_text(cls, value: object) -> object:
        # `--set slurm.env.OMP_NUM_THREADS=4` parses 4 as YAML int; an environment value is text
        if isinstance(value, dict):
            return {k: (str(v).lower() if isinstance(v, bool) else str(v)) if isinstance(v, (int, float)) else v
                    for k, v in value.items()}
        return value


class HealthConfig(Section):
    """Noticing a rank that stops answering (yatt_hpc/runtime/health.py)."""

    heartbeat_s: float = Field(5.0, gt=0, le=600)
    """Seconds between the heartbeats every rank's monitor thread sends (its own communicator, not the data plane)."""
    stall_timeout_s: float | None = Field(120.0, gt=0)
    """A rank silent this long (stopped, frozen), or a world where no rank made progress this long (a hung call,
    a deadlock), ends the job naming the group and rank (exit 3; requeue/resubmit resume from the last checkpoint).
    Keep it above the longest single engine call (an SGLang generate is one call); null turns detection off.
    Needs MPI THREAD_MULTIPLE."""

    @model_validator(mode="after")
    def _beats_fit_the_timeout(self) -> HealthConfig:
        if self.stall_timeout_s is not None and self.heartbeat_s * 3 > self.stall_timeout_s:
            raise ValueError(f"health.heartbeat_s={self.heartbeat_s:g} must be at most a third of "
                             f"health.stall_timeout_s={self.stall_timeout_s:g} (a late beat or two must not look like "
                             "a stall); lower heartbeat_s or raise stall_timeout_s")
        return self
