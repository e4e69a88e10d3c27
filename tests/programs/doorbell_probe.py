"""mpirun -np 3 python tests/programs/doorbell_probe.py OUT_DIR {bells,no-bells}: waits end by the peer's bell.

Every wait polls at POLL_S (30 s), so a wait that ended by its poll would have lasted 30 s: with bells,
each rank writes how many of its sleeps a bell ended and how many ran out (`timeouts`), for the test.
Rank 0 is the late one: ranks 1 and 2 wait for its messages and for it at a barrier and a gate."""
import json
import sys
import time
from pathlib import Path

from mpi4py import MPI

from yatt_hpc.comm.doorbell import DOORBELL, launch_nonce
from yatt_hpc.comm.gates import PhaseGate
from yatt_hpc.comm.transport import TAG_COUNT, quiet_barrier, recv_ints, send_ints

ROUNDS = 5


def main(out: Path, mode: str) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    poll_s = 30.0 if mode == "bells" else 0.005
    if mode == "bells":
        DOORBELL.open(comm, comm.bcast(launch_nonce() if rank == 0 else None))
    timeouts = [0]
    real_sleep = DOORBELL.sleep

    def counted_sleep(timeout: float) -> bool:
        rung = real_sleep(timeout)
        timeouts[0] += not rung and timeout >= 1.0  # a full poll: nothing rang for a second or more
        return rung

    DOORBELL.sleep = counted_sleep
    gate = PhaseGate(comm.Dup(), enabled=True, poll_s=poll_s)  # a sub-communicator: ranks translated
    got = []
    for round_ in range(ROUNDS):
        if rank == 0:
            time.sleep(0.05)  # let the others fall asleep first (what the test checks is how they wake)
            for peer in (1, 2):
                send_ints(comm, peer, TAG_COUNT, [round_, peer])
        else:
            values, _ = recv_ints(comm, 0, TAG_COUNT, poll_s=poll_s)
            got.append(values.tolist())
        if rank == 0:
            time.sleep(0.05)
        quiet_barrier(comm, "probe barrier", poll_s)
        if rank == 0:
            time.sleep(0.05)
        gate.cross("probe gate")
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "enabled": DOORBELL.enabled, "rung": DOORBELL.rung, "timeouts": timeouts[0], "got": got,
}))
    DOORBELL.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
