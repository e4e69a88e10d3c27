"""A finished (or running) run at a glance: RUN_DIR/report.png and a text summary.

    yatt-hpc report runs/demo

Reads RUN_DIR/metrics.jsonl (written by the leader next to the TensorBoard events); draws reward
and accuracy (and each validated source's held-out accuracy at its rounds), KL and entropy, and the
phase times per step.
"""
from __future__ import annotations

import json
from pathlib import Path


class ReportError(Exception):
    """The run directory has nothing to report yet."""


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist: is {run_dir} a yatt-hpc run directory, and has a step finished?")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write; the others still tell the story
    if not rows:
        raise ReportError(f"{path} has no finished steps yet")
    return rows


def write_report(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]

    def col(key):
        return [r.get(key, float("nan")) for r in rows]

    fig, axes = plt.subplots(1, 4, figsize=(21, 4))
    axes[0].plot(steps, col("reward/mean"), label="reward/mean")
    axes[0].plot(steps, col("reward/accuracy"), label="reward/accuracy (rule)")
    axes[0].plot(steps, col("reward/genrm_agreement"), label="genrm agreement", alpha=0.6)
    for key in sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/accuracy")}):
        seen = [(r["step"], r[key]) for r in rows if key in r]  # validation rounds: markers at their steps
        axes[0].plot([s for s, _ in seen], [v for _, v in seen], marker="o", label=key)
    axes[0].set_title("reward (val/: held-out accuracy)")
    axes[1].plot(steps, col("train/kl"), label="train/kl")
    axes[1].plot(steps, col("train/entropy"), label="train/entropy")
    axes[1].set_title("policy")
    bottom = [0.0] * len(rows)
    for phase in ("rollout", "reward", "train", "weight_sync"):
        values = [v if v == v else 0.0 for v in col(f"time/{phase}")]
        axes[2].bar(steps, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[2].plot(steps, col("time/step"), color="black", label="step wall")
    axes[2].set_title("phase seconds per step")
    for ax in axes[:3]:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    draw_timeline(axes[3], Path(run_dir), step=rows[-1]["step"] - 1)
    fig.tight_layout()
    out = Path(run_dir) / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


PHASE_COLORS = {"rollout": "tab:blue", "reward": "tab:orange", "train": "tab:green", "weight_sync": "tab:red",
                "balance": "tab:purple", "resume": "tab:gray", "release": "tab:brown", "eval": "tab:olive"}


def read_timeline(run_dir: Path, step: int) -> list[tuple[str, str, float, float]]:
    """(rank label, phase, start, end) of one step from RUN_DIR/timeline/rank-*.jsonl."""
    events = []
    for path in sorted((Path(run_dir) / "timeline").glob("rank-*.jsonl")):
        label = path.stem.removeprefix("rank-")
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev["step"] == step:
                events.append((label, ev["phase"], ev["start"], ev["end"]))
    return events


def draw_timeline(ax, run_dir: Path, step: int) -> None:
    """One row per rank, one bar per phase, seconds from the step's first event."""
    events = read_timeline(run_dir, step)
    ax.set_title(f"phase timeline of step {step + 1}")
    if not events:
        ax.text(0.5, 0.5, "no timeline recorded", ha="center")
        return
    t0 = min(e[2] for e in events)
    labels = sorted({e[0] for e in events})
    for label, phase, start, end in events:
        ax.barh(labels.index(label), end - start, left=start - t0, color=PHASE_COLORS.get(phase, "black"))
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("seconds")
    handles = [plt_patch(c, p) for p, c in PHASE_COLORS.items() if any(e[1] == p for e in events)]
    ax.legend(handles=handles, fontsize=8)


def plt_patch(color: str, label: str):
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)


def text_summary(run_dir: Path) -> str:
    every = read_metrics(run_dir)
    rows = [r for r in every if "reward/mean" in r]  # not the validation before step 1
    if not rows:
        raise ReportError(f"{Path(run_dir) / 'metrics.jsonl'} has no finished steps yet")
    k = min(5, len(rows))
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    acc_first = sum(r["reward/accuracy"] for r in rows[:k]) / k
    acc_last = sum(r["reward/accuracy"] for r in rows[-k:]) / k
    step_s = sum(r["time/step"] for r in rows) / len(rows)
    return (f"{len(rows)} steps; reward first {k}: {first:.3f} -> last {k}: {last:.3f} (gain {last - first:+.3f}); "
            f"accuracy {acc_first:.3f} -> {acc_last:.3f}; mean step {step_s:.2f}s{_val_summary(every)}")


def _val_summary(rows: list[dict]) -> str:
    """`; val <source> accuracy a -> b (pass@n c)` of each validated source, first and last round."""
    parts = []
    for key in sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/accuracy")}):
        seen = [r for r in rows if key in r]
        name = key.removeprefix("val/").removesuffix("/accuracy")
        passes = sorted((int(k.rsplit("@", 1)[1]), k) for k in seen[-1] if k.startswith(f"val/{name}/pass@"))
        tail = f" (pass@{passes[-1][0]} {seen[-1][passes[-1][1]]:.3f})" if passes else ""
        parts.append(f"; val {name} accuracy {seen[0][key]:.3f} -> {seen[-1][key]:.3f}{tail}")
    return "".join(parts)
