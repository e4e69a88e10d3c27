"""The tools group: CPU ranks that run the agent's tool calls for the rollout ranks over MPI (`placement.tools`).

    box = RemoteToolBox(world.comm, tool_ranks=plan.tool_ranks, me=world.group_rank)   # a rollout rank
    outcomes = box.run(calls)                 # as ToolBox.run: one ToolOutcome per call, in order
    pending = box.start(calls)                # as ToolBox.start: pending.poll() is None until every answer came
    box.end_wave()                            # before the wave's gate: every tool rank may stop serving it

    ctl = ToolsController(world, cfg, stats, protocol)       # a rank of the tools group (runtime/worker.py)
    runs = box.run_code(sources)              # as CodeRunPool.run_code: one SandboxRun per program, in order
    ctl.step(step)                            # serve calls until every rollout rank ended the wave

Test: .venv/bin/python -m pytest tests/unit/test_tools_group.py tests/mpi/test_tool_calls.py

A request is a trajectory's or a turn's calls (the JSON objects the model wrote, or the error text of a malformed
one), numbered by the rollout rank, as one message per tool rank (TAG_TOOL_CALLS): the calls are cut into
contiguous slices, one per tool rank, the first slice to a rank that turns with the rollout rank and its request
count, so small requests of many rollout ranks spread over the group. A tool rank starts each request's calls in
its `ToolBox` pool as the request comes (its `agent.tool_workers` threads, its sandboxes, its timeouts) and
answers each request, with its number, as soon as all of its calls are back (TAG_TOOL_RESULTS), whatever other
requests still run: answers come in any order, and a slow call holds back only its own request. The rollout
rank's `AgentLoop` reads the outcomes as it reads its own pool's: the same `ToolBox` code makes the same text,
status and cut, so with deterministic tools a lockstep run with a tools group is bitwise the run without one.
`start` sends without waiting (`agent.turn_schedule: as_ready`); `run` sends and waits (lockstep).

A `code` reward term's test programs (agent/code_runs.py) go the same way as a request of their own kind
(TAG_CODE_RUNS, a JSON list of sources, answered by TAG_CODE_RESULTS with each program's `SandboxRun`): a tool
rank runs them in its `CodeRunPool` (the same sandbox and limits), so a rollout rank never runs the model's code.
They run as one batch that the tool rank waits for (the tool calls it started go on in their threads meanwhile,
their answers wait for the batch): code runs come after a chunk's engine call, not between its turns.

The wave's messages, in order: rollout -> tools TAG_TOOL_CALLS, tools -> rollout TAG_TOOL_RESULTS (any number,
one answer per request, in any order), then once per wave, after the rollout rank took every answer it is owed
(those of trajectories over-dispatch cut short are dropped), rollout -> every tool rank TAG_TOOLS_DONE, sent
before the rollout rank's `gate generated`. A tool rank walks the step protocol like a GenRM rank: it serves until every rollout
rank said done, then crosses the wave's gates, agrees on more waves, reports, saves. Every wait is polled
(`comm.transport`), so a stop signal, the stop watchdog's give-up and a failing rank's MPI_Abort reach a tool
rank as they reach GenRM. Tool ranks import neither torch nor an engine; their checkpoint is their RNG.
"""
from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from yatt_hpc.agent.code_runs import CodeRunPool
from yatt_hpc.agent.sandbox import SandboxRun
from yatt_hpc.agent.tools import PendingCalls, ToolCall, ToolOutcome, build_toolbox
from yatt_hpc.ckpt import RngOnlyState
from yatt_hpc.comm.doorbell import DOORBELL
from yatt_hpc.comm.transport import (
    TAG_CODE_RESULTS,
    TAG_CODE_RUNS,
    TAG_TOOL_CALLS,
    TAG_TOOL_RESULTS,
    TAG_TOOLS_DONE,
    recv_ints,
    send_ints,
    wait_all,
    wait_for_any,
    wait_for_message,
)
from yatt_hpc.config.agent import code_term

log = logging.getLogger(__name__)
MAX_BATCHED = 64  # code-run requests a tool rank takes into one pool run (the rest wait for the next)
SERVED = [TAG_TOOL_CALLS, TAG_CODE_RUNS, TAG_TOOLS_DONE]
WAKE_S = 0.002  # a tool rank with calls running looks for new requests this often


def probe_any(comm, tags: Sequence[int]) -> int | None:
    """The first of `tags` with a message pending (from anyone), or None; never waits."""
    return next((tag for tag in tags if comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag)), None)


def encode_calls(calls: Sequence[ToolCall | str]) -> bytes:
    """A turn's calls as JSON: {"name", "arguments"} per call, {"error": text} for a malformed one."""
    return json.dumps([{"error": c} if isinstance(c, str) else {"name": c.name, "arguments": c.arguments}
                       for c in calls]).encode()


def decode_calls(data: bytes) -> list[ToolCall | str]:
    return [c["error"] if "error" in c else ToolCall(c["name"], c["arguments"]) for c in json.loads(data)]


def encode_outcomes(outcomes: Sequence[ToolOutcome]) -> bytes:
    return json.dumps([[o.name, o.content, o.status, o.seconds] for o in outcomes]).encode()


def decode_outcomes(data: bytes) -> list[ToolOutcome]:
    return [ToolOutcome(name, content, status, float(seconds)) for name, content, status, seconds in json.loads(data)]


def encode_runs(runs: Sequence[SandboxRun]) -> bytes:
    return json.dumps([[r.output, r.status, r.exit_code, r.seconds] for r in runs]).encode()


def decode_runs(data: bytes) -> list[SandboxRun]:
    return [SandboxRun(output, status, int(code), float(seconds)) for output, status, code, seconds in json.loads(data)]


def send_bytes(comm, dest: int, tag: int, data: bytes):
    """Start sending `data` (kept alive by the returned pair until the request completes)."""
    buf = np.frombuffer(data, np.uint8)
    return comm.Isend(buf, dest=dest, tag=tag), buf


def recv_bytes(comm, source: int, tag: int) -> tuple[bytes, int]:
    """One message of bytes (waited for, polled); returns it with its sender."""
    status = MPI.Status()
    wait_for_message(comm, source, tag, status)
    out = np.empty(status.Get_count(MPI.BYTE), np.uint8)
    comm.Recv(out, source=status.Get_source(), tag=tag)
    return out.tobytes(), status.Get_source()


def call_slices(n: int, ranks: int, first: int) -> list[tuple[int, int, int]]:
    """(tool rank index, start, stop) of n calls cut into at most `ranks` contiguous, nearly equal slices,
    the first going to tool rank `first` (mod ranks); empty slices are left out."""
    out, start = [], 0
    for k in range(ranks):
        stop = start + n // ranks + (1 if k < n % ranks else 0)
        if stop > start:
            out.append(((first + k) % ranks, start, stop))
        start = stop
    return out


def check_tool_threads(cfg) -> None:
    """With over-dispatch a helper thread takes STOPs while the loop thread waits on the tools group's answers:
    two threads talking MPI at once, which only an MPI of THREAD_MULTIPLE allows."""
    if cfg.rollout.over_dispatch_ratio > 1.0 and MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        from yatt_hpc.errors import InputError  # the registry of user errors imports most of the library

        raise InputError(f"rollout.over_dispatch_ratio={cfg.rollout.over_dispatch_ratio:g} with a tools group "
                         f"(placement.tools.tasks_per_node={cfg.placement.tools.tasks_per_node}) needs an MPI with "
                         f"THREAD_MULTIPLE, and this one gives thread level {MPI.Query_thread()}; use an MPI built with "
                         "thread support, set rollout.over_dispatch_ratio=1, or placement.tools.tasks_per_node=0")


def pack(request_id: int, data: bytes) -> bytes:
    """A request or its answer on the wire: the rollout rank's request number (int64), then the payload."""
    return struct.pack("<q", request_id) + data


def unpack(data: bytes) -> tuple[int, bytes]:
    return struct.unpack_from("<q", data)[0], data[8:]


class RemotePending:
    """Calls sent to the tool ranks (`RemoteToolBox.start`): `poll()` is their outcomes once every answer came,
    None before; it never blocks."""

    def __init__(self, box: RemoteToolBox, ids: list[int]) -> None:
        self.box, self.ids = box, ids

    def complete(self) -> bool:
        return all(i in self.box.answers for i in self.ids)

    def poll(self) -> list[ToolOutcome] | None:
        self.box.take(TAG_TOOL_RESULTS)
        if not self.complete():
            return None
        return [o for i in self.ids for o in decode_outcomes(self.box.answers.pop(i))]


class RemoteToolBox:
    """`ToolBox`'s `run`, `start` and `wait_any` on a rollout rank, the calls executed by the tools group."""

    def __init__(self, comm, tool_ranks: Sequence[int], me: int) -> None:
        self.comm, self.tool_ranks, self.me = comm, list(tool_ranks), me
        self.turns = 0  # requests made: the next one's first slice goes to tool rank (me + turns) % ranks
        self.next_id = 0
        self.answers: dict[int, bytes] = {}  # request id -> answer payload, until its handle takes it
        self.owed: set[int] = set()  # requests sent and not yet answered
        self.sends: list = []

    def run(self, calls: Sequence[ToolCall | str]) -> list[ToolOutcome]:
        pending = self.start(calls)
        while (out := pending.poll()) is None:
            self.wait_any([pending])
        return out

    def start(self, calls: Sequence[ToolCall | str]) -> RemotePending:
        """Send `calls` without waiting for their answers."""
        return RemotePending(self, self._send(calls, encode_calls, TAG_TOOL_CALLS))

    def wait_any(self, handles: Sequence[RemotePending]) -> None:
        """Until one of `handles` may be complete: an answer is here or arriving (polled; stop-aware)."""
        if not any(h.complete() for h in handles):
            wait_for_message(self.comm, MPI.ANY_SOURCE, TAG_TOOL_RESULTS)

    def run_code(self, sources: Sequence[str]) -> list[SandboxRun]:
        """A code reward's test programs, run by the tool ranks' `CodeRunPool`s."""
        ids = self._send(sources, lambda part: json.dumps(list(part)).encode(), TAG_CODE_RUNS)
        while not all(i in self.answers for i in ids):
            self.take(TAG_CODE_RESULTS, block=True)
        return [r for i in ids for r in decode_runs(self.answers.pop(i))]

    def take(self, tag: int, block: bool = False) -> None:
        """Receive every answer of kind `tag` that is here (with `block`, at least one)."""
        while block or self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag):
            data, _ = recv_bytes(self.comm, MPI.ANY_SOURCE, tag)
            request_id, payload = unpack(data)
            self.owed.discard(request_id)
            self.answers[request_id] = payload
            block = False

    def _send(self, items: Sequence, encode, tag: int) -> list[int]:
        """`items` cut into slices over the tool ranks, each sent as one numbered request; the numbers."""
        ids = []
        for k, a, b in call_slices(len(items), len(self.tool_ranks), self.me + self.turns):
            ids.append(self.next_id)
            self.owed.add(self.next_id)
            self.sends.append(send_bytes(self.comm, self.tool_ranks[k], tag, pack(self.next_id, encode(items[a:b]))))
            DOORBELL.ring(self.comm, self.tool_ranks[k])
            self.next_id += 1
        self.turns += bool(items)
        return ids

    def end_wave(self) -> None:
        """This rank sends no more calls in the wave: the answers still owed (calls of trajectories cut short
        by over-dispatch) are taken and dropped, then every tool rank may cross the wave's gates."""
        while self.owed:
            self.take(TAG_TOOL_RESULTS, block=True)
        self.answers.clear()
        wait_all([req for req, _ in self.sends])
        self.sends = []
        for rank in self.tool_ranks:
            send_ints(self.comm, rank, TAG_TOOLS_DONE, [self.me])

    def close(self) -> None:
        """Nothing to free: the tool ranks' pools end with them."""


class ToolsController(RngOnlyState):
    """A rank of the tools group: the step loop's controller interface (`roles/base.BaseController`'s), serving
    tool calls in each wave. No engine, no weights, no data: its checkpoint is its RNG."""

    shard: dict[str, int] = {}

    def __init__(self, world, cfg, stats, protocol) -> None:
        self.world, self.cfg, self.stats, self.protocol = world, cfg, stats, protocol
        self.toolbox = build_toolbox(cfg.agent)  # imports the tools, probes the sandbox: here, never on a rollout rank
        self.code_pool = CodeRunPool(cfg.agent) if code_term(cfg) is not None else None  # the code term's tests
        rollout = world.plan.group("rollout")
        self.clients = range(rollout.rank_start, rollout.rank_stop)
        log.info("tools rank serves rollout ranks %d-%d with %s%s (%d workers)", self.clients.start,
                 self.clients.stop - 1, ", ".join(self.toolbox.tools) or "no tools",
                 " and the code reward's tests" if self.code_pool else "", cfg.agent.tool_workers)

    @property
    def identity(self) -> str:
        return f"tools/r{self.world.group_rank}"

    def step(self, step: int) -> None:
        self.protocol.waves(self.wave)

    def evaluate(self, step: int) -> None:
        """Validation's waves: the rollout ranks call tools there too."""
        with self.stats.aside("eval"):
            self.protocol.waves(self.wave)

    def wave(self) -> bool:
        self.serve()
        self.protocol.pass_gates()  # colocate: the rollout ranks ended their wave, so nothing waits on us
        return False  # the tools group never asks for another wave

    def serve(self) -> None:
        """Run calls and test programs until every rollout rank ended the wave. Each request's calls start as it
        comes and it is answered as soon as they are all back, whatever else still runs."""
        done: set[int] = set()
        running: list[tuple[int, int, PendingCalls]] = []  # (rollout rank, its request id, the calls)
        sends: list = []
        with contextlib.ExitStack() as busy:  # time/tools: while any call of this rank runs
            while len(done) < len(self.clients) or running:
                tag = probe_any(self.world.comm, SERVED) if running else wait_for_any(self.world.comm, SERVED)
                if tag == TAG_TOOLS_DONE:
                    done.add(recv_ints(self.world.comm, MPI.ANY_SOURCE, TAG_TOOLS_DONE)[1])
                elif tag == TAG_CODE_RUNS:
                    self.answer_code(sends)
                elif tag == TAG_TOOL_CALLS:
                    data, source = recv_bytes(self.world.comm, MPI.ANY_SOURCE, tag)
                    request_id, payload = unpack(data)
                    if not running:
                        busy.enter_context(self.stats.phase("tools"))
                    running.append((source, request_id, self.toolbox.start(decode_calls(payload))))
                    self.stats.add("tools_served_requests", 1)
                running = self.answer_finished(running, sends)
                if not running:
                    busy.close()
                elif tag is None:
                    self.toolbox.wait_any([h for _, _, h in running], timeout=WAKE_S)
        wait_all([req for req, _ in sends])

    def answer_finished(self, running: list, sends: list) -> list:
        """Answer each request whose calls are all back; the requests still running."""
        still = []
        for source, request_id, pending in running:
            outcomes = pending.poll()
            if outcomes is None:
                still.append((source, request_id, pending))
                continue
            self.stats.add("tools_served_calls", len(outcomes))
            sends.append(send_bytes(self.world.comm, source, TAG_TOOL_RESULTS,
                                    pack(request_id, encode_outcomes(outcomes))))
            DOORBELL.ring(self.world.comm, source)
        return still

    def answer_code(self, sends: list) -> None:
        """Every waiting request's test programs in one pool run; each request gets its runs back."""
        assert self.code_pool is not None, "test programs came, and this run has no code reward term"
        requests = [recv_bytes(self.world.comm, MPI.ANY_SOURCE, TAG_CODE_RUNS)]
        while len(requests) < MAX_BATCHED and self.world.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_CODE_RUNS):
            requests.append(recv_bytes(self.world.comm, MPI.ANY_SOURCE, TAG_CODE_RUNS))
        parts = [(*unpack(data), source) for data, source in requests]
        sources = [json.loads(payload) for _, payload, _ in parts]
        with self.stats.phase("tools"):
            runs = iter(self.code_pool.run_code([s for part in sources for s in part]))
        for (request_id, _, source), part in zip(parts, sources):
            mine = [next(runs) for _ in part]
            self.stats.add("tools_served_code_runs", len(mine))
            sends.append(send_bytes(self.world.comm, source, TAG_CODE_RESULTS, pack(request_id, encode_runs(mine))))
            DOORBELL.ring(self.world.comm, source)

    # ------------------------------------------------------------------ the step loop's hooks (BaseController's)

    def set_routes(self, routes) -> None:
        """Routes do not concern the tools group (a dynamic split is refused with one)."""

    def load_weights(self, loaded) -> None:
        """No weights on a tool rank."""

    def after_resume(self, step: int) -> None:
        """Nothing to re-establish: every wave starts from the rollout ranks' calls."""

    def rewind_logs(self, step: int) -> None:
        """No per-step logs."""

    def close(self) -> None:
        self.toolbox.close()
        if self.code_pool is not None:
            self.code_pool.close()
