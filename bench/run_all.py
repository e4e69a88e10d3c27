"""Run every benchmark and rewrite BENCHMARKS.md from bench/results/*.json (what `make bench` does).

    .venv/bin/python bench/run_all.py                     # all of them, 12-15 min on the 2-core dev machine
    .venv/bin/python bench/run_all.py --only B3 B5        # a subset; the others keep their last JSON
    .venv/bin/python bench/run_all.py --render-only       # rewrite BENCHMARKS.md from bench/results/*.json

Each script writes bench/results/<name>.json; bench/render.py renders the page from those files and its
BENCHES list (one entry per benchmark: key, result file, what limits it). B7 also goes through Slurm when
`sinfo` answers (skip with --no-slurm). B9 needs TRL's venv (`bash bench/peers/setup.sh`); without it B9 is
skipped, saying so, unless asked for by --only. GPU-only entries (run=False) are run by hand.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from common import PYTHON, REPO, RESULTS
from render import BENCHES, DOC, render

BENCH = Path(__file__).resolve().parent
SCRIPTS = {b.key: b.script_name for b in BENCHES if b.run}
RESULTS_OF = {b.key: b.result for b in BENCHES if b.run}


def slurm_answers() -> bool:
    if not shutil.which("sinfo"):
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0


def run(key: str, slurm: bool) -> float:
    argv = [PYTHON, str(BENCH / f"{SCRIPTS[key]}.py")] + (["--slurm"] if key == "B7" and slurm else [])
    print(f"== {key}: {' '.join(argv[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, check=True)
    took = time.perf_counter() - start
    path = RESULTS / f"{RESULTS_OF[key]}.json"  # the report keeps when it was measured and how long it took
    data = json.loads(path.read_text())
    data.setdefault("measured", datetime.now().strftime("%Y-%m-%d %H:%M"))
    path.write_text(json.dumps(data | {"took_s": round(took, 1)}, indent=2) + "\n")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(SCRIPTS))
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--no-slurm", action="store_true", help="B7 measures locally only")
    args = ap.parse_args()
    durations, failed = {}, []
    if not args.render_only:
        slurm = not args.no_slurm and slurm_answers()
        total = time.perf_counter()
        keys = args.only or list(SCRIPTS)
        if not args.only and not (BENCH / "peers" / ".venv" / "bin" / "python").exists():
            keys.remove("B9")  # its peer's venv is made on purpose, not by make bench
            print("== B9 skipped (its last results stay): no bench/peers/.venv; `bash bench/peers/setup.sh` makes it")
        for key in keys:
            try:
                durations[key] = run(key, slurm)
            except subprocess.CalledProcessError as exc:
                failed.append(f"{key} (exit {exc.returncode})")
        print(f"benchmarks took {time.perf_counter() - total:.0f} s: "
              + ", ".join(f"{k} {v:.0f}s" for k, v in durations.items()))
    DOC.write_text(render())
    print(f"refreshed {DOC}")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
