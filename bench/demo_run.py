"""B6: `make demo` end to end: wall time and reward gain of the embedded CPU default.

    .venv/bin/python bench/demo_run.py                # 3 fresh runs of configs/demo_cpu.yaml
    .venv/bin/python bench/demo_run.py --repeats 1

Each run is exactly what `make demo` runs after installing, into a fresh temp run dir:
`yatt-hpc run configs/demo_cpu.yaml --run-dir DIR` (4 MPI ranks, 30 steps). Reported per run: the
command's wall time (mpirun start, imports, model builds, 30 steps, final checkpoint), the loop's
own wall time and reward gain from DIR/summary.json (mean reward of the last 5 steps minus the
first 5). Prints a rich table, writes bench/results/demo_run.json. No target: report.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from common import PYTHON, REPO, mpi_env, print_table, row, spread, write_report

KEYS = ("wall_seconds", "reward_first5", "reward_last5", "reward_gain", "accuracy_last5", "step_seconds_mean")


def run_once(run_dir: Path) -> dict:
    argv = [str(Path(PYTHON).parent / "yatt-hpc"), "run", "configs/demo_cpu.yaml", "--run-dir", str(run_dir)]
    start = time.perf_counter()
    subprocess.run(argv, env=mpi_env(), cwd=REPO, check=True, timeout=600, stdout=subprocess.DEVNULL)
    command_s = time.perf_counter() - start
    return {"command_s": command_s, **json.loads((run_dir / "summary.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="demo_run_") as tmp:
        runs = [run_once(Path(tmp) / f"run-{i}") for i in range(args.repeats)]
    stats = {k: spread([r[k] for r in runs]) for k in ("command_s", *KEYS)}
    labels = {"command_s": ("command wall time", " s", 1), "wall_seconds": ("step loop wall time (summary)", " s", 1),
              "reward_first5": ("mean reward, first 5 steps", "", 3), "reward_last5": ("mean reward, last 5 steps", "", 3),
              "reward_gain": ("reward gain", "", 3), "accuracy_last5": ("accuracy, last 5 steps", "", 3),
              "step_seconds_mean": ("mean step time", " s", 3)}
    table = [[labels[k][0], f"{s['median']:.{labels[k][2]}f}", f"{s['min']:.{labels[k][2]}f}-{s['max']:.{labels[k][2]}f}",
              " ".join(f"{v:.{labels[k][2]}f}" for v in s["values"])] for k, s in stats.items()]
    print_table(f"B6 make demo (configs/demo_cpu.yaml, 4 ranks, 30 steps), {args.repeats} fresh runs",
                ["metric", "median", "min-max", "each run"], table)
    c, g = stats["command_s"], stats["reward_gain"]
    verdict = (f"make demo: {c['median']:.1f} s wall [{c['min']:.1f}-{c['max']:.1f}], reward "
               f"{stats['reward_first5']['median']:.3f} -> {stats['reward_last5']['median']:.3f} "
               f"(gain {g['median']:+.3f} [{g['min']:+.3f}..{g['max']:+.3f}])")
    write_report("demo_run", question="B6 make demo: wall time and reward gain", target="report", met=None,
                 verdict=verdict, rows=[row(labels[k][0], s, labels[k][1], labels[k][2]) for k, s in stats.items()],
                 raw={"args": vars(args), "runs": runs},
                 notes="Excludes `make install` (a no-op once .venv exists). Same seed every run: the reward "
                       "curve should repeat; the wall time varies with machine load.")


if __name__ == "__main__":
    main()
