"""Pure rendering of the job script: what `yatt-hpc submit` sends to sbatch and `plan --sbatch` prints.

    text = render_sbatch(cfg, plan(cfg), "/abs/runs/demo", python="/abs/.venv/bin/python")
    text = render_sbatch(cfg, p, run_dir, python, submitit_folder=run_dir + "/submitit")   # submit's form

Shape: `placement.mode=disjoint` gives a heterogeneous job, one `#SBATCH hetjob` component per
group (trainer, rollout, genrm, in world-rank order); colocate/partial give one allocation on
the shared nodes. Either way the script ends by exec-ing ONE launcher (`yatt_hpc.launch.launcher`,
or submitit's runner that calls the same launcher), which starts every group in one MPMD srun step.

Safety: every value that reaches the script is checked and quoted. `#SBATCH` lines are parsed by
sbatch, not bash: sbatch understands shell quotes but treats a backslash as an escape even inside
single quotes, and a newline would end the comment and start a command, so control characters and
backslashes are rejected there. Values in the bash body are `shlex.quote`d. Nothing here reads the
environment or touches files.
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence

from yatt_hpc.config.cluster import SLURM_TIME
from yatt_hpc.config.schema import RunConfig
from yatt_hpc.placement import GroupPlan, Plan

LAUNCHER_MODULE = "yatt_hpc.launch.launcher"
SUBMITIT_MODULE = "submitit.core._submit"

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIGNAL = re.compile(r"^(?:B:)?(?:SIG)?(?P<name>[A-Z][A-Z0-9]*|[0-9]+)@(?P<secs>[0-9]+)$")
_TIME = SLURM_TIME
_MEM = re.compile(r"^(?P<n>\d+)(?P<unit>[KMGT]?)B?$", re.I)


class SbatchError(ValueError):
    """A config value that cannot go into a job script; the message names field, value and fix."""


def render_sbatch(cfg: RunConfig, plan: Plan, run_dir: str, python: str,
                  submitit_folder: str | None = None) -> str:
    """The whole job script for `plan`, logging under `run_dir/logs`, running `python`."""
    for name, value in (("run dir", run_dir), ("python", python), ("submitit folder", submitit_folder or "")):
        _check_text(name, value, extra="" if name != "run dir" else "\\")
    output = run_dir.replace("%", "%%").rstrip("/") + "/logs/slurm-%j.out"
    lines = ["#!/bin/bash", *header_comment(plan), *directive_lines(cfg, plan, output), ""]
    lines += body_lines(cfg, run_dir, launch_argv(python, run_dir, submitit_folder), submitit_folder is not None)
    return "\n".join(lines) + "\n"


def header_comment(plan: Plan) -> list[str]:
    groups = ", ".join(f"{g.name} {g.rank_start}-{g.rank_stop - 1}" for g in plan.groups)
    shape = "heterogeneous job, one component per group" if plan.mode == "disjoint" else "one allocation, shared nodes"
    return [f"# yatt-hpc GRPO job: placement {plan.mode} ({shape}); {plan.world_size} ranks on "
            f"{plan.total_nodes} node(s): {groups}.",
            "# Rendered by `yatt-hpc plan CONFIG --sbatch`; `yatt-hpc submit` sends the same lines through submitit."]


def directive_lines(cfg: RunConfig, plan: Plan, output: str) -> list[str]:
    """`#SBATCH` lines: job-wide flags, then one block per het component (or one block when shared)."""
    blocks = component_flags(cfg, plan)
    lines = [_directive(flag) for flag in job_flags(cfg, output)]
    for index, block in enumerate(blocks):
        if index:
            lines.append("#SBATCH hetjob")
        lines += [_directive(flag) for flag in block]
    return lines


def job_flags(cfg: RunConfig, output: str) -> list[str]:
    """Flags of the whole job (sbatch takes them from the first component)."""
    sc = cfg.slurm
    _check_text("slurm.job_name", sc.job_name)
    _check_text("run dir", output)
    return [f"--job-name={sc.job_name}", "--open-mode=append", f"--output={output}", "--requeue",
            f"--signal={batch_signal(sc.signal)}"]


def component_flags(cfg: RunConfig, plan: Plan) -> list[list[str]]:
    """Per-component resource flags: sorted ours, then the group's `slurm.extra_flags` as given."""
    common = _common_flags(cfg)
    if plan.mode == "disjoint":
        return [sorted(common + _group_flags(g)) + _extra_flags(cfg, [g.name]) for g in plan.groups]
    return [sorted(common + _shared_flags(plan)) + _extra_flags(cfg, [g.name for g in plan.groups])]


def _common_flags(cfg: RunConfig) -> list[str]:
    sc = cfg.slurm
    flags = [f"--time={slurm_time(sc.time)}"]
    for field in ("partition", "account", "qos"):
        value = getattr(sc, field)
        if value is not None:
            _check_text(f"slurm.{field}", value, empty_ok=False)
            flags.append(f"--{field}={value}")
    return flags


def _group_flags(g: GroupPlan) -> list[str]:
    flags = [f"--nodes={g.nodes}", f"--ntasks-per-node={g.tasks_per_node}", f"--cpus-per-task={g.cpus_per_task}"]
    if g.devices_per_task:
        flags.append(f"--gpus-per-node={g.tasks_per_node * g.devices_per_task}")
    if g.mem is not None:
        flags.append(f"--mem={_mem(f'placement.{g.name}.mem', g.mem)}")
    return flags


def _shared_flags(plan: Plan) -> list[str]:
    """One allocation for colocated groups: every rank of every group lives on each of the nodes.

    Each rank gets the largest cpus_per_task of the groups; GPUs are the node's devices, which the
    groups take in turn (colocate) or split (partial): never the sum.
    """
    nodes = plan.total_nodes
    flags = [f"--nodes={nodes}", f"--ntasks-per-node={sum(g.tasks_per_node for g in plan.groups)}",
             f"--cpus-per-task={max(g.cpus_per_task for g in plan.groups)}"]
    if plan.total_devices:
        flags.append(f"--gpus-per-node={plan.total_devices // nodes}")
    mems = [(g.name, g.mem) for g in plan.groups if g.mem is not None]
    if mems:
        name, mem = max(mems, key=lambda item: _mem_mb(f"placement.{item[0]}.mem", item[1]))
        flags.append(f"--mem={_mem(f'placement.{name}.mem', mem)}")
    return flags


def _extra_flags(cfg: RunConfig, groups: Iterable[str]) -> list[str]:
    out: list[str] = []
    for group in groups:
        for flag in cfg.slurm.extra_flags.get(group, []):  # type: ignore[call-overload]
            field = f"slurm.extra_flags.{group}"
            _check_text(field, flag, empty_ok=False)
            if not flag.startswith("-"):
                raise SbatchError(f"{field}: {flag!r} is not an sbatch option; give flags like "
                                  "'--constraint=h200' (one flag per list item, starting with '-')")
            if flag not in out:
                out.append(flag)
    return out


def body_lines(cfg: RunConfig, run_dir: str, launch: Sequence[str], submitit: bool) -> list[str]:
    """The bash part: fail fast, one log per (re)start, exported env, then exec the launcher."""
    lines = ["set -euo pipefail", "umask 022",
             f"run_dir={shlex.quote(run_dir)}",
             'mkdir -p -- "$run_dir/logs"',
             "# one log per (re)start; the #SBATCH --output file only catches failures before this line",
             'exec >>"$run_dir/logs/job_${SLURM_JOB_ID}_${SLURM_RESTART_COUNT:-0}.log" 2>&1',
             'echo "yatt-hpc: job ${SLURM_JOB_ID} start ${SLURM_RESTART_COUNT:-0} on $(hostname) at $(date -Is)"']
    lines += [f"export {key}={shlex.quote(value)}" for key, value in env_items(cfg)]
    lines.append(f"export SUBMITIT_PREEMPT_SIGNAL={signal_name(cfg.slurm.signal)}")
    if submitit:
        lines.append("export SUBMITIT_EXECUTOR=slurm")
    lines += ["# exec: the launcher becomes the batch shell, so the --signal=B:... warning reaches it;",
              "# it forwards the signal to every rank of the srun step",
              "exec " + " ".join(shlex.quote(word) for word in launch)]
    return lines


def launch_argv(python: str, run_dir: str, submitit_folder: str | None) -> list[str]:
    if submitit_folder is not None:
        return [python, "-u", "-m", SUBMITIT_MODULE, submitit_folder]
    return [python, "-u", "-m", LAUNCHER_MODULE, "--run-dir", run_dir]


def env_items(cfg: RunConfig) -> list[tuple[str, str]]:
    items = sorted(cfg.slurm.env.items())
    for key, value in items:
        if not _ENV_KEY.match(key):
            raise SbatchError(f"slurm.env: {key!r} is not an environment variable name; use letters, digits "
                              "and '_' (not starting with a digit)")
        _check_text(f"slurm.env.{key}", value, extra="")
    return items


def batch_signal(signal: str) -> str:
    """`USR2@90` -> `B:USR2@90`: the warning goes to the batch shell, i.e. the launcher, which forwards it."""
    match = _SIGNAL.match(signal)
    if not match:
        raise SbatchError(f"slurm.signal: {signal!r} is not SIG@SECONDS; use e.g. USR2@90")
    return signal if signal.startswith("B:") else "B:" + signal


def signal_name(signal: str) -> str:
    batch_signal(signal)  # validates
    return _SIGNAL.match(signal).group("name")  # type: ignore[union-attr]


def slurm_time(text: str) -> str:
    time_minutes(text)  # validates
    return text


def time_minutes(text: str) -> int:
    """Minutes of a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    match = _TIME.match(text)
    if not match:
        raise SbatchError(f"slurm.time: {text!r} is not a Slurm time; use e.g. 4:00:00, 90 or 1-00:00:00")
    d, a, b, c = (int(match.group(k)) if match.group(k) else None for k in "dabc")
    if d is not None:  # D-H[:M[:S]]
        return d * 1440 + a * 60 + (b or 0) + (1 if c else 0)
    if c is not None:  # H:M:S
        return a * 60 + b + (1 if c else 0)  # type: ignore[operator]
    return a + (1 if b else 0)  # M or M:S


def _mem(field: str, mem: str) -> str:
    _mem_mb(field, mem)
    return mem


def _mem_mb(field: str, mem: str) -> float:
    match = _MEM.match(mem)
    if not match:
        raise SbatchError(f"{field}: {mem!r} is not a Slurm memory size; use e.g. 64G or 512000M")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[match.group("unit").upper()]
    return int(match.group("n")) * scale


def _directive(flag: str) -> str:
    name, sep, value = flag.partition("=")
    return f"#SBATCH {shlex.quote(name)}{sep}{shlex.quote(value) if sep else ''}"


def _check_text(field: str, value: str, extra: str = "\\", empty_ok: bool = True) -> None:
    """Reject what no quoting makes safe in a job script: control characters (a newline would end the
    `#SBATCH` comment and start a command) and, in `#SBATCH` values, backslashes (sbatch escapes with them)."""
    if not value and not empty_ok:
        raise SbatchError(f"{field} is empty; set a value or null")
    bad = _CONTROL.search(value) or (extra and any(ch in value for ch in extra))
    if bad:
        raise SbatchError(f"{field}: {value!r} contains a control character or backslash, which cannot go into "
                          "a job script; remove it")
