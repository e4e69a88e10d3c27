"""B15: at s = 1 with over-dispatch, how many sampled tokens do partial rollouts keep that aborting throws away,
and what does it do to the step time?

    .venv/bin/python bench/partial_rollouts.py                   # both workloads, 3 runs per mode, 8 steps each

Real `yatt-hpc run`s in `disjoint` placement, one rank and one thread per group (B14's layout), rule reward,
rollout.max_staleness=1 and rollout.over_dispatch_ratio=1.5 (a step needs k groups and dispatches 1.5 k).
Two workloads:

    demo       the trained demo policy (B14's shape: 32 prompts x 8 samples, up to 24 tokens): its responses
               all end within a few tokens of each other (no long tail)
    long-tail  a random tiny policy whose P(eos) is 2% per token (near-geometric lengths, mean ~50), 16 prompts
               x 8 samples of up to 128 tokens

Modes take turns, the same config otherwise:

    abort-chunks   once k groups are scored the rest are dropped and their prompts generated again later; groups
                   are generated a chunk (stream_chunk = 8 samples: one group) at a time, so the dropped ones are
                   mostly not started yet (demo only: one engine call per group is slow on the long tail)
    abort-wave     the same with rollout.streaming=finished_groups: the whole wave in one engine call, the
                   samples still running when k groups are scored aborted (their tokens thrown away)
    partial        rollout.partial_rollouts with its default segment (max_new_tokens / 4), the whole wave per
                   segment (stream_chunk = 512): the rest are paused at a segment boundary and continued
    partial-seg2   (demo) the same with 2-token segments

Per run, over the steps that generate after the first two (the bootstrap waves; the last step generates
nothing): tokens the engine sampled per step (`rollout/generated_tokens`, kept or not), tokens trained per
step, their ratio (1.0 = nothing sampled in vain), the median step and rollout time; for partial rollouts also
the tokens dispatched again instead of sampled afresh (`partial/kept_tokens`: paused samples' and those of
complete groups beyond the step's need), the samples paused, continued and dropped, and the trained samples'
mean version span. Report only (no target). Writes bench/results/partial_rollouts.json.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from async_overlap import overlap_sets, run
from common import print_table, row, spread, write_report

WHOLE_WAVE = "rollout.stream_chunk=512"
PARTIAL = ["rollout.partial_rollouts=true", WHOLE_WAVE]
MODES = {"demo": {"abort-chunks": [], "abort-wave": ["rollout.streaming=finished_groups"], "partial": PARTIAL,
                  "partial-seg2": [*PARTIAL, "rollout.partial_segment_tokens=2"]},
         "long-tail": {"abort-wave": ["rollout.streaming=finished_groups"], "partial": PARTIAL}}
SHAPE = {"demo": (32, 8, 24), "long-tail": (16, 8, 128)}  # prompts, samples, max new tokens


def build_tail_policy(root: Path) -> str:
    from yatt_hpc.demo.tiny_models import char_gpt2, save_char_model, set_eos_rate

    model = char_gpt2(n_embd=64, n_positions=512, seed=0)
    set_eos_rate(model, 0.02)
    return save_char_model(model, root / "policy")


def sets_of(args, workload: str, mode: str, policy: str) -> list[str]:
    args.prompts, args.samples, args.max_new_tokens = SHAPE[workload]
    model = [f"model.path={policy}"] if workload == "long-tail" else []
    return [*overlap_sets(args, 1), *model, "rollout.over_dispatch_ratio=1.5", *MODES[workload][mode]]


def measure(rows: list[dict], samples: int) -> dict[str, float]:
    trained = statistics.mean(r["rollout/response_len_mean"] * samples for r in rows)
    generated = statistics.mean(r["rollout/generated_tokens"] for r in rows)
    out = {"generated": generated, "trained": trained, "ratio": generated / trained,
           "step": statistics.median(r["time/step"] for r in rows),
           "rollout": statistics.median(r["time/rollout"] for r in rows)}
    if "partial/kept_tokens" in rows[0]:
        for key in ("kept_tokens", "paused", "continued", "dropped", "version_span_mean"):
            out[key] = statistics.mean(r[f"partial/{key}"] for r in rows)
    return out


LABELS = [("generated", "tokens sampled per step", 1), ("trained", "tokens trained per step", 1),
          ("ratio", "sampled / trained", 3), ("step", "step (s)", 3), ("rollout", "rollout phase (s)", 3),
          ("kept_tokens", "tokens dispatched again, not resampled, per step", 1),
          ("paused", "samples paused per step", 2), ("continued", "samples continued per step", 2),
          ("dropped", "samples dropped (too old) per step", 2),
          ("version_span_mean", "trained samples' mean version span", 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--workloads", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="partial-rollouts-"))
    got = {w: {m: [] for m in MODES[w]} for w in args.workloads}
    rows, verdicts = [], []
    try:
        policy = build_tail_policy(root) if "long-tail" in args.workloads else ""
        for workload in args.workloads:
            for turn in range(args.repeats):
                for mode in MODES[workload]:
                    runs = run(root / f"{workload}-{mode}-{turn}", sets_of(args, workload, mode, policy))
                    got[workload][mode].append(measure(runs[2:-1], SHAPE[workload][0] * SHAPE[workload][1]))
            series = {m: {k: [x[k] for x in got[workload][m]] for k in got[workload][m][0]} for m in MODES[workload]}
            rows += [row(f"{workload}, {mode}: {label}", spread(series[mode][key]), digits=digits)
                     for key, label, digits in LABELS for mode in MODES[workload] if key in series[mode]]
            med = {m: {k: statistics.median(v) for k, v in series[m].items()} for m in MODES[workload]}
            verdicts.append(f"{workload}: sampled/trained " + ", ".join(f"{m} {med[m]['ratio']:.2f}" for m in med)
                            + "; step " + ", ".join(f"{m} {med[m]['step']:.3f} s" for m in med))
        print_table("B15: partial rollouts vs abort at s = 1, over-dispatch 1.5", ["", "median [min-max] (n)"],
                    [[r["label"], r["value"]] for r in rows])
        write_report("partial_rollouts", question="At s = 1 with over-dispatch, how many sampled tokens do partial "
                     "rollouts keep that aborting throws away, and what does it do to the step time?",
                     target="report", met=None, verdict="; ".join(verdicts), rows=rows,
                     raw={"runs": got, "args": vars(args)},
                     notes="disjoint placement, one rank and one thread per group; rollout.max_staleness=1, "
                           "over-dispatch 1.5; modes take turns; the first two steps of each run dropped (the "
                           "bootstrap waves) and the last (it generates nothing)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
