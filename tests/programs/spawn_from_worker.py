"""Start a `spawn` child from a process whose main module is `yatt_hpc.runtime.worker`, as a rank's engine does.

    python -m tests.programs.spawn_from_worker DIR    # the child reports to DIR/child-<pid>.json; exits with its code

A rank runs `python -m yatt_hpc.runtime.worker`, which makes the worker `__main__`. Here the imported
worker module takes that place instead (main() never runs, so neither does MPI): multiprocessing's
spawn preparation reads only `__main__.__spec__.name`, so the child re-runs the worker module as
`__mp_main__` exactly as an engine's child in a rank does.
"""
import multiprocessing
import sys

import yatt_hpc.runtime.worker as worker
from tests.programs import engine_child


def main(directory: str) -> int:
    sys.modules["__main__"] = worker
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=engine_child.serve, args=(child_end, directory))
    child.start()
    child_end.close()
    if not parent_end.poll(120):
        child.kill()
        print(f"the spawn child {child.pid} did not report within 120 s", file=sys.stderr)
        return 3
    parent_end.recv()
    parent_end.close()  # the child's wait ends
    child.join(60)
    return child.exitcode if child.exitcode is not None else 4


if __name__ == "__main__":
    _program = sys.modules["__main__"]  # keep this module alive once the worker takes its place
    sys.exit(main(sys.argv[1]))
