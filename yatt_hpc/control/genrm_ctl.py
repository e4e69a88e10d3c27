"""The GenRM group's controller: one per judge replica.

    ctl = GenRMController(world, cfg, stats)
    ctl.step(step)     # receive generated samples -> judge + rule verifier -> scored samples to owners

The judge generates a verdict text per (question, response); the parser turns it into a score;
unparseable verdicts get `reward.parse_fail_score` and are counted. See `trainer_ctl` for the flow.
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
from yatt_hpc.control.wire import (
    TAG_COUNT,
    TAG_SAMPLES,
    TAG_SCORED,
    SampleBatch,
    StreamSender,
    agree_more,
    recv_batch,
    wait_for_message,
)
from yatt_hpc.data.tokenizer import load_tokenizer
from yatt_hpc.reward.genrm import GenRMJudge, combine_reward
from yatt_hpc.reward.verifier import rule_score

log = logging.getLogger(__name__)


class GenRMController(BaseController):
    def __init__(self, world, cfg: RunConfig, stats: RankStats):
        self.world, self.cfg, self.stats = world, cfg, stats
        self.routes = Routes(world.plan)
        self.colocate = world.plan.mode == "colocate"
        self.gate = PhaseGate(world.comm, enabled=self.colocate)
        self.policy_tokenizer = load_tokenizer(cfg.model.path)
        rc = cfg.reward
        self.judge = None
        if rc.mode != "rule_only":
            device = "cuda" if world.plan.group("genrm").devices_per_task else "cpu"
            self.judge = GenRMJudge.from_pretrained(rc.genrm_path, device=device, max_new_tokens=rc.verdict_max_tokens,
                                                    temperature=rc.verdict_temperature)
            if self.colocate:
                self.judge.release_memory()  # the trainer holds the devices first; the judge wakes for its phase
        log.info("genrm rank scores trainer replicas %s (mode %s)", self.replicas, rc.mode)

    @property
    def replicas(self) -> list[int]:
        """Trainer replicas this rank scores for in the current step."""
        return self.routes.replicas_of_genrm(self.world.rank)

    def step(self, step: int) -> None:
        while True:  # one wave without dynamic sampling; the trainers decide whether another follows
            self.wave()
            if not agree_more(self.world.comm, False):
                break

    def wave(self) -> None:
        """Score chunks as they arrive; hand each replica its samples once all of them are scored."""
        sender = StreamSender(self.world.comm, max_inflight=len(self.replicas) + 1)
        self.gate.cross("generated")
        if self.colocate and self.judge is not None:
            with self.stats.phase("resume"):
                self.judge.resume_memory()
        waiting = {}
        for d in self.replicas:  # each served replica says how many samples this wave brings
            owner, count = self.routes.trainer_owner(d), np.zeros(1, np.int64)
            wait_for_message(self.world.comm, owner, TAG_COUNT)
            self.world.comm.Recv(count, source=owner, tag=TAG_COUNT)
            waiting[owner] = int(count[0])
        scored_by_owner: dict[int, list[SampleBatch]] = {owner: [] for owner in waiting}
        for owner in [o for o, n in waiting.items() if n == 0]:
            sender.send(owner, TAG_SCORED, SampleBatch())
            del waiting[owner]
        while waiting:
            batch, _ = recv_batch(self.world.comm, MPI.ANY_SOURCE, TAG_SAMPLES)
            self.stats.hold(len(batch))
            with self.stats.phase("reward"):
                scored = self.score(batch.sorted_by_id())
            owner = int(scored.owner[0])
            scored_by_owner[owner].append(scored)
            waiting[owner] -= len(scored)
            if waiting[owner] == 0:
                done = SampleBatch.concat(scored_by_owner.pop(owner)).sorted_by_id()
                sender.send(owner, TAG_SCORED, done)
                self.stats.hold(-len(done))
                self.stats.add("scored", len(done))
                del waiting[owner]
        if self.colocate and self.judge is not None:
            with self.stats.phase("release"):
                self.judge.release_memory()
        self.gate.cross("scored")
        sender.drain()

    def score(self, batch: SampleBatch) -> SampleBatch:
        rc = self.cfg.reward
        tok = self.policy_tokenizer
        questions = [tok.decode(p.tolist()) for p in batch.ragged("prompt_tokens")]
        responses = [tok.decode(r.tolist()) for r in batch.ragged("response_tokens")]
        rules = np.array([rule_score(r, a) for r, a in zip(responses, batch.answers())], np.float32)
        verdicts = self.judge.score(list(zip(questions, responses))) if self.judge else [None] * len(batch)
        parse_fail = np.array([self.judge is not None and v is None for v in verdicts], np.int8)
        batch.rule_score = rules
        batch.genrm_score = np.array([rc.parse_fail_score if v is None else v for v in verdicts], np.float32)
        batch.parse_fail = parse_fail
        batch.reward = np.array([combine_reward(v, r, rc.mode, rc.alpha, rc.beta, rc.parse_fail_score)
                                 for v, r in zip(verdicts, rules)], np.float32)
        return batch

    # ------------------------------------------------------------------ checkpoint hooks

    @property
    def identity(self) -> str:
        return f"genrm/r{self.world.group_rank}"
