"""The GenRM group's controller: one per judge replica.

    ctl = GenRMController(world, cfg, stats, protocol)
    ctl.step(step)     # receive generated samples -> judge + rule verifier -> scored samples to owners

The judge generates a verdict text per (question, response); the parser turns it into a score;
unparseable verdicts get `reward.parse_fail_score` and are counted. See `roles/trainer.py` for the flow.
"""
from __future__ import annotations

import logging

import numpy as np
from mpi4py import MPI

from yatt_hpc.algos.overlong import overlong_penalty
from yatt_hpc.batch import SampleBatch
from yatt_hpc.comm.transport import (
    TAG_COUNT,
    TAG_END,
    TAG_SAMPLES,
    TAG_SCORED,
    TAG_STOP,
    StreamSender,
    recv_batch,
    recv_ints,
    send_ints,
    wait_for_any,
)
from yatt_hpc.config.schema import RunConfig
from yatt_hpc.data.tokenizer import load_decoder
from yatt_hpc.reward.function import row_metadata
from yatt_hpc.reward.template import load_judge_template
from yatt_hpc.reward.terms import RewardTerms, ScoringRows
from yatt_hpc.reward.verdict import build_verdict_parser
from yatt_hpc.roles.base import BaseController, engine_options, eval_round, rank_device, training_round
from yatt_hpc.roles.colocation import holding_devices
from yatt_hpc.roles.partial import PartialScoring
from yatt_hpc.roles.protocol import GENERATED, SCORED, StepProtocol
from yatt_hpc.runtime.rank_stats import RankStats
from yatt_hpc.sched.overdispatch import ReplicaWave
from yatt_hpc.sched.routing import Routes

log = logging.getLogger(__name__)


def judge_batch_size(cfg) -> int:
    """`reward.judge_batch_size`, else `rollout.max_batch_size`, else 64 rows."""
    return cfg.reward.judge_batch_size or cfg.rollout.max_batch_size or 64


class GenRMController(PartialScoring, BaseController):
    def __init__(self, world, cfg: RunConfig, stats: RankStats, protocol: StepProtocol):
        self.world, self.cfg, self.stats, self.protocol = world, cfg, stats, protocol
        self.routes = Routes(world.plan)
        self.round = training_round(cfg)  # validation's in `evaluate`
        self.colocate = world.plan.mode == "colocate"
        self.policy_tokenizer = load_decoder(cfg.model.path)  # decodes only: no transformers here
        rc = cfg.reward
        self.judge = None
        if rc.mode != "rule_only":  # rule-only: no engine, and no torch imported on this rank at all
            from yatt_hpc.reward.judge import GenRMJudge

            parser = build_verdict_parser(rc.judge_parser, scale=(rc.judge_score_min, rc.judge_score_max),
                                          pattern=rc.judge_pattern)
            self.judge = GenRMJudge.from_pretrained(rc.genrm_path, device=rank_device(world), engine=cfg.rollout.engine,
                                                    tp_size=world.plan.group("genrm").size("tp"), seed=cfg.train.seed,
                                                    engine_options={**engine_options(world, cfg),
                                                                    "dtype": rc.judge_dtype or cfg.model.dtype},
                                                    max_new_tokens=rc.verdict_max_tokens,
                                                    temperature=rc.verdict_temperature, batch_size=judge_batch_size(cfg),
                                                    template=load_judge_template(rc.judge_template),
                                                    chat=rc.judge_chat, parser=parser)
            if self.colocate:
                self.judge.release_memory()  # the trainer holds the devices first; the judge wakes for its phase
        self.terms = RewardTerms(rc.effective_terms(), judge=self.judge, parse_fail_score=rc.parse_fail_score)
        log.info("genrm rank scores trainer replicas %s (mode %s)", self.replicas, rc.mode)

    @property
    def replicas(self) -> list[int]:
        """Trainer replicas this rank scores for in the current step."""
        return self.routes.replicas_of_genrm(self.world.rank)

    def step(self, step: int) -> None:
        """One wave without dynamic sampling; the trainers decide whether another follows."""
        self.protocol.waves(self.wave)

    def evaluate(self, step: int) -> None:
        """Score the held-out samples as in a step (the same terms and judge), for validation's metrics."""
        self.round = eval_round(self.cfg)
        try:
            with self.stats.aside("eval"):
                self.protocol.waves(self.wave)
        finally:
            self.round = training_round(self.cfg)

    def wave(self) -> bool:
        sender = StreamSender(self.world.comm, max_inflight=len(self.replicas) + 1)
        self.protocol.gate(GENERATED)
        with holding_devices(self.stats, self.judge, self.colocate):  # rollout had the devices until the gate
            self.score_partial(sender) if self.partial else self.score_wave(sender)
        self.protocol.gate(SCORED)
        sender.drain()
        return False  # GenRM never asks for another wave

    def score_wave(self, sender: StreamSender) -> None:
        """Score chunks as they arrive; hand each replica its kept groups once enough are scored."""
        waves: dict[int, ReplicaWave] = {}
        for d in self.replicas:  # each served replica says what this wave brings: groups to keep, from where
            owner = self.routes.trainer_owner(d)
            msg, _ = recv_ints(self.world.comm, owner, TAG_COUNT)
            waves[owner] = ReplicaWave(keep=int(msg[0]), n=self.round.n,
                                       expected={int(r): int(c) for r, c in zip(msg[1::2], msg[2::2])},
                                       handshake=self.handshake)
        parts: dict[int, list[SampleBatch]] = {owner: [] for owner in waves}
        for owner in waves:
            self.advance(owner, waves[owner], parts[owner], sender)
        while not all(w.finished for w in waves.values()):
            if wait_for_any(self.world.comm, [TAG_SAMPLES, TAG_END]) == TAG_END:
                (owner, sent, _), source = recv_ints(self.world.comm, MPI.ANY_SOURCE, TAG_END)
                waves[int(owner)].on_end(source, int(sent))
                continue
            accepted: dict[int, list[SampleBatch]] = {}
            cap = max(w.keep * w.n for w in waves.values())  # one replica's share: what a call may hold
            for owner, batch, source in self.arrivals(cap):
                if waves[owner].on_samples(source, len(batch)):
                    accepted.setdefault(owner, []).append(batch)
                else:  # a straggler of a replica whose target is met: dropped unscored, its prompt is reused
                    self.stats.add("unused", len(batch))
            if accepted:
                self.score_arrived(accepted, waves, parts, sender)

    def arrivals(self, cap: int) -> list[tuple[int, SampleBatch, int]]:
        """(owner, samples, source rank) of the next message (waited for), and of others already here
        while fewer than `cap` rows are taken, when the reward cannot depend on how rows are grouped
        into judge calls (rule terms, greedy verdicts): a GenRM behind a stream of finished groups then
        scores its backlog in one call, not one call per group, and still holds no more than one
        replica's share (plus one message) at once. A message of finished samples may hold several
        replicas' samples (`sched/finished.py`): each replica's come as their own part."""
        arrived = [recv_batch(self.world.comm, MPI.ANY_SOURCE, TAG_SAMPLES)]
        if self.judge is None or self.judge.temperature == 0:
            rows = len(arrived[0][0])
            while rows < cap and self.world.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_SAMPLES):
                arrived.append(recv_batch(self.world.comm, MPI.ANY_SOURCE, TAG_SAMPLES))
                rows += len(arrived[-1][0])
        return [(owner, part, source) for batch, source in arrived for owner, part in batch.by_owner()]

    def score_arrived(self, accepted: dict[int, list[SampleBatch]], waves: dict[int, ReplicaWave],
                      parts: dict[int, list[SampleBatch]], sender: StreamSender) -> None:
        """Score the accepted samples in one call, then hand each replica its share. The arrivals are
        copied once (off the receive buffers) and the samples to score picked in sample-id order in
        one more gather: on the last call of a wave, after the rollout ended, each copy is waited for."""
        arrived = SampleBatch.concat([b for batches in accepted.values() for b in batches])
        keep, start = [], 0
        for owner, batches in accepted.items():
            count = sum(len(b) for b in batches)
            wanted = waves[owner].wanted(arrived.prompt_id[start:start + count])  # never more groups than needed
            self.stats.add("unused", count - len(wanted))
            keep.append(start + wanted)
            start += count
        keep = np.concatenate(keep)
        batch = arrived.select(keep[np.argsort(arrived.sample_id[keep], kind="stable")])  # sample-id order
        self.stats.hold(len(batch))
        with self.stats.phase("reward"):
            scored = self.score(batch)
        self.stats.add("scored", len(scored))
        for owner in accepted:
            mine = scored.select(np.flatnonzero(scored.owner == owner))
            parts[owner].append(mine)
            waves[owner].on_scored(mine.prompt_id)
            self.advance(owner, waves[owner], parts[owner], sender)

    def advance(self, owner: int, wave: ReplicaWave, parts: list[SampleBatch], sender: StreamSender) -> None:
        """Once the target is met: STOP to the rollout ranks holding the rest, kept groups to the owner."""
        if wave.should_stop():
            for rank in wave.stop_targets():
                send_ints(self.world.comm, rank, TAG_STOP, [owner])
        if wave.target_reached and not wave.delivered:
            wave.delivered = True
            scored = SampleBatch.concat(parts)
            done = scored.select(np.flatnonzero(np.isin(scored.prompt_id, wave.kept()))).sorted_by_id()
            sender.send(owner, TAG_SCORED, done)
            self.stats.hold(-len(scored))
            self.stats.add("unused", len(scored) - len(done))
            parts.clear()

    def score(self, batch: SampleBatch) -> SampleBatch:
        """Reward = sum of weight x term (`reward.terms`, or the `reward.mode` shorthand); rule_score is the first
        exact/math/function/code term (else the exact verifier, a metric only), genrm_score the judge's score."""
        tok = self.policy_tokenizer
        # the user's question as the row gave it (not the chat-templated prompt); decoded tokens if a batch has none
        questions = [q or tok.decode(p.tolist()) for q, p in zip(batch.questions(), batch.ragged("prompt_tokens"))]
        groups = {pid: tuple(b.tobytes() for b in group) for pid, group in batch.group_images().items()}
        # an agent's response: its last model turn (the answer after the tool turns), the whole response otherwise
        rows = ScoringRows(prompts=questions, responses=[tok.decode(r.tolist()) for r in batch.final_turns()],
                           answers=batch.answers(), metadata=row_metadata(batch.sample_id, batch.prompt_id, batch.owner,
                                                                          batch.response_len, batch.finish,
                                                                          extra=batch.metadatas()),
                           images=[groups.get(int(p), ()) for p in batch.prompt_id] if groups else None,
                           env_rewards=batch.env_reward.tolist(), code_rewards=batch.code_reward.tolist())
        got = self.terms.score(rows)
        batch.rule_score, batch.genrm_score, batch.parse_fail, batch.reward = \
            got.rule_score, got.genrm_score, got.parse_fail, got.reward
        rc = self.cfg.reward
        if rc.overlong_buffer_len is not None:  # DAPO's soft overlong punishment, added to the reward
            penalty = overlong_penalty(batch.response_len, max_len=self.cfg.rollout.max_new_tokens,
                                       buffer_len=rc.overlong_buffer_len, factor=rc.overlong_penalty_factor)
            batch.reward = (batch.reward + penalty).astype(np.float32)
            got.values["overlong"] = penalty
        for name, values in got.values.items():  # reward/<name>/mean (runtime/summary.py)
            self.stats.add(f"reward_term/{name}", float(values.sum()))
        self.stats.add("reward_term_samples", len(batch))
        return batch

    # ------------------------------------------------------------------ checkpoint hooks

    @property
    def identity(self) -> str:
        return f"genrm/r{self.world.group_rank}"

    def close(self) -> None:
        if self.judge is not None:
            self.judge.shutdown()
