"""The Slurm environment of the current process, read once into a typed object.

    env = SlurmEnv.from_environ(os.environ)
    env.in_allocation, env.job_id, env.restart_count, env.components   # het components, or one

Only `launch/` reads SLURM_*; everything else receives this object. A heterogeneous job exports
`SLURM_HET_SIZE` and per-component `*_HET_GROUP_<i>` variables; a plain allocation has one component.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    """One het-job component (or the whole plain allocation)."""

    index: int
    job_id: str
    nodelist: str
    num_nodes: int
    ntasks: int


@dataclass(frozen=True)
class SlurmEnv:
    job_id: str | None
    restart_count: int
    job_name: str | None
    partition: str | None
    submit_dir: str | None
    step_id: str | None
    components: tuple[Component, ...]

    @property
    def in_allocation(self) -> bool:
        return self.job_id is not None

    @property
    def is_het(self) -> bool:
        return len(self.components) > 1

    @property
    def nodelist(self) -> str:
        return ",".join(c.nodelist for c in self.components)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SlurmEnv:
        job_id = environ.get("SLURM_JOB_ID") or None
        het = int(environ.get("SLURM_HET_SIZE", "0") or 0)
        if het:
            comps = tuple(_component(environ, i, f"_HET_GROUP_{i}") for i in range(het))
        elif job_id:
            comps = (_component(environ, 0, ""),)
        else:
            comps = ()
        return cls(job_id=job_id, restart_count=int(environ.get("SLURM_RESTART_COUNT", "0") or 0),
                   job_name=environ.get("SLURM_JOB_NAME"), partition=environ.get("SLURM_JOB_PARTITION"),
                   submit_dir=environ.get("SLURM_SUBMIT_DIR"), step_id=environ.get("SLURM_STEP_ID"),
                   components=comps)


def _component(environ: Mapping[str, str], index: int, suffix: str) -> Component:
    def get(name: str, default: str = "0") -> str:
        return environ.get(name + suffix) or default

    return Component(index=index, job_id=get("SLURM_JOB_ID", ""), nodelist=get("SLURM_JOB_NODELIST", ""),
                     num_nodes=int(get("SLURM_JOB_NUM_NODES")), ntasks=int(get("SLURM_NTASKS")))
