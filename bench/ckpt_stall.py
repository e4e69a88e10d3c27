"""Training-loop stall per checkpoint save, async vs sync, on the same ~1 GB state (a benchmark, not a test).

    .venv/bin/python bench/ckpt_stall.py                       # 256M fp32 elements, 5 saves per mode
    .venv/bin/python bench/ckpt_stall.py --elements 64e6 --repeats 3 --step-seconds 2 --run-dir /tmp/b
    python3 bench/ckpt_stall.py --device cuda                  # the state on a GPU: snapshot = D2H copy

The "stall" is the time ``CheckpointManager.save`` blocks the loop: the whole write + fsync +
sha256 + commit for ``async_save=False``; waiting for the previous save (if still in flight) plus
the host-memory snapshot for ``async_save=True``. Between saves the loop "trains" for
``--step-seconds`` (a sleep, like a GPU-bound step that leaves the CPU to the writer). The reused
staging buffers are allocated before the loop (``CheckpointManager.prepare``, reported as
"prepare"); without it the first async save pays for faulting them in. Prints a rich table
and writes bench/results/ckpt_stall.json (ckpt_stall_cuda.json with --device cuda).
Target: the async stall >= 30x shorter than sync.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from yatt_hpc.ckpt import CheckpointManager, RankState, SharedState, capture_rng

RESULTS = Path(__file__).resolve().parent / "results" / "ckpt_stall.json"


def build_state(elements: int, device: str = "cpu") -> RankState:
    """Model + AdamW-like optimizer state: 4 tensors of elements/4 fp32 each (~4 bytes/element)."""
    quarter = elements // 4
    model = {"w0": torch.randn(quarter, device=device), "w1": torch.randn(quarter, device=device)}
    optim = {"w0.exp_avg": torch.randn(quarter, device=device), "w0.exp_avg_sq": torch.rand(quarter, device=device)}
    return RankState("trainer/dp0/tp0/pp0", {"dp": 0, "tp": 0, "pp": 0}, model=model, optim=optim,
                     rng=capture_rng(), data_position={"next": 0})


def measure(mode: str, state: RankState, run_dir: Path, repeats: int, step_seconds: float) -> dict:
    stalls, commit_lag = [], []
    mgr = CheckpointManager(run_dir, keep_last=2, async_save=(mode == "async"))
    start = time.perf_counter()
    mgr.prepare(state)  # staging buffers allocated once, outside the loop, as the trainer does
    prepare_s = time.perf_counter() - start
    for step in range(1, repeats + 1):
        time.sleep(step_seconds)  # the training step
        state.model["w0"].add_(1e-3)  # the loop keeps changing its parameters in place
        start = time.perf_counter()
        mgr.save(step, state, SharedState({"step": step}))
        stalls.append(time.perf_counter() - start)
        if mode == "async":
            while mgr.in_flight:
                time.sleep(0.01)
            commit_lag.append(time.perf_counter() - start)  # save() call -> committed on disk
    end = time.perf_counter()
    mgr.close()
    final_wait = time.perf_counter() - end
    return {"mode": mode, "prepare_s": prepare_s, "stall_s": stalls, "median_s": statistics.median(stalls),
            "max_s": max(stalls),
            "save_to_commit_s": commit_lag, "final_wait_s": final_wait}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=float, default=256e6, help="fp32 elements in total (default 256M = 1 GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-seconds", type=float, default=8.0, help="simulated training step between saves")
    ap.add_argument("--run-dir", type=Path, default=None, help="where to write (default: a temp dir, removed)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the state lives")
    args = ap.parse_args()
    results_path = RESULTS if args.device == "cpu" else RESULTS.with_name("ckpt_stall_cuda.json")
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="ckpt_stall_"))
    state = build_state(int(args.elements), args.device)
    nbytes = sum(t.numel() * t.element_size() for t in (*state.model.values(), *state.optim.values()))
    try:
        results = [measure(m, state, root / m, args.repeats, args.step_seconds) for m in ("sync", "async")]
    finally:
        if args.run_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    sync, asyn = results
    ratio = sync["median_s"] / asyn["median_s"]
    report = {"bytes": nbytes, "device": args.device, "repeats": args.repeats, "step_seconds": args.step_seconds,
              "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "host": platform.node(),
              "results": results, "speedup_median": ratio, "target": 30.0, "meets_target": ratio >= 30.0}
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(report, indent=2))
    table = Table(title=f"checkpoint stall per save, {nbytes / 2**30:.2f} GiB state on {args.device}, {args.repeats} saves")
    for col in ("mode", "prepare (s)", "each save (s)", "median (s)", "max (s)", "save->commit (s)"):
        table.add_column(col)
    for r in results:
        lag = " ".join(f"{x:.2f}" for x in r["save_to_commit_s"]) or "-"
        table.add_row(r["mode"], f"{r['prepare_s']:.2f}", " ".join(f"{x:.3f}" for x in r["stall_s"]),
                      f"{r['median_s']:.3f}", f"{r['max_s']:.3f}", lag)
    console = Console()
    console.print(table)
    console.print(f"sync / async median stall: {ratio:.1f}x (target >= 30x: "
                  f"{'met' if ratio >= 30 else 'NOT met'}); JSON: {results_path}")


if __name__ == "__main__":
    main()
