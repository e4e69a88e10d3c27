"""The child process of the spawning stand-in engine (tests/programs/spawning_engine.py); standard library only.

    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=engine_child.serve, args=(conn, "DIR")); child.start()   # DIR/child-<pid>.json

A `spawn` child re-runs its parent's main module as `__mp_main__` before it unpickles `serve`, as
SGLang's scheduler and detokenizer do. `serve` writes what that re-run left behind (mpi4py
imported or not, the main module, the blocked signals, the MPI/PMIx identity it inherited) to the
DIR/child-<pid>.json, says "ready" on `conn`, and waits until its parent closes the pipe or dies.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

# the variables through which MPI_Init in a child would join the parent's world as the parent's rank
_IDENTITY = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_NAMESPACE", "SLURM_PROCID")


def report() -> dict:
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "main_module": getattr(spec, "name", None),
        "main_has_main": callable(getattr(main, "main", None)),
        "mpi4py_imported": "mpi4py" in sys.modules,
        "mpi4py_MPI_imported": "mpi4py.MPI" in sys.modules,
        "torch_imported": "torch" in sys.modules,
        "blocked": sorted(signal.Signals(s).name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "identity": {k: os.environ[k] for k in _IDENTITY if k in os.environ},
    }


def serve(conn, directory: str) -> None:
    out_path = os.path.join(directory, f"child-{os.getpid()}.json")
    tmp = f"{out_path}.tmp"
    with open(tmp, "w") as out:
        json.dump(report(), out)
    os.replace(tmp, out_path)
    conn.send("ready")
    with contextlib.suppress(EOFError):
        conn.recv()  # nothing is ever sent: returns when the parent closes its end or dies
