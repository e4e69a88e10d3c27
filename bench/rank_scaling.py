"""B8: step time of the data plane + controllers vs number of ranks (2, 4, 8) at a fixed per-rank load.

    .venv/bin/python bench/rank_scaling.py                        # 2/4/8 ranks, 3 runs each, 15 steps per run
    .venv/bin/python bench/rank_scaling.py --ranks 2 4 --samples 128 --repeats 1

Weak scaling with synthetic payloads (the tiny models would hide the data plane): every rank owns
S samples a step (~256 prompt + LogNormal(log 800, 0.8) response tokens with logprobs, fresh
lengths every step) and runs the controllers' communication with the real code, no model:

  agree    the stop agreement (Allreduce MAX of a stop code), as StepLoop.agree_stop
  score    its shard to the "GenRM" rank (r+1) mod N and back to the owner, isend_batch/recv_batch
  balance  Rebalancer.rebalance: allgather of group workloads, Karmarkar-Karp, whole groups point to point
  report   a small per-rank report gathered on the leader (never samples)

Per step: wall time (barrier to barrier, the slowest rank) and per-rank CPU seconds. This machine
has 2 cores: past 2 ranks the ranks share cores, so wall time grows with oversubscription even if
the algorithm is flat; CPU seconds per rank per step is the figure that says whether per-rank work
grows with N. Prints a rich table, writes bench/results/rank_scaling.json and rank_scaling.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, RESULTS, mpi_env, mpirun_argv, print_table, row, spread, write_report

PHASES = ("agree", "score", "balance", "report")


def shard(rank: int, step: int, samples: int, n: int):
    from yatt_hpc.batch import SampleBatch

    rng = np.random.default_rng([rank, step])
    plen = rng.integers(128, 385, samples).astype(np.int32)
    rlen = np.clip(rng.lognormal(np.log(800), 0.8, samples), 1, 8192).astype(np.int32)
    first = (step * 10_000 + rank * samples)  # global sample ids: unique over ranks and steps
    sid = np.arange(first, first + samples, dtype=np.int64)
    return SampleBatch(sample_id=sid, prompt_id=sid // n, owner=np.full(samples, rank, np.int32), prompt_len=plen,
                       prompt_tokens=rng.integers(0, 150000, plen.sum(), dtype=np.int32), response_len=rlen,
                       response_tokens=rng.integers(0, 150000, rlen.sum(), dtype=np.int32),
                       logprobs=rng.standard_normal(rlen.sum()).astype(np.float32),
                       answer_len=np.full(samples, 8, np.int32), answer=np.zeros(8 * samples, np.uint8))


def exchange(comm, batch, dest: int, source: int, tag: int):
    from mpi4py import MPI

    from yatt_hpc.comm.transport import isend_batch, recv_batch

    requests, _buffers = isend_batch(comm, dest, tag, batch)
    got, _ = recv_batch(comm, source, tag)
    MPI.Request.Waitall(requests)
    return got


def worker(args) -> None:
    from mpi4py import MPI

    from yatt_hpc.comm.rebalance import Rebalancer
    from yatt_hpc.sched.balance import flops_coeff

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    balancer = Rebalancer(comm, comm, list(range(size)), a=flops_coeff(4096, 0))
    walls, cpus, phases = [], [], {p: [] for p in PHASES}
    for step in range(args.warmup + args.steps):
        batch = shard(rank, step, args.samples, 8)
        comm.Barrier()
        wall0, cpu0, mark = time.perf_counter(), time.process_time(), {}
        t = time.perf_counter()
        stop = np.zeros(1, np.int64)
        comm.Allreduce(MPI.IN_PLACE, stop, op=MPI.MAX)
        mark["agree"], t = time.perf_counter() - t, time.perf_counter()
        to_score = exchange(comm, batch, (rank + 1) % size, (rank - 1) % size, 12)
        to_score.reward = (to_score.response_len % 7).astype(np.float32)  # "scoring": no model
        batch = exchange(comm, to_score, (rank - 1) % size, (rank + 1) % size, 13)
        mark["score"], t = time.perf_counter() - t, time.perf_counter()
        batch, info = balancer.rebalance(batch)
        mark["balance"], t = time.perf_counter() - t, time.perf_counter()
        comm.gather({"samples": len(batch), "after": info.after}, root=0)
        mark["report"] = time.perf_counter() - t
        cpu = time.process_time() - cpu0
        comm.Barrier()
        wall = time.perf_counter() - wall0
        if step >= args.warmup:
            walls.append(wall)
            cpus.append(cpu)
            for p in PHASES:
                phases[p].append(mark[p])
    per_rank = comm.gather({"cpu": cpus, "phases": phases}, root=0)
    if rank == 0:
        args.out.write_text(json.dumps({"ranks": size, "wall": walls, "per_rank": per_rank,
                                        "bytes_per_rank": batch.nbytes}))


def run_once(ranks: int, args, out: Path) -> dict:
    argv = mpirun_argv(ranks, Path(__file__).resolve(), "--worker", "--out", str(out), "--samples", str(args.samples),
                       "--steps", str(args.steps), "--warmup", str(args.warmup))
    subprocess.run(argv, env=mpi_env(), check=True, timeout=600)
    return json.loads(out.read_text())


def summarize(runs: list[dict]) -> dict:
    """Per run: median step wall; median over ranks of each rank's median CPU s and phase s; then spread over runs."""
    wall = spread([statistics.median(r["wall"]) for r in runs])
    cpu = spread([statistics.median(statistics.median(p["cpu"]) for p in r["per_rank"]) for r in runs])
    phases = {ph: spread([statistics.median(max(p["phases"][ph][i] for p in r["per_rank"]) for i in range(len(r["wall"])))
                          for r in runs]) for ph in PHASES}
    return {"wall_s": wall, "cpu_s": cpu, "phases_s": phases, "mib_per_rank": runs[0]["bytes_per_rank"] / 2**20}


def plot(summary: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(summary)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("wall_s", "step wall time (slowest rank)"), ("cpu_s", "CPU time per rank per step")):
        med = [summary[n][key]["median"] * 1e3 for n in ranks]
        lo = [m - summary[n][key]["min"] * 1e3 for m, n in zip(med, ranks)]
        hi = [summary[n][key]["max"] * 1e3 - m for m, n in zip(med, ranks)]
        ax.errorbar(ranks, med, yerr=[lo, hi], marker="o", capsize=4, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(n) for n in ranks])
    ax.set_xlabel("ranks (2 cores: oversubscribed past 2)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"B8 data plane + controllers, {summary[ranks[0]]['mib_per_rank']:.1f} MiB per rank per step")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--samples", type=int, default=256, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    runs: dict[int, list[dict]] = {n: [] for n in args.ranks}
    with tempfile.TemporaryDirectory(prefix="rank_scaling_") as tmp:
        for i in range(args.repeats):  # rank counts take turns so load changes hit them alike
            for n in args.ranks:
                runs[n].append(run_once(n, args, Path(tmp) / f"{n}-{i}.json"))
    summary = {n: summarize(r) for n, r in runs.items()}
    table, rows = [], []
    ms = lambda d: f"{d['median'] * 1e3:.1f} [{d['min'] * 1e3:.1f}-{d['max'] * 1e3:.1f}]"  # noqa: E731
    for n, s in summary.items():
        table.append([str(n), ms(s["wall_s"]), ms(s["cpu_s"]),
                      *[f"{s['phases_s'][p]['median'] * 1e3:.1f}" for p in PHASES]])
        rows += [row(f"{n} ranks: step wall", {k: v * 1e3 if k != "n" and k != "values" else v
                                                 for k, v in s["wall_s"].items()}, " ms", 1),
                 row(f"{n} ranks: CPU per rank per step", {k: v * 1e3 if k not in ("n", "values") else v
                                                           for k, v in s["cpu_s"].items()}, " ms", 1)]
    first, last = min(args.ranks), max(args.ranks)
    print_table(f"B8 weak scaling, {summary[first]['mib_per_rank']:.1f} MiB per rank per step, "
                f"{args.steps} steps x {args.repeats} runs (ms; phases: slowest rank, median step)",
                ["ranks", "step wall", "CPU/rank", *PHASES], table)
    png = RESULTS / "rank_scaling.png"
    plot(summary, png)
    wall_ratio = summary[last]["wall_s"]["median"] / summary[first]["wall_s"]["median"]
    cpu_ratio = summary[last]["cpu_s"]["median"] / summary[first]["cpu_s"]["median"]
    verdict = (f"{first} -> {last} ranks: step wall x{wall_ratio:.2f}, CPU per rank x{cpu_ratio:.2f} "
               f"(flat = x1.00; {last} ranks share 2 cores, so wall includes {last // 2}x oversubscription); plot "
               f"{png.relative_to(REPO)}")
    write_report("rank_scaling", question="B8 step time vs ranks (2, 4, 8), fixed per-rank load, data plane + controllers",
                 target="report the curve; flat is the goal", met=None, verdict=verdict, rows=rows,
                 raw={"args": vars(args) | {"out": None}, "summary": summary, "runs": runs},
                 notes="Synthetic token payloads, no models; all ranks on one 2-core host (shared memory transport).")


if __name__ == "__main__":
    main()
