"""The rollout group's controller: one per engine replica.

    ctl = RolloutController(world, cfg, stats, protocol)
    ctl.step(step)     # receive prompts -> generate -> stream to GenRM -> take fresh weights

It serves the trainer replicas the routes assign to it, knows how many prompt messages to expect,
and never sees a sample it is not generating. See `roles/trainer.py` for the whole data flow.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from yatt_hpc.agent.code_runs import build_code_reward
from yatt_hpc.agent.rollout_side import build_rollout_agent, extra_columns
from yatt_hpc.batch import SampleBatch
from yatt_hpc.comm.prompt_routing import expected_prompt_messages
from yatt_hpc.comm.transport import (
    TAG_END,
    TAG_PROMPTS,
    TAG_SAMPLES,
    TAG_STOP,
    TAG_WEIGHTS,
    StreamSender,
    recv_batch,
    recv_ints,
    send_ints,
    wait_for_message,
)
from yatt_hpc.comm.weight_sync import receive_weights
from yatt_hpc.config.schema import RunConfig
from yatt_hpc.placement.weight_transport import weight_pairs
from yatt_hpc.roles.base import BaseController, eval_round, rank_device, rollout_engine_options, training_round
from yatt_hpc.roles.colocation import give_back_phase_memory, holding_devices
from yatt_hpc.roles.partial import PartialSegments
from yatt_hpc.roles.protocol import GENERATED, SCORED, StepProtocol
from yatt_hpc.rollout import GenerationRequest, GenerationResult, build_engine
from yatt_hpc.runtime.rank_stats import RankStats
from yatt_hpc.sched.finished import FinishedResults
from yatt_hpc.sched.overdispatch import RolloutWork
from yatt_hpc.sched.routing import Routes

log = logging.getLogger(__name__)
FINISH_CODES = {"stop": 0, "length": 1, "abort": 2}
STOP_POLL_S = 0.005  # how often a streaming engine call looks for over-dispatch STOPs


class RolloutController(PartialSegments, BaseController):
    version = 0  # the weights' version: the step they are used in (updates applied), per token in the batch

    def __init__(self, world, cfg: RunConfig, stats: RankStats, protocol: StepProtocol):
        self.world, self.cfg, self.stats, self.protocol = world, cfg, stats, protocol
        self.routes = Routes(world.plan)
        self.round = training_round(cfg)  # what the coming waves generate (validation's, in `evaluate`)
        self.colocate = world.plan.mode == "colocate"
        # finished_groups / finished_samples: the whole wave in one engine call, streamed as it finishes
        self.streaming = None if self.colocate or cfg.rollout.streaming == "chunks" else cfg.rollout.streaming
        self.engine = build_engine(cfg.rollout.engine, cfg.model.path, device=rank_device(world),
                                   tp_size=world.plan.group("rollout").size("tp"), seed=cfg.train.seed,
                                   **rollout_engine_options(world, cfg))
        self.remote_tools = None  # the tools group's client: the calls run there, not here
        if world.plan.tool_ranks:
            from yatt_hpc.agent.tools_group import RemoteToolBox, check_tool_threads

            check_tool_threads(cfg)
            self.remote_tools = RemoteToolBox(world.comm, world.plan.tool_ranks, world.group_rank)
        # multi-turn rollouts with tools (agent:), else None
        self.agent = build_rollout_agent(cfg, tools=self.remote_tools)
        # a `code` reward term's tests (agent/code_runs.py): run on the tools group, else in this rank's sandbox
        self.code = build_code_reward(cfg, remote=self.remote_tools,
                                      tokenizer=self.agent.loop.tokenizer if self.agent is not None else None)
        if self.colocate:
            self.engine.release_memory()  # the trainer builds first; the engine wakes for its phase
        # CPU colocation, one weight version a step: between its last wave and the sync that replaces them, the hf
        # engine's weights are freed (rollout/hf_weights.py drop_weights)
        self.drop_before_sync = self.colocate and cfg.rollout.engine == "hf" and rank_device(world) == "cpu" \
            and cfg.rollout.max_staleness == 0 and world.plan.host_memory_in_turns
        self.stops = StopWatch(world.comm, self.engine)  # over-dispatch STOPs, whichever way it generates
        # how this rank's weights arrive (placement/weight_transport.py); the same table as its owner's
        self.weight_transport = weight_pairs(world.plan, cfg.rollout.weight_transport, cfg.rollout.engine)[world.rank].transport
        log.info("rollout rank ready (%s routing)", cfg.rollout.routing)

    @property
    def replicas(self) -> list[int]:
        """Trainer replicas this rank generates for in the current step."""
        return self.routes.replicas_of_rollout(self.world.rank)

    def step(self, step: int) -> None:
        self.version = step
        self.generate_waves()
        if self.drop_before_sync:  # CPU colocation: the trainer's phase gets this engine's weight memory
            freed = self.engine.drop_weights()
            # back to the kernel, whatever their size: blocks of every size come from the heap (runtime/allocator.py)
            returned = give_back_phase_memory(self.stats, at_least=freed // 2) if freed else 0
            log.debug("engine weights freed until the sync refills them: %.1f MB (heap trimmed: %.1f MB free)",
                      freed / 2**20, returned / 2**20)
        self.receive_weights()

    def evaluate(self, step: int) -> None:
        """Generate the held-out prompts the trainer replicas send (eval's n and temperature); no weights follow."""
        self.round, self.version = eval_round(self.cfg), step
        try:
            with self.stats.aside("eval"):
                self.generate_waves()
        finally:
            self.round = training_round(self.cfg)

    def generate_waves(self) -> None:
        """One wave without dynamic sampling; the trainers decide whether another follows."""
        def wave() -> bool:
            self.stats.add("generated", self.wave())
            return False

        self.protocol.waves(wave)

    def wave(self) -> int:
        """Receive this wave's prompt messages, generate whole groups in chunks, stream them to GenRM."""
        incoming = []  # counted per wave from the routes: they may change between steps
        for _ in range(expected_prompt_messages(self.cfg.rollout.routing, self.routes, self.world.rank)):
            batch, _ = recv_batch(self.world.comm, MPI.ANY_SOURCE, TAG_PROMPTS)
            self.stats.hold(len(batch))
            incoming.append(batch)
        self.stats.add("prompt_messages", len(incoming))  # least_loaded: one from every replica
        prompts = SampleBatch.concat(incoming).sorted_by_id()
        # colocate: the whole batch, then GenRM takes the devices; otherwise stream chunks of whole
        # groups so that scoring overlaps generation (bounded by stream_queue chunks in flight), or,
        # with rollout.streaming=finished_groups (finished_samples), the whole wave in one engine call
        # and each group (sample) the moment it is done. In colocation every send must be in flight before the
        # gate, where GenRM starts receiving.
        n = self.round.n
        whole = self.colocate or self.streaming
        work = RolloutWork(prompts.owner, prompts.prompt_id,
                           max(len(prompts), 1) if whole else max(1, self.cfg.rollout.stream_chunk // n))
        sender = StreamSender(self.world.comm, max(len(work.assigned), 1) if self.colocate else self.cfg.rollout.stream_queue)
        generated = released = 0
        with holding_devices(self.stats, self.engine, self.colocate):  # the trainer had the devices
            if self.partial:  # rollout.partial_rollouts: segments until each replica's groups are complete
                generated, released = self.partial_wave(prompts, sender), len(prompts)
            while not self.partial and (index := self.next_chunk(work)) is not None:
                if self.streaming:
                    with self.stats.phase("rollout"):
                        generated += self.generate_streaming(prompts.select(index), work, sender)
                else:
                    with self.stats.phase("rollout"):
                        done = self.generate_watching(prompts.select(index), work)
                    generated += self.send_parts(done, work, sender)
                self.stats.hold(-len(index))
                released += len(index)
        self.stats.hold(released - len(prompts))  # groups dropped before they were generated
        if self.remote_tools is not None:
            self.remote_tools.end_wave()  # before the gate: the tool ranks cross it once every rollout rank is done
        self.protocol.gate(GENERATED)
        sender.drain()
        self.stats.values["stream_inflight_max"] = max(self.stats.values.get("stream_inflight_max", 0.0),
                                                       float(sender.peak_inflight))
        while self.handshake and work.awaiting_stop():  # every replica we worked for says STOP once
            self.stop_owner(work, int(recv_ints(self.world.comm, MPI.ANY_SOURCE, TAG_STOP)[0][0]))
        self.protocol.gate(SCORED)
        return generated

    def send_parts(self, done: SampleBatch, work: RolloutWork, sender: StreamSender) -> int:
        """Each owner's generated samples to its GenRM rank, unless its target was met meanwhile."""
        sent = 0
        for owner, part in done.by_owner():
            if owner in work.stopped:  # its target was met while this chunk ran: dropped
                continue
            sender.send(self.genrm_of(owner), TAG_SAMPLES, part)
            work.mark_sent(owner, len(part))
            sent += len(part)
        return sent

    def generate_streaming(self, chunk: SampleBatch, work: RolloutWork, sender: StreamSender) -> int:
        """`rollout.streaming=finished_groups`: one engine call for the chunk, each prompt group sent to
        its GenRM rank as soon as the engine reports its last sample finished; `finished_samples`: each
        owner's finished samples, a group's worth at a time (`sched/finished.py`). It all runs on the
        engine's own thread, between its decode steps (`on_step` takes the rows `on_result` reported at
        that step together: rows that finish at one step go in one message, so the judge scores them in
        one call; the capped rows of a long tail all finish at the last step): what is due goes out
        while the sender has room (never waiting on GenRM: the rest waits for a later step), held
        samples go once their bound passes, and with over-dispatch the STOPs are taken every
        `STOP_POLL_S` (the engine aborted once every owner is stopped). No second thread takes the
        interpreter from the decode loop (a helper thread woken per message cost it 5-10% of B4's
        rollout). An engine that reports only at the end of its call generates the chunk as without
        streaming. Returns the samples sent."""
        if not self.engine.reports_while_decoding:
            return self.send_parts(self.generate_watching(chunk, work), work, sender)
        row_of = {int(sid): i for i, sid in enumerate(chunk.sample_id)}
        owners = {int(o) for o in np.unique(chunk.owner)}
        genrm_of = {owner: self.genrm_of(owner) for owner in owners}
        stream = FinishedResults(lambda sid: int(chunk.prompt_id[row_of[sid]]), self.round.n,
                                 by_sample=self.streaming == "finished_samples",
                                 dest_of=lambda sid: genrm_of[int(chunk.owner[row_of[sid]])],
                                 expected=Counter(genrm_of[int(o)] for o in chunk.owner))
        due: list[list[GenerationResult]] = []  # due to go out, waiting for room in the sender
        sent, next_poll = [0], [0.0]

        def send(results: list[GenerationResult]) -> None:
            """`results` (all bound for one GenRM rank: `FinishedResults` keeps destinations apart) to
            that rank in one message, less those of a replica that was stopped."""
            owner_of = {i: int(chunk.owner[i]) for i in sorted(row_of[r.sample_id] for r in results)}
            rows = [i for i, owner in owner_of.items() if owner not in work.stopped]
            if rows:
                part = self.fill(chunk, {r.sample_id: r for r in results}, rows)
                sender.send(genrm_of[owner_of[rows[0]]], TAG_SAMPLES, part)
                for owner, count in Counter(owner_of[i] for i in rows).items():  # (np.unique: ~80 us a message here)
                    work.mark_sent(owner, count)
                sent[0] += len(part)

        def flush(taken: list[list[GenerationResult]], ended: bool = False) -> None:
            due.extend(taken)
            while due and (ended or sender.has_room()):
                send(due.pop(0))

        finished: list[GenerationResult] = []  # reported since the last decode step

        def on_step() -> None:
            now = time.monotonic()
            flush(stream.take(finished, now, False))  # this step's finished rows at once, and held ones past their bound
            finished.clear()
            if self.handshake and now >= next_poll[0]:
                next_poll[0] = now + STOP_POLL_S
                self.stops.poll(lambda owner: self.stop_owner(work, owner), owners, work.stopped)

        self.engine.generate(self.requests(chunk), on_result=finished.append, on_step=on_step)
        flush(stream.take(finished, time.monotonic(), True), ended=True)
        return sent[0]

    def genrm_of(self, owner: int) -> int:
        return self.routes.genrm_for(self.routes.trainer_coords(owner)["dp"])

    def next_chunk(self, work: RolloutWork) -> np.ndarray | None:
        """Take any STOP that arrived (no waiting), then the next chunk of groups still wanted."""
        if self.handshake:
            self.stops.poll(lambda owner: self.stop_owner(work, owner))
        return work.next_chunk()

    def stop_owner(self, work: RolloutWork, owner: int) -> None:
        """STOP for a replica: drop what is left of its work and tell its GenRM rank what was sent."""
        aborted = work.stop(owner)
        self.stats.add("aborted", aborted)
        send_ints(self.world.comm, self.genrm_of(owner), TAG_END, [owner, work.sent[owner], aborted])

    def generate_watching(self, chunk: SampleBatch, work: RolloutWork) -> SampleBatch:
        """Generate a chunk; with over-dispatch, STOPs that arrive meanwhile are taken (and the engine
        aborted once every replica of the chunk is stopped)."""
        if not self.handshake or self.colocate:  # colocate: GenRM only starts after the whole wave
            return self.generate(chunk)
        owners = {int(o) for o in np.unique(chunk.owner)}
        with self.stops.beside(lambda owner: self.stop_owner(work, owner), owners, work.stopped):
            return self.generate(chunk, lambda: owners <= work.stopped)

    def requests(self, prompts: SampleBatch) -> list[GenerationRequest]:
        """One request per sample; a group's requests share one tuple of its encoded images."""
        rc = self.cfg.rollout
        images = {pid: tuple(b.tobytes() for b in group) for pid, group in prompts.group_images().items()}
        return [GenerationRequest(sample_id=int(sid), prompt_ids=p, max_new_tokens=rc.max_new_tokens,
                                  temperature=self.round.temperature, top_p=rc.top_p, images=images.get(int(pid), ()))
                for sid, pid, p in zip(prompts.sample_id, prompts.prompt_id, prompts.ragged("prompt_tokens"))]

    def generate(self, prompts: SampleBatch, cancelled: Callable[[], bool] = lambda: False) -> SampleBatch:
        extra = None
        if self.agent is not None:  # model and tool turns until an answer (agent/loop.py); `cancelled`: all stopped
            results, extra = self.agent.generate(self.engine, prompts, self.requests(prompts), cancelled)
            for key, value in self.agent.take_stats().items():
                self.stats.add(key, value)
        else:
            results = {r.sample_id: r for r in self.engine.generate(self.requests(prompts))}
        if self.code is not None:  # the code term's tests, once each response is complete
            extra = (extra or {}) | {"code_reward": self.score_code(prompts, results, extra)}
        return self.fill(prompts, results, extra=extra)

    def score_code(self, prompts: SampleBatch, results: dict[int, GenerationResult], extra: dict | None) -> dict:
        """{sample_id: the code term's score} of the generated responses (the batch's `code_reward` column)."""
        ids = [int(s) for s in prompts.sample_id]
        rows = [{"prompt": q, "prompt_id": int(p), "metadata": m}
                for q, p, m in zip(prompts.questions(), prompts.prompt_id, prompts.metadatas())]
        masks = [extra["masks"][s] for s in ids] if extra and "masks" in extra else [None] * len(ids)
        scores = self.code.score(rows, [results[s] for s in ids], masks)
        for key, value in self.code.take_stats().items():
            self.stats.add(key, value)
        return dict(zip(ids, scores))

    def fill(self, prompts: SampleBatch, results: dict[int, GenerationResult],
             rows: list[int] | None = None, extra: dict | None = None) -> SampleBatch:
        """The prompt rows `rows` (all by default) with their generated responses, logprobs and finish
        codes: one new buffer, sent as it lies (`SampleBatch.select` with the responses given)."""
        rows = np.arange(len(prompts)) if rows is None else np.asarray(rows, dtype=np.int64)
        ordered = [results[int(sid)] for sid in prompts.sample_id[rows]]
        lens = np.array([len(r.response_ids) for r in ordered], np.int32)
        filled = prompts.select(rows, response_len=lens, response_tokens=_flat([r.response_ids for r in ordered], np.int32),
                                logprobs=_flat([r.logprobs for r in ordered], np.float32),
                                token_version=np.full(int(lens.sum()), self.version, np.int32),
                                finish=np.array([FINISH_CODES[r.finish_reason] for r in ordered], np.int8),
                                **routing_columns(ordered),
                                **extra_columns(extra, prompts.sample_id[rows]))
        self.stats.add("response_tokens", float(lens.sum()))
        return filled

    def receive_weights(self) -> None:
        # In colocation the engine stays released: an update while released restores only the
        # weights, and the next resume_memory() adds the KV cache after them (lower peak).
        # one per pipeline stage, and one per expert-parallel peer of the source replica
        sources = self.routes.weight_senders(self.routes.weight_source_for(self.world.rank))
        wait_for_message(self.world.comm, sources[0], TAG_WEIGHTS)  # idle until training is done
        with self.stats.phase("weight_sync"):
            receive_weights(self.world.comm, sources, self.engine, self.weight_transport)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.code is not None:
            self.code.close()
        self.engine.shutdown()

    # ------------------------------------------------------------------ checkpoint hooks

    @property
    def identity(self) -> str:
        return f"rollout/r{self.world.group_rank}"

    def after_resume(self, step: int) -> None:
        self.receive_weights()  # the trainer sends its restored weights


def routing_columns(results: list[GenerationResult]) -> dict[str, np.ndarray]:
    """The batch's `routed_experts` columns of these results (none when the engine records no routing)."""
    routed = [r.routed_experts for r in results]
    if all(r is None for r in routed):
        return {}
    routed = [np.zeros(0, np.int16) if r is None else r.reshape(-1) for r in routed]
    return {"routed_experts_len": np.array([r.size for r in routed], np.int32),
            "routed_experts": _flat(routed, np.int16)}


def _flat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


class StopWatch:
    """The one place a rollout rank takes over-dispatch STOPs (TAG_STOP, from a GenRM rank whose
    replica has its groups): `poll` takes every STOP that has arrived (no waiting) and hands each
    owner to `on_stop`; once every owner of the running engine call is stopped it aborts the engine
    (repeatedly: an abort acts only once generation runs). `beside` polls from a helper thread while
    the loop thread is inside an engine call: one thread at a time talks MPI (the loop thread makes
    no MPI call while the engine runs, the helper none after it)."""

    def __init__(self, comm, engine, poll_s: float = 0.002):
        self.comm, self.engine, self.poll_s = comm, engine, poll_s

    def poll(self, on_stop: Callable[[int], None], owners: set[int] = frozenset(),
             stopped: set[int] = frozenset()) -> None:
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_STOP):
            on_stop(int(recv_ints(self.comm, MPI.ANY_SOURCE, TAG_STOP)[0][0]))
        if owners and owners <= stopped:
            self.engine.abort()

    @contextmanager
    def beside(self, on_stop: Callable[[int], None], owners: set[int], stopped: set[int]):
        """Poll from a helper thread for as long as the block runs (`stopped` must grow with `on_stop`)."""
        finished = threading.Event()

        def watch() -> None:
            while not finished.is_set():
                self.poll(on_stop, owners, stopped)
                finished.wait(self.poll_s)

        watcher = threading.Thread(target=watch, name="stop-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            finished.set()
            watcher.join()
