"""MPI probe for the step protocol's run-time check: one rank walks a wave the others do not.

    mpirun -np 4 python tests/programs/protocol_probe.py CONFIG OUT_DIR [DIVERGENT_RANK]

Every rank builds the demo plan (colocate: 2 trainers, 1 rollout, 1 GenRM) and a checking
`StepProtocol`, then walks one step as the loop and the roles do. DIVERGENT_RANK (if given) skips the
wave's gates and goes straight to the wave agreement, as a controller with a protocol bug would.
Each rank writes OUT_DIR/rank-N.json: "ok", or the ProtocolDivergence message it raised.
"""
import json
import sys
from pathlib import Path

from mpi4py import MPI

from yatt_hpc.config import load_config
from yatt_hpc.placement import plan
from yatt_hpc.roles.protocol import GENERATED, SCORED, ProtocolDivergence, StepProtocol


def main() -> None:
    comm = MPI.COMM_WORLD
    config, out = sys.argv[1], Path(sys.argv[2])
    divergent = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    protocol = StepProtocol(comm, plan(load_config(config)), check=True)
    result = "ok"
    try:
        protocol.begin_step(0)
        protocol.agree_stop(0)

        def wave() -> bool:
            if comm.Get_rank() != divergent:
                protocol.gate(GENERATED)
                protocol.gate(SCORED)
            return False

        protocol.waves(wave)
        protocol.report({"rank": comm.Get_rank()})
        protocol.end_step()
    except ProtocolDivergence as err:
        result = str(err)
    (out / f"rank-{comm.Get_rank()}.json").write_text(json.dumps(result))
    protocol.close()


if __name__ == "__main__":
    main()
