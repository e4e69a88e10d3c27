"""Long responses: the trainer rank's peak memory and update time of a GRPO run whose responses are all
`--length` tokens, with and without activation recomputation and token-budget micro-batches.

    .venv/bin/python bench/long_responses.py                       # 4,000-token responses, ~8 min on 2 busy cores
    .venv/bin/python bench/long_responses.py --length 2000 --steps 1 --only plain budget+full

Each variant is a real `yatt-hpc run` (tests/programs/long_responses.py: a random tiny GPT-2 with no
end-of-sequence token, so every response is exactly `--length` tokens; `--prompts` groups of `--samples`; one
trainer rank, the shared-prompt forward) in a run directory of its own. Reported per variant, from
metrics.jsonl: `memory/peak_rss_mb/trainer` (the trainer process's ru_maxrss, its ~370 MB of torch and
Megatron included) at the last step, `time/train` of the last step (after the first step's warm-up when
`--steps` > 1) and `train/micro_batch_tokens_max`. A fixed micro-batch of 8 samples holds a whole step here.
Prints a table, writes bench/results/long_responses.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the run's config comes from tests/programs/
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PYTHON, REPO, mpi_env, print_table, write_report  # noqa: E402

VARIANTS = {
    "plain": [],
    "selective": ["train.recompute=selective"],
    "full": ["train.recompute=full"],
    "budget": ["train.max_tokens_per_micro_batch={budget}"],
    "budget+full": ["train.recompute=full", "train.max_tokens_per_micro_batch={budget}"],
}


def run_variant(config: Path, run_dir: Path, sets: list[str]) -> dict:
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run([PYTHON, "-m", "yatt_hpc.cli", "run", str(config), "--run-dir", str(run_dir), *args],
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{run_dir.name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    from yatt_hpc.metrics.writer import step_rows

    rows = step_rows(run_dir)
    last = rows[-1]
    return {"peak_rss_mb": max(r["memory/peak_rss_mb/trainer"] for r in rows), "train_s": last["time/train"],
            "micro_batch_tokens_max": last["train/micro_batch_tokens_max"],
            "response_len_mean": last["rollout/response_len_mean"], "steps": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=4000, help="tokens of every response (rollout.max_new_tokens)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget", type=int, default=4096, help="train.max_tokens_per_micro_batch of the budget variants")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = ap.parse_args()
    from tests.programs.long_responses import long_run_config

    results = {}
    with tempfile.TemporaryDirectory(prefix="long_responses_") as tmp:
        config = long_run_config(Path(tmp) / "setup", args.length, prompts=args.prompts, samples=args.samples,
                                 steps=args.steps)
        for name in args.only:
            sets = [s.format(budget=args.budget) for s in VARIANTS[name]]
            results[name] = run_variant(config, Path(tmp) / name, sets) | {"sets": sets}
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    base = results.get("plain")
    table = [[name, f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}" if base else "-",
              f"{r['train_s']:.1f}", f"{r['train_s'] / base['train_s']:.2f}" if base else "-",
              f"{r['micro_batch_tokens_max']:.0f}"] for name, r in results.items()]
    shape = f"{args.prompts} prompts x {args.samples} responses of {args.length} tokens"
    print_table(f"Trainer rank, {shape}", ["variant", "peak RSS MB", "vs plain", "train s", "vs plain",
                                            "largest forward (tokens)"], table)
    best = results.get("budget+full")
    met = None if not (base and best) else best["peak_rss_mb"] < 0.6 * base["peak_rss_mb"]
    verdict = "" if met is None else (
        f"{shape}: trainer peak {best['peak_rss_mb']:.0f} MB with recompute=full and a {args.budget}-token budget "
        f"vs {base['peak_rss_mb']:.0f} MB without ({best['peak_rss_mb'] / base['peak_rss_mb']:.2f}x), train step "
        f"{best['train_s']:.1f} s vs {base['train_s']:.1f} s")
    write_report("long_responses", question=f"How much trainer memory do recomputation and token-budget "
                 f"micro-batches save on {shape}?", target="recompute=full + budget: trainer peak RSS < 0.6x plain",
                 met=met, verdict=verdict,
                 rows=[{"label": name, "value": f"{r['peak_rss_mb']:.0f} MB, train {r['train_s']:.1f} s",
                        "median": r["peak_rss_mb"], "min": r["peak_rss_mb"], "max": r["peak_rss_mb"], "n": 1}
                       for name, r in results.items()],
                 raw={"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
