"""B2: peak host memory of the busiest controller when one step carries ~2 GB of images over 8 ranks.

    .venv/bin/python bench/driver_memory.py                    # 2 GiB per step, 8 ranks, 3 runs per pattern
    .venv/bin/python bench/driver_memory.py --gib 0.5 --ranks 4 --repeats 1

Synthetic payload (the tiny demo models would hide the effect): each rank produces its shard of
uint8 images (3x224x224, what a VLM rollout carries) as a rollout rank would, and the step's samples
must reach their owning trainer rank ((r+1) mod N). Three patterns, each its own `mpirun -np N` so
that `ru_maxrss` is that pattern's high-water mark, per rank:

  driver        the single-driver baseline: Gatherv of every shard onto rank 0 (the driver, which
                writes its own shard in place), a pass over the whole batch there, Scatterv to the
                owners. Implemented as well as it can be (IN_PLACE at the root, no extra copies).
  shard-whole   ours, unstreamed (colocate): each rank sends its whole shard point to point to the
                owner and receives its own; it briefly holds two shards.
  shard-stream  ours, streamed (partial/disjoint, rollout.stream_chunk): shards travel in chunks as
                they are produced; a rank holds its received shard and a chunk or two in flight.

SampleBatch has no image column, so the images travel as raw buffers (what comm/transport.py does per column).
Prints a rich table, writes bench/results/driver_memory.json. Target: busiest rank <= 1/6 of the driver.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from common import mpi_env, mpirun_argv, print_table, row, spread, write_report

IMAGE = (3, 224, 224)
IMAGE_BYTES = int(np.prod(IMAGE))
PATTERNS = ("driver", "shard-whole", "shard-stream")


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def produce(out: np.ndarray, rank: int, first: int) -> None:
    """'Generate' images into out (touches every page, like a decoder writing pixels)."""
    out[...] = (rank * 7 + first) % 251


def run_driver(comm, per_rank: int) -> float:
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    image_t = MPI.BYTE.Create_contiguous(IMAGE_BYTES).Commit()  # counts in images: no 2 GiB int overflow
    counts, displs = [per_rank] * size, [per_rank * r for r in range(size)]
    if rank == 0:
        batch = np.empty((per_rank * size, *IMAGE), np.uint8)  # the whole step's batch on the driver
        produce(batch[:per_rank], 0, 0)
        comm.Gatherv(MPI.IN_PLACE, [batch, counts, displs, image_t], root=0)
        checksum = float(batch[:, 0, 0, :8].astype(np.int64).sum())  # the driver's pass over the batch
        # the owner of shard r is rank r+1: scatter with rotated displacements, no reordering copy
        owner_displs = [per_rank * ((r - 1) % size) for r in range(size)]
        comm.Scatterv([batch, counts, owner_displs, image_t], MPI.IN_PLACE, root=0)
        mine = batch[owner_displs[0]:owner_displs[0] + per_rank].copy()
        del batch
    else:
        shard = np.empty((per_rank, *IMAGE), np.uint8)
        produce(shard, rank, 0)
        comm.Gatherv(shard, None, root=0)
        del shard
        mine = np.empty((per_rank, *IMAGE), np.uint8)
        comm.Scatterv(None, mine, root=0)
        checksum = 0.0
    image_t.Free()
    return checksum + float(mine[:, 0, 0, 0].sum())


def run_shards(comm, per_rank: int, chunk: int) -> float:
    """Our pattern: every rank is the controller of its own shard; no rank ever sees the whole step."""
    rank, size = comm.Get_rank(), comm.Get_size()
    dest, source = (rank + 1) % size, (rank - 1) % size
    mine = np.empty((per_rank, *IMAGE), np.uint8)  # the shard this rank owns (received from source)
    if chunk >= per_rank:  # unstreamed: the whole produced shard exists before it is sent
        produced = np.empty((per_rank, *IMAGE), np.uint8)
        produce(produced, rank, 0)
        comm.Sendrecv(produced, dest=dest, sendtag=1, recvbuf=mine, source=source, recvtag=1)
        del produced
    else:
        pending = []
        for first in range(0, per_rank, chunk):
            part = np.empty((min(chunk, per_rank - first), *IMAGE), np.uint8)
            produce(part, rank, first)
            pending.append((comm.Isend(part, dest=dest, tag=1), part))
            comm.Recv(mine[first:first + len(part)], source=source, tag=1)
            while len(pending) > 2:  # bounded in-flight queue, like StreamSender
                pending.pop(0)[0].Wait()
        for request, _ in pending:
            request.Wait()
    return float(mine[:, 0, 0, 0].sum())


def worker(pattern: str, gib: float, chunk: int, out: Path) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    per_rank = int(gib * 2**30 / IMAGE_BYTES / comm.Get_size())
    idle_mb = rss_mb()
    comm.Barrier()
    start = time.perf_counter()
    run_driver(comm, per_rank) if pattern == "driver" else run_shards(comm, per_rank,
                                                                      per_rank if pattern == "shard-whole" else chunk)
    comm.Barrier()
    seconds = time.perf_counter() - start
    peaks = comm.gather({"peak_rss_mb": rss_mb(), "idle_rss_mb": idle_mb}, root=0)
    if comm.Get_rank() == 0:
        out.write_text(json.dumps({"pattern": pattern, "seconds": seconds, "ranks": peaks,
                                   "step_bytes": per_rank * IMAGE_BYTES * comm.Get_size()}))


def launch(pattern: str, args, tmp: Path, i: int) -> dict:
    out = tmp / f"{pattern}-{i}.json"
    argv = mpirun_argv(args.ranks, Path(__file__).resolve(), "--worker", pattern, "--gib", str(args.gib),
                       "--chunk", str(args.chunk), "--out", str(out))
    subprocess.run(argv, env=mpi_env(), check=True, timeout=600)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes of images per step over all ranks (GiB)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64, help="images per streamed chunk (shard-stream)")
    ap.add_argument("--worker", choices=PATTERNS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.gib, args.chunk, args.out)
    runs: dict[str, list[dict]] = {p: [] for p in PATTERNS}
    with tempfile.TemporaryDirectory(prefix="driver_memory_") as tmp:
        for i in range(args.repeats):  # patterns take turns so load changes hit them alike
            for pattern in PATTERNS:
                runs[pattern].append(launch(pattern, args, Path(tmp), i))
    stats, table = {}, []
    for pattern, results in runs.items():
        busiest = spread([max(r["peak_rss_mb"] for r in res["ranks"]) for res in results])
        idle = spread([max(r["idle_rss_mb"] for r in res["ranks"]) for res in results])
        seconds = spread([res["seconds"] for res in results])
        per_rank = [round(r["peak_rss_mb"]) for r in results[-1]["ranks"]]
        stats[pattern] = {"busiest_peak_mb": busiest, "idle_mb": idle, "seconds": seconds, "per_rank_last": per_rank}
        table.append([pattern, f"{busiest['median']:.0f} [{busiest['min']:.0f}-{busiest['max']:.0f}]",
                      f"{idle['median']:.0f}", " ".join(map(str, per_rank)), f"{seconds['median']:.2f}"])
    base = stats["driver"]["busiest_peak_mb"]["median"]
    ratios = {p: spread([max(r["peak_rss_mb"] for r in a["ranks"]) / max(r["peak_rss_mb"] for r in b["ranks"])
                         for a, b in zip(runs[p], runs["driver"])]) for p in PATTERNS[1:]}
    step_gib = runs["driver"][0]["step_bytes"] / 2**30
    print_table(f"B2 peak RSS (MiB) of the busiest rank, {step_gib:.2f} GiB of images per step, "
                f"{args.ranks} ranks, {args.repeats} runs each",
                ["pattern", "busiest peak median [min-max]", "idle (imports)", "per rank (last run)", "step s"], table)
    target = 1 / 6
    best = ratios["shard-stream"]["median"]
    met = best <= target
    verdict = (f"busiest rank / driver: shard-stream {best:.3f}, shard-whole {ratios['shard-whole']['median']:.3f} "
               f"(target <= {target:.3f}: {'met' if met else f'NOT met, by {best / target:.2f}x'}); "
               f"driver busiest = {base:.0f} MiB")
    rows = [row(f"{p} busiest-rank peak RSS", stats[p]["busiest_peak_mb"], " MiB", 0) for p in PATTERNS]
    rows += [row(f"{p} / driver", ratios[p]) for p in PATTERNS[1:]]
    write_report("driver_memory", question=f"B2 peak host memory of the busiest controller, {step_gib:.2f} GiB "
                 f"of images per step over {args.ranks} ranks", target="ours <= 1/6 of the single driver",
                 met=met, verdict=verdict, rows=rows, raw={"args": vars(args) | {"out": None}, "stats": stats,
                                                          "ratios": ratios, "runs": runs},
                 notes=f"Synthetic uint8 images; every rank's RSS includes ~{stats['driver']['idle_mb']['median']:.0f} MiB "
                       "of Python + numpy + mpi4py before any payload.")


if __name__ == "__main__":
    main()
