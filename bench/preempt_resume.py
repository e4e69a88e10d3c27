"""B7: preemption signal -> next training step running; Slurm's own requeue delay measured separately.

    .venv/bin/python bench/preempt_resume.py                  # local: 3 SIGTERM/restart cycles
    .venv/bin/python bench/preempt_resume.py --slurm          # also through the dev Slurm cluster (sinfo must work)

Local (no Slurm): `yatt-hpc run configs/demo_cpu.yaml` (4 ranks, long train.steps, checkpoint
only on stop); after --warm-steps new steps are in metrics.jsonl, SIGTERM to the `yatt-hpc`
process (it forwards SIGUSR2 to mpirun: every rank stops at the next step boundary, saves, waits
for the commit, exits). Timed: signal -> process exit, then the same command again -> first new
step in metrics.jsonl. Their sum is what a scheduler that restarts at once would see.

Slurm (--slurm): `yatt-hpc submit` of the same config (+ slurm.env.OMPI_MCA_btl=self,tcp for the
one-host dev cluster), then `scontrol requeue JOB` once steps are logged. Split by polling /proc
(every virtual node is this host) and squeue: requeue -> our ranks exited (save and exit), ranks
exited -> job RUNNING again (Slurm's requeue delay, not ours), RUNNING -> first new step (ours:
launch, imports, resume). sacct's End of the requeued attempt is the requeue time itself, so it
cannot split these. Every cycle checks that the restart resumed from the stop checkpoint.
Prints a rich table, writes bench/results/preempt_resume.json.
Target: ours <= 30 s.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

from common import PYTHON, REPO, mpi_env, print_table, row, spread, write_report

YATT = str(Path(PYTHON).parent / "yatt-hpc")
SETS = ["--set", "train.steps=100000", "--set", "checkpoint.interval=0", "--set", "logging.trackers=[]",
        "--set", "logging.progress=false"]


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip().endswith("}")]


def wait_for_step(run_dir: Path, step: int, timeout: float, poll: float = 0.05) -> float:
    """Epoch time at which metrics.jsonl first shows `step` (polled)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if step in logged_steps(run_dir):
            return time.time()
        time.sleep(poll)
    raise TimeoutError(f"step {step} not logged in {run_dir} within {timeout:.0f}s")


def resumed_from(run_dir: Path) -> int | None:
    """The checkpoint step the latest start resumed from, as the leader logged it (None: started fresh)."""
    log = run_dir / "logs" / "rank-0000-trainer.log"
    found = re.findall(r"resumed from checkpoint step (\d+)", log.read_text()) if log.exists() else []
    return int(found[-1]) if found else None


def ranks_alive(run_dir: Path) -> bool:
    """Whether any rank process of this run still exists (read from /proc; all virtual nodes are this host)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes()
        except OSError:
            continue
        if b"yatt_hpc.runtime.worker" in text and str(run_dir).encode() in text:
            return True
    return False


def local_cycles(args, run_dir: Path) -> list[dict]:
    argv = [YATT, "run", "configs/demo_cpu.yaml", "--run-dir", str(run_dir), *SETS]
    out = []
    proc = subprocess.Popen(argv, env=mpi_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_step(run_dir, args.warm_steps, timeout=300)
    for _ in range(args.repeats):
        t_signal = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
        t_exit = time.time()
        saved = max(logged_steps(run_dir))  # the stop checkpoint is at the last completed step
        proc = subprocess.Popen(argv, env=mpi_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t_next = wait_for_step(run_dir, saved + 1, timeout=300)
        out.append({"exit_code": code, "stopped_after_step": saved, "resumed_from": resumed_from(run_dir),
                    "signal_to_exit_s": t_exit - t_signal,
                    "restart_to_next_step_s": t_next - t_exit, "signal_to_next_step_s": t_next - t_signal})
        wait_for_step(run_dir, saved + args.warm_steps, timeout=300)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    return out


def sacct_attempts(job: str) -> list[dict]:
    """Every start of the job (--duplicates keeps the requeued ones), oldest first."""
    text = subprocess.run(["sacct", "-j", job, "--duplicates", "-X", "-n", "-P", "-o", "JobIDRaw,State,Start,End"],
                          capture_output=True, text=True, timeout=30).stdout
    rows = []
    for line in text.splitlines():
        _, state, start, end = line.split("|")
        parse = lambda s: datetime.fromisoformat(s).timestamp() if s[:1].isdigit() else None  # noqa: E731
        rows.append({"state": state, "start": parse(start), "end": parse(end)})
    return sorted(rows, key=lambda r: r["start"] or float("inf"))


def squeue_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                          timeout=30).stdout.strip().split("\n")[0]


def slurm_cycles(args, run_dir: Path) -> dict:
    argv = [YATT, "submit", "configs/demo_cpu.yaml", "--run-dir", str(run_dir), *SETS,
            "--set", "slurm.env.OMPI_MCA_btl=self,tcp"]
    sub = subprocess.run(argv, env=mpi_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    found = re.search(r"submitted job (\d+)", sub.stdout)
    if not found:
        return {"ok": False, "error": f"submit failed (exit {sub.returncode}): {(sub.stdout + sub.stderr).strip()[-500:]}"}
    job, cycles = found.group(1), []
    try:
        wait_for_step(run_dir, args.warm_steps, timeout=args.slurm_timeout)
        for _ in range(args.slurm_repeats):
            t_requeue = time.time()
            req = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
            if req.returncode != 0:
                return {"ok": False, "job": job, "error": f"scontrol requeue: {req.stderr.strip()}", "cycles": cycles}
            t_ranks_exited, t_running_again = None, None
            deadline = time.time() + args.slurm_timeout
            while time.time() < deadline and t_running_again is None:  # our ranks gone, then RUNNING again
                if t_ranks_exited is None and not ranks_alive(run_dir):
                    t_ranks_exited = time.time()
                if t_ranks_exited is not None and squeue_state(job) == "RUNNING":
                    t_running_again = time.time()
                time.sleep(0.1)
            saved = max(logged_steps(run_dir))
            t_next = wait_for_step(run_dir, saved + 1, timeout=args.slurm_timeout)
            cycles.append({"stopped_after_step": saved, "resumed_from": resumed_from(run_dir),
                           "requeue_to_ranks_exited_s": t_ranks_exited - t_requeue,
                           "slurm_requeue_delay_s": t_running_again - t_ranks_exited,
                           "running_to_next_step_s": t_next - t_running_again,
                           "requeue_to_next_step_s": t_next - t_requeue, "sacct": sacct_attempts(job)})
            wait_for_step(run_dir, saved + args.warm_steps, timeout=args.slurm_timeout)
        return {"ok": True, "job": job, "cycles": cycles}
    except (TimeoutError, TypeError) as exc:
        return {"ok": False, "job": job, "error": f"{type(exc).__name__}: {exc}", "cycles": cycles}
    finally:
        subprocess.run([YATT, "cancel", job], env=mpi_env(), cwd=REPO, capture_output=True, timeout=60)
        deadline = time.time() + 120  # cancelled ranks still save on SIGTERM: let them finish before cleanup
        while time.time() < deadline and (squeue_state(job) or ranks_alive(run_dir)):
            time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="local SIGTERM/restart cycles")
    ap.add_argument("--warm-steps", type=int, default=3, help="new steps logged before each signal")
    ap.add_argument("--slurm", action="store_true", help="also measure through the dev Slurm cluster")
    ap.add_argument("--slurm-repeats", type=int, default=2)
    ap.add_argument("--slurm-timeout", type=float, default=400.0)
    args = ap.parse_args()
    (REPO / "runs").mkdir(exist_ok=True)  # a fresh checkout has no runs/ yet
    root = Path(tempfile.mkdtemp(prefix="preempt_", dir=REPO / "runs"))  # under the repo: Slurm nodes see it
    try:
        local = local_cycles(args, root / "local")
        slurm = None
        if args.slurm:
            slurm = (slurm_cycles(args, root / "slurm") if shutil.which("sinfo") and
                     subprocess.run(["sinfo"], capture_output=True, timeout=20).returncode == 0
                     else {"ok": False, "error": "sinfo not available or failing: no Slurm cluster"})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = {"signal_to_exit_s": "local: SIGTERM -> exit (save at step boundary)",
            "restart_to_next_step_s": "local: restart -> first new step logged",
            "signal_to_next_step_s": "local: SIGTERM -> first new step logged (ours)"}
    stats = {k: spread([c[k] for c in local]) for k in keys}
    rows = [row(label, stats[k], " s", 2) for k, label in keys.items()]
    table = [[label, f"{stats[k]['median']:.2f}", f"{stats[k]['min']:.2f}-{stats[k]['max']:.2f}"] for k, label in keys.items()]
    ours = stats["signal_to_next_step_s"]["median"]
    slurm_note = "Slurm path not requested (--slurm)"
    if slurm is not None and slurm.get("ok"):
        skeys = {"requeue_to_ranks_exited_s": "slurm: requeue -> our ranks exited (save, exit)",
                 "slurm_requeue_delay_s": "slurm: ranks exited -> job RUNNING again (Slurm's delay)",
                 "running_to_next_step_s": "slurm: RUNNING again -> first new step (ours: launch, resume)",
                 "requeue_to_next_step_s": "slurm: requeue -> first new step (total)"}
        for k, label in skeys.items():
            s = spread([c[k] for c in slurm["cycles"]])
            rows.append(row(label, s, " s", 1))
            table.append([label, f"{s['median']:.1f}", f"{s['min']:.1f}-{s['max']:.1f}"])
        slurm_ours = [c["requeue_to_ranks_exited_s"] + c["running_to_next_step_s"] for c in slurm["cycles"]]
        s = spread(slurm_ours)
        rows.append(row("slurm: ours (total minus Slurm's delay)", s, " s", 1))
        table.append(["slurm: ours (total minus Slurm's delay)", f"{s['median']:.1f}", f"{s['min']:.1f}-{s['max']:.1f}"])
        slurm_note = f"Slurm: ours {s['median']:.1f} s, Slurm's requeue delay separate (job {slurm['job']})"
    elif slurm is not None:
        table.append(["slurm path", "NOT MEASURED", slurm["error"][:120]])
        rows.append({"label": "slurm path", "value": f"not measured: {slurm['error']}", "median": None,
                     "min": None, "max": None, "n": 0})
        slurm_note = f"Slurm path not measured: {slurm['error']}"
    print_table(f"B7 preemption -> next step, configs/demo_cpu.yaml, {args.repeats} local cycles (s)",
                ["measurement", "median", "min-max"], table)
    cycles = local + (slurm["cycles"] if slurm and slurm.get("ok") else [])
    resumed = sum(c["resumed_from"] == c["stopped_after_step"] for c in cycles)
    table.append(["restarts that resumed from the stop checkpoint", f"{resumed}/{len(cycles)}", ""])
    met = ours <= 30.0
    verdict = (f"local SIGTERM -> next step {ours:.1f} s (target <= 30 s: {'met' if met else f'NOT met, by {ours - 30:.1f} s'})"
               f"; {slurm_note}; {resumed}/{len(cycles)} restarts resumed from the stop checkpoint")
    write_report("preempt_resume", question="B7 preemption signal -> next training step; Slurm's requeue delay separately",
                 target="ours <= 30 s", met=met, verdict=verdict, rows=rows,
                 raw={"args": vars(args), "local": local, "slurm": slurm},
                 notes="Restart cost is dominated by process start: mpirun, Python imports (torch, Megatron), model build.")


if __name__ == "__main__":
    main()
