"""Phase gates of full colocation: rollout, then GenRM, then training, never two at once.

    gate = PhaseGate(world.comm, enabled=plan.mode == "colocate")
    gate.cross("generated")    # every rank of the world, in the same order, once per wave
    gate.cross("scored")

The roles do not call it directly: `roles/protocol.StepProtocol.gate` checks the wave's order and
crosses it.

In colocation the three groups share the same devices, so each heavy phase must finish on every
rank before the next one starts: a world barrier between them. Sends that cross a gate are
non-blocking and drained after it, so a rank waiting at the gate never blocks a sender. The
barrier is polled (Ibarrier + sleep) so waiting ranks leave the cores to the working ones; the rank
that enters it rings the others (`comm/doorbell.py`).
Other modes overlap phases on purpose, and the gate does nothing.
"""
from __future__ import annotations

from yatt_hpc.comm.transport import wait_collective


class PhaseGate:
    def __init__(self, comm, enabled: bool, poll_s: float = 0.002):
        self.comm, self.enabled, self.poll_s = comm, enabled, poll_s

    def cross(self, name: str) -> None:
        """`name` documents the call site; every rank crosses the same gates in the same order."""
        if self.enabled:
            wait_collective(self.comm, self.comm.Ibarrier(), self.poll_s, f"gate {name}")
