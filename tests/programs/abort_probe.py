"""MPI probe for the in-flight abort of over-dispatch: a STOP reaches a rank while its engine generates.

    mpirun -np 2 python tests/programs/abort_probe.py MODEL_DIR OUT_DIR

Rank 0 plays GenRM: it sends TAG_STOP for owner 7 and for nobody else. Rank 1 generates two chunks
with a real HF engine under the rollout rank's `StopWatch`: one of owner 7 only (the engine must be
aborted: rows come back `abort`), one of owners 7 and 8 (owner 8 still wants its samples: the
chunk runs to the end). It writes what it saw to OUT_DIR/abort.json.
"""
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from yatt_hpc.comm.transport import TAG_STOP, send_ints, wait_for_message
from yatt_hpc.roles.rollout import StopWatch
from yatt_hpc.rollout import GenerationRequest, build_engine


def main() -> None:
    comm = MPI.COMM_WORLD
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    if comm.Get_rank() == 0:
        for _ in range(2):
            send_ints(comm, 1, TAG_STOP, [7])
            comm.Barrier()  # the STOP is pending before rank 1 starts the chunk
            comm.Barrier()  # rank 1 is done with the chunk
        return
    engine = build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0)
    requests = [GenerationRequest(sample_id=i, prompt_ids=np.array([5, 6, 7]), max_new_tokens=56) for i in range(32)]
    seen = {}
    for name, owners in (("alone", {7}), ("shared", {7, 8})):
        comm.Barrier()
        wait_for_message(comm, 0, TAG_STOP)
        stops, stopped = [], set()

        def on_stop(owner: int, stops=stops, stopped=stopped) -> None:
            stops.append(owner)
            stopped.add(owner)

        with StopWatch(comm, engine).beside(on_stop, owners, stopped):
            done = engine.generate(requests)
        seen[name] = {"stops": stops, "finish": [r.finish_reason for r in done],
                      "tokens": [len(r.response_ids) for r in done]}
        comm.Barrier()
    engine.shutdown()
    (out / "abort.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
