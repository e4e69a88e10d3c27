"""One MPI rank (`mpirun -np 1`): a GenRM controller with three sample batches already waiting for it.

    mpirun -np 1 python tests/programs/genrm_backlog_probe.py OUT.json CAP [SET ...]

The batches (two for trainer replica 0, one for replica 1) are sent to this rank itself before it
looks, so all three are pending; `arrivals` may take up to CAP rows. Writes what `arrivals` took,
the judge engine's calls, and the scores of the batches taken together next to each scored alone
(tests/unit/test_genrm_backlog.py).
"""
from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

import numpy as np
from mpi4py import MPI

REPO = Path(__file__).resolve().parents[2]


def main(out: str, cap: int, sets: list[str]) -> None:
    import torch

    from tests.unit.test_reward_controller import _batch, _recording
    from yatt_hpc.comm.transport import TAG_SAMPLES, StreamSender, isend_batch, recv_batch
    from yatt_hpc.config import load_config
    from yatt_hpc.data.tokenizer import load_tokenizer
    from yatt_hpc.demo.task import demo_rows, near_miss
    from yatt_hpc.placement import plan
    from yatt_hpc.roles.genrm import GenRMController
    from yatt_hpc.runtime.rank_stats import RankStats
    from yatt_hpc.sched.overdispatch import ReplicaWave

    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs/demo_cpu.yaml", ["placement.mode=partial", *sets])
    world = types.SimpleNamespace(plan=plan(cfg), rank=0, group="genrm", group_rank=0, comm=MPI.COMM_WORLD,
                                  is_leader=False)
    ctl = GenRMController(world, cfg, RankStats("genrm"), None)
    calls: list = []
    ctl.judge.engine.generate = _recording(ctl.judge.engine.generate, calls)
    rows = demo_rows(seed=3, count=24, split="heldout")
    rng = random.Random(5)
    batch = _batch(rows, [r["answer"] if i % 3 else near_miss(r["answer"], rng) for i, r in enumerate(rows)],
                   load_tokenizer(REPO / "models/demo/policy"))
    batch.prompt_id = np.arange(24) // 4  # 6 groups of 4 samples
    batch.owner = (np.arange(24) >= 16).astype(np.int32)  # groups 0-3: replica 0, groups 4-5: replica 1
    parts = [batch.select(np.arange(a, b)) for a, b in ((0, 8), (8, 16), (16, 24))]
    alone = [ctl.score(p.select(np.arange(len(p)))).reward.tolist() for p in parts]
    calls.clear()
    pending = [isend_batch(MPI.COMM_WORLD, 0, TAG_SAMPLES, p) for p in parts]
    arrived = ctl.arrivals(cap)
    left = 0
    while MPI.COMM_WORLD.Iprobe(source=0, tag=TAG_SAMPLES):  # what arrivals left waiting: received here
        recv_batch(MPI.COMM_WORLD, 0, TAG_SAMPLES)
        left += 1
    for requests, _ in pending:
        MPI.Request.Waitall(requests)
    got = {"taken": [len(b) for _, b, _ in arrived], "left": left, "calls": [len(c) for c in calls]}
    if len(arrived) == len(parts):  # score them as score_wave does: one call, each replica its share
        waves = {o: ReplicaWave(keep=8, n=4, expected={0: 32}, handshake=False) for o in (0, 1)}  # not complete yet
        shares = {0: [], 1: []}
        for owner, b, source in arrived:
            waves[owner].on_samples(source, len(b))
        ctl.score_arrived({0: [b for _, b, _ in arrived[:2]], 1: [arrived[2][1]]}, waves, shares,
                          StreamSender(MPI.COMM_WORLD, 2))
        got.update(calls=[len(c) for c in calls], together={o: [x.sample_id.tolist() for x in shares[o]] for o in shares},
                   rewards={o: [x.reward.tolist() for x in shares[o]] for o in shares}, alone=alone,
                   scored_groups={o: sorted(waves[o].scored_groups) for o in waves})
    Path(out).write_text(json.dumps(got))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
