"""The rollout group's controller: one per engine replica.

    ctl = RolloutController(world, cfg, stats)
    ctl.step(step)     # receive prompts -> generate -> stream to GenRM -> take fresh weights

It serves the trainer replicas the routes assign to it, knows how many prompt messages to expect,
and never sees a sample it is not generating. See `trainer_ctl` for the whole data flow.
"""
from __future__ import annotations

import logging

import numpy as np
from mpi4py import MPI

from yatt_hpc.config.schema import RunConfig
from yatt_hpc.control.controller import BaseController
from yatt_hpc.control.phases import PhaseGate
from yatt_hpc.control.rank_stats import RankStats
from yatt_hpc.control.routing import Routes
from yatt_hpc.control.weight_sync import recv_weights
from yatt_hpc.control.wire import (
    TAG_PROMPTS,
    TAG_SAMPLES,
    TAG_WEIGHTS,
    SampleBatch,
    StreamSender,
    agree_more,
    recv_batch,
    wait_for_message,
)
from yatt_hpc.rollout import GenerationRequest, build_engine

log = logging.getLogger(__name__)
FINISH_CODES = {"stop": 0, "length": 1, "abort": 2}


class RolloutController(BaseController):
    def __init__(self, world, cfg: RunConfig, stats: RankStats):
        self.world, self.cfg, self.stats = world, cfg, stats
        self.routes = Routes(world.plan)
        self.colocate = world.plan.mode == "colocate"
        self.gate = PhaseGate(world.comm, enabled=self.colocate)
        device = "cuda" if world.plan.group("rollout").devices_per_task else "cpu"
        self.engine = build_engine(cfg.rollout.engine, cfg.model.path, device=device,
                                   tp_size=world.plan.group("rollout").size("tp"), seed=cfg.train.seed)
        if self.colocate:
            self.engine.release_memory()  # the trainer builds first; the engine wakes for its phase
        log.info("rollout rank serves trainer replicas %s", self.replicas)

    @property
    def replicas(self) -> list[int]:
        """Trainer replicas this rank generates for in the current step."""
        return self.routes.replicas_of_rollout(self.world.rank)

    def step(self, step: int) -> None:
        self.generate_waves()
        self.receive_weights()

    def generate_waves(self) -> None:
        while True:  # one wave without dynamic sampling; the trainers decide whether another follows
            self.stats.add("generated", self.wave())
            if not agree_more(self.world.comm, False):
                break

    def wave(self) -> int:
        """Receive one (possibly empty) prompt batch per served replica, generate, stream to GenRM."""
        incoming = []
        for _ in self.replicas:
            batch, _ = recv_batch(self.world.comm, MPI.ANY_SOURCE, TAG_PROMPTS)
            self.stats.hold(len(batch))
            incoming.append(batch)
        prompts = SampleBatch.concat(incoming).sorted_by_id()
        if self.colocate:
            with self.stats.phase("resume"):
                self.engine.resume_memory()
        # colocate: the whole batch, then GenRM takes the devices; otherwise stream chunks so that
        # scoring overlaps generation (bounded by stream_queue chunks in flight). In colocation every
        # send must be in flight before the gate, where GenRM starts receiving.
        chunk = max(len(prompts), 1) if self.colocate else self.cfg.rollout.stream_chunk
        sender = StreamSender(self.world.comm, len(self.replicas) if self.colocate else self.cfg.rollout.stream_queue)
        for start in range(0, len(prompts), chunk):
            with self.stats.phase("rollout"):
                done = self.generate(prompts.select(np.arange(start, min(start + chunk, len(prompts)))))
            for owner in np.unique(done.owner):
                part = done.select(np.flatnonzero(done.owner == owner))
                sender.send(self.routes.genrm_for(self.routes.trainer_coords(int(owner))["dp"]), TAG_SAMPLES, part)
                self.stats.hold(-len(part))
        if self.colocate:
            with self.stats.phase("release"):
                self.engine.release_memory()
        self.gate.cross("generated")
        sender.drain()
        self.gate.cross("scored")
        return len(prompts)

    def generate(self, prompts: SampleBatch) -> SampleBatch:
        rc = self.cfg.rollout
        requests = [GenerationRequest(sample_id=int(sid), prompt_ids=p, max_new_tokens=rc.max_new_tokens,
                                      temperature=rc.temperature, top_p=rc.top_p)
                    for sid, p in zip(prompts.sample_id, prompts.ragged("prompt_tokens"))]
        results = {r.sample_id: r for r in self.engine.generate(requests)}
        ordered = [results[int(sid)] for sid in prompts.sample_id]
        prompts.response_len = np.array([len(r.response_ids) for r in ordered], np.int32)
        prompts.response_tokens = np.concatenate([r.response_ids for r in ordered]).astype(np.int32)
        prompts.logprobs = np.concatenate([r.logprobs for r in ordered]).astype(np.float32)
        prompts.finish = np.array([FINISH_CODES[r.finish_reason] for r in ordered], np.int8)
        self.stats.add("response_tokens", float(prompts.response_len.sum()))
        return prompts

    def receive_weights(self) -> None:
        # In colocation the engine stays released: an update while released restores only the
        # weights, and the next resume_memory() adds the KV cache after them (lower peak).
        source = self.routes.trainer_owner(self.routes.weight_source_for(self.world.rank))
        wait_for_message(self.world.comm, source, TAG_WEIGHTS)  # idle until training is done
        with self.stats.phase("weight_sync"):
            for bucket, final in recv_weights(self.world.comm, source):
                self.engine.update_weights(bucket, final=final)

    def close(self) -> None:
        self.engine.shutdown()

    # ------------------------------------------------------------------ checkpoint hooks

    @property
    def identity(self) -> str:
        return f"rollout/r{self.world.group_rank}"

    def after_resume(self, step: int) -> None:
        self.receive_weights()  # the trainer sends its restored weights
