"""Tools and an environment for the agent tests (named in configs as tests.programs.agent_tools:...)."""
from __future__ import annotations

import time


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    a: the first
    b: the second
    """
    return a + b


def fail(x: str) -> str:
    """Always raises."""
    raise RuntimeError(f"broken tool on {x}")


def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "woke"


class CountEnv:
    """Done once the model says the row's answer; reward 1 then, -0.1 per wrong turn."""

    def __init__(self, penalty: float = 0.1) -> None:
        self.penalty, self.answer = penalty, None

    def reset(self, row: dict) -> None:
        self.answer = row["answer"]

    def step(self, text: str):
        if text.strip() == self.answer:
            return None, 1.0, True
        return "try again", -self.penalty, False


BARRIER = __import__("threading").Barrier(2, timeout=2.0)


def meet() -> str:
    """Returns once a second call meets this one (two calls of one turn running together), else fails."""
    BARRIER.wait()
    return "met"


def typo(x: str) -> str:
    """Fails inside with a TypeError of its own."""
    return x + 1


def look_where(k: str) -> str:
    """The demo's `look` tool (yatt_hpc.demo.lookup:look), which also appends the MPI world rank running it to
    the file YATT_TOOL_LOG names: tests/mpi/test_tool_calls.py reads where the calls ran.

    k: the key
    """
    import os

    from yatt_hpc.demo.lookup import look

    path = os.environ.get("YATT_TOOL_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMIX_RANK', '?'))}\n")
    return look(k)


_SEEN = [0]


def look_held(k: str) -> str:
    """The demo's `look`, except that with YATT_TOOL_HOLD=DIR:N in the environment the process's call number N + 1
    writes DIR/holding and then never returns (until DIR/release exists): a tool call the stop must not wait for.

    k: the key
    """
    import os
    from pathlib import Path

    from yatt_hpc.demo.lookup import look

    spec = os.environ.get("YATT_TOOL_HOLD")
    _SEEN[0] += 1
    if spec:
        where, _, after = spec.rpartition(":")
        if _SEEN[0] == int(after) + 1:
            Path(where, "holding").write_text(f"{os.getpid()}\n")
            while not Path(where, "release").exists():
                time.sleep(0.05)
    return look(k)


GATE = __import__("threading").Event()


def gate(wait_s: float) -> str:
    """Returns "opened" once the test sets `GATE` (tests/unit/test_turn_schedule.py opens it from the engine when a
    fast trajectory's last turn is asked for), or "closed" after `wait_s` seconds without it.

    wait_s: the longest wait
    """
    return "opened" if GATE.wait(wait_s) else "closed"


def look_lagging(k: str) -> str:
    """The demo's `look`, taking YATT_TOOL_LAG_S seconds (default 0.5) for one key in four (those whose letters
    sum to 0 mod 4) and no time for the rest: one slow tool call among fast ones, deterministically.

    k: the key
    """
    import os

    from yatt_hpc.demo.lookup import look

    if sum(map(ord, k)) % 4 == 0:
        time.sleep(float(os.environ.get("YATT_TOOL_LAG_S", "0.5")))
    return look(k)
