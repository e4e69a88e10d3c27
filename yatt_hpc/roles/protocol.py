"""The step protocol: every world-wide agreement, gate and report of one step, declared once here.

    protocol = StepProtocol(world.comm, world.plan, check=True)   # one per rank; the worker builds it
    protocol.begin_step(step)                     # the loop, then its agreements:
    code = protocol.agree_stop(code)              #   stop?        (every step)
    pending = protocol.agree_split(pending)       #   split        (placement.dynamic_split only)
    protocol.waves(controller.wave)               # every role walks the waves the same way:
        protocol.gate(GENERATED) ... protocol.gate(SCORED)     # inside a wave (colocate; no-op otherwise)
    reports = protocol.report(mine)               # the loop: the step report to the leader
    protocol.save_barrier()                       # the loop, when a save is due
    protocol.end_step()                           # the trace of the step must match STEP

Every rank of the world, whatever its role, takes exactly this sequence of collectives per step
(`STEP`; `WAVE` repeats until no trainer replica asks for another wave):

    agree stop      Iallreduce MAX of the ranks' stop codes                           loop
    agree split     bcast of the leader's engine-pool split   (dynamic split only)    loop
    WAVE, 1 or more times:                                                           roles
      gate generated  Ibarrier: every sample of the wave is generated     (colocate only)
      gate scored     Ibarrier: every sample of the wave is scored        (colocate only)
      agree more      Iallreduce MAX: does any trainer replica want another wave
    step report     gather of the step reports to the leader                        loop
    save barrier    Ibarrier before a due save (ranks done early wait for the rest) loop

Ranks reach these at different times (GenRM is done while the trainers still train), so every wait
is polled: the I-collectives through `wait_all`, the object collectives (split, report) behind a
`quiet_barrier`. A blocked Open MPI collective spins and takes the cores the working ranks need.

Point-to-point traffic of a wave (tags in `comm/transport.py`), around those gates:

    trainer owner  TAG_COUNT -> its GenRM rank, TAG_PROMPTS -> rollout ranks | gates | <- TAG_SCORED
    rollout        <- TAG_PROMPTS, generate, TAG_SAMPLES -> GenRM (colocate: all before `gate generated`);
                   over-dispatch: <- TAG_STOP, TAG_END -> GenRM, all before `gate scored`
    genrm          <- TAG_COUNT, <- TAG_SAMPLES, [TAG_STOP ->, <- TAG_END], TAG_SCORED -> owner
    partial rollouts (training waves): no STOP/END; the rollout ranks generate in segments, each followed by an
                   Iallreduce on the rollout group (which replicas have their groups), then send every row;
                   GenRM waits for all of them and sends the owner its kept groups scored and the rest as they are
    tools group    rollout: TAG_TOOL_CALLS -> a tool rank, <- TAG_TOOL_RESULTS (numbered requests, answered in any order), and
                   TAG_CODE_RUNS -> a tool rank, <- TAG_CODE_RESULTS (a code reward term, per engine call), then
                   TAG_TOOLS_DONE -> every tool rank before `gate generated`; a tool rank serves until every
                   rollout rank is done, then crosses both gates (agent/tools_group.py)
    after the waves the trainers send TAG_WEIGHTS to the rollout ranks that generate next (no agreement);
                   by transport (comm/weight_sync.py): bytes, or manifests beside a pair group's broadcasts,
                   or CUDA IPC handles each answered by TAG_WEIGHTS_DONE

A rank that took another sequence would deadlock in MPI. With `check` on (the tests set
YATT_PROTOCOL_CHECK=1, like torch's TORCH_DISTRIBUTED_DEBUG), every rank first compares its next
event with every other rank's (an allgather on the protocol's own communicator) and all raise
`ProtocolDivergence` naming the step, the event and which ranks are where, instead of hanging;
`end_step` also checks the step's trace against `STEP`.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from yatt_hpc.comm.gates import PhaseGate
from yatt_hpc.comm.transport import agree_more, quiet_barrier, wait_collective
from yatt_hpc.metrics.activity import ACTIVITY

log = logging.getLogger(__name__)
CHECK_ENV = "YATT_PROTOCOL_CHECK"

STOP, SPLIT, GENERATED, SCORED, MORE, REPORT, SAVE = (
    "agree stop", "agree split", "gate generated", "gate scored", "agree more", "step report", "save barrier")
WAVE = (GENERATED, SCORED, MORE)
STEP = (STOP, SPLIT + "?", "WAVE+", REPORT, SAVE + "?")
_LABEL_BYTES = 48


class ProtocolDivergence(RuntimeError):
    """Ranks of the world were about to take different collectives: a bug in a controller."""


def step_pattern(colocate: bool, dynamic_split: bool) -> re.Pattern:
    """`STEP` for one placement, as a regex over the events of a step joined by ';'."""
    wave = ";".join(e for e in WAVE if colocate or not e.startswith("gate"))
    split = f"{SPLIT};" if dynamic_split else ""
    return re.compile(f"{STOP};{split}(?:{wave};)+{REPORT}(?:;{SAVE})?")


def check_requested(environ) -> bool:
    """Whether the environment (read once, by the worker) asks for the run-time protocol check."""
    return environ.get(CHECK_ENV, "") not in ("", "0")


class StepProtocol:
    def __init__(self, comm, plan, check: bool = False, poll_s: float = 0.002):
        self.comm, self.plan, self.check, self.poll_s = comm, plan, check, poll_s
        self.colocate = plan.mode == "colocate"
        self.pattern = step_pattern(self.colocate, plan.dynamic_split)
        self.gates = PhaseGate(comm, enabled=self.colocate, poll_s=poll_s)
        self.check_comm = comm.Dup() if check else None
        self.step, self.trace = -1, []
        self._wave_gate = 0  # the next gate of the current wave

    # ------------------------------------------------------------------ the loop's events

    def begin_step(self, step: int) -> None:
        self.step, self.trace = step, []

    def agree_stop(self, code: int) -> int:
        self._event(STOP)
        mine, agreed = np.array([code], dtype=np.int64), np.zeros(1, dtype=np.int64)
        # polled: ranks done early (GenRM while the trainers train) sleep here instead of spinning
        wait_collective(self.comm, self.comm.Iallreduce(mine, agreed, op=MPI.MAX), self.poll_s, STOP)
        return int(agreed[0])

    def agree_split(self, pending):
        self._event(SPLIT)
        quiet_barrier(self.comm, SPLIT, self.poll_s)
        with ACTIVITY.waiting(SPLIT):
            return self.comm.bcast(pending, root=0)

    def report(self, mine: dict) -> list[dict] | None:
        self._event(REPORT)
        quiet_barrier(self.comm, REPORT, self.poll_s)
        with ACTIVITY.waiting(REPORT):
            return self.comm.gather(mine, root=0)

    def save_barrier(self) -> None:
        self._event(SAVE)
        wait_collective(self.comm, self.comm.Ibarrier(), self.poll_s, SAVE)

    def end_step(self) -> None:
        text = ";".join(self.trace)
        if not self.pattern.fullmatch(text):
            raise ProtocolDivergence(f"step {self.step + 1} took [{text}], which is not the declared step "
                                     f"{' -> '.join(STEP)} for placement.mode={self.plan.mode}")

    # ------------------------------------------------------------------ the roles' events

    def waves(self, wave: Callable[[], bool]) -> int:
        """Run `wave()` (True: this rank wants another wave) until no rank of the world wants one;
        every rank runs the same number of waves. Returns how many ran."""
        count = 0
        while True:
            count += 1
            self._wave_gate = 0
            wants = wave()
            self._event(MORE)  # compared first: a rank that skipped its gates is named on every rank
            if self.colocate and self._wave_gate != 2:
                raise ProtocolDivergence(f"step {self.step + 1}: a wave on world rank {self.comm.Get_rank()} "
                                         f"crossed {self._wave_gate} of its 2 gates")
            if not agree_more(self.comm, wants, self.poll_s):
                return count

    def gate(self, name: str) -> None:
        """Cross a phase gate of the wave: GENERATED, then SCORED (colocate; nothing otherwise)."""
        if self.colocate:
            self._event(name)
        expected = WAVE[self._wave_gate] if self._wave_gate < 2 else None
        if name != expected:
            raise ProtocolDivergence(f"step {self.step + 1}: world rank {self.comm.Get_rank()} crossed '{name}' "
                                     f"where the wave declares '{expected}'")
        self._wave_gate += 1
        if self.colocate:
            self.gates.cross(name)

    def pass_gates(self) -> None:
        """Cross both gates of the wave with nothing between them: a role whose work ends before the wave's
        first gate (the tools group, once every rollout rank has sent its last call)."""
        self.gate(GENERATED)
        self.gate(SCORED)

    # ------------------------------------------------------------------ the check

    def _event(self, name: str) -> None:
        self.trace.append(name)
        if self.check_comm is not None:
            self._compare(name)

    def _compare(self, name: str) -> None:
        mine = np.zeros(2 + _LABEL_BYTES // 8, np.int64)
        mine[:2] = (self.step, len(self.trace) - 1)
        mine[2:] = np.frombuffer(name.encode()[:_LABEL_BYTES].ljust(_LABEL_BYTES, b"\0"), np.int64)
        every = np.zeros((self.comm.Get_size(), mine.size), np.int64)
        wait_collective(self.check_comm, self.check_comm.Iallgather(mine, every), self.poll_s, "protocol check")
        seen = [(int(r[0]), int(r[1]), r[2:].tobytes().rstrip(b"\0").decode()) for r in every]
        if len(set(seen)) > 1:
            raise ProtocolDivergence(f"the ranks diverged from the step protocol: {self._describe(seen)}")

    def _describe(self, seen: list[tuple[int, int, str]]) -> str:
        where: dict[tuple[int, int, str], list[int]] = {}
        for rank, key in enumerate(seen):
            where.setdefault(key, []).append(rank)
        parts = [f"{_ranks(ranks, self.plan)} at step {step + 1} event {index + 1} '{name}'"
                 for (step, index, name), ranks in sorted(where.items(), key=lambda kv: kv[1][0])]
        return "; ".join(parts)

    def close(self) -> None:
        if self.check_comm is not None:
            self.check_comm.Free()
            self.check_comm = None


def _ranks(ranks: list[int], plan) -> str:
    groups = sorted({plan.group_of(r) for r in ranks})
    span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ",".join(map(str, ranks))
    return f"world rank{'s' if len(ranks) > 1 else ''} {span} ({'/'.join(groups)})"
