"""Partial rollouts (`rollout.partial_rollouts`; docs/async.md): each role's part, mixed into its controller.

    rollout  PartialSegments.partial_wave   generate in segments; per segment, agree (Iallreduce SUM over the
                                            rollout group) which replicas have their groups complete; the rest
                                            of a satisfied replica's samples pause there; send every row
    genrm    PartialScoring.score_partial   wait for every dispatched row; score the `keep` lowest complete
                                            groups; hand the owner those scored and the rest as they are
    trainer  PartialCarry                   dispatch the paused groups first (or drop those too old), then
                                            fresh prompts; keep what comes back unkept for the next wave;
                                            the paused groups are in the checkpoint as arrays

The decisions are pure (`sched/partial.py`); validation rounds keep the over-dispatch handshake.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from yatt_hpc.batch import SampleBatch, batch_columns, batch_from_columns
from yatt_hpc.comm.transport import TAG_COUNT, TAG_SAMPLES, TAG_SCORED, recv_batch, recv_ints, wait_collective
from yatt_hpc.errors import InputError
from yatt_hpc.sched.partial import (
    PAUSED,
    complete_groups,
    continuation_seed,
    kept_groups,
    may_continue,
    needs_generation,
    segment_budget,
    segment_finish,
    version_spans,
)


def _partial(cfg, evaluation: bool) -> bool:
    return cfg.rollout.partial_rollouts and not evaluation


class PartialSegments:
    """The rollout rank's segmented wave (`RolloutController`)."""

    @property
    def handshake(self) -> bool:
        """STOP/END with GenRM: over-dispatch, except the training waves of partial rollouts (nothing is aborted)."""
        return self.cfg.rollout.over_dispatch_ratio > 1.0 and not _partial(self.cfg, self.round.evaluation)

    @property
    def partial(self) -> bool:
        return _partial(self.cfg, self.round.evaluation)

    def partial_wave(self, prompts: SampleBatch, sender) -> int:
        """Generate `prompts` (fresh rows and paused ones, sample-id order) segment by segment until every replica
        has its groups complete, then send each owner's rows, finished or paused, to its GenRM rank."""
        rc, n = self.cfg.rollout, self.round.n
        rows = _Responses(prompts)
        dp_of = np.array([self.routes.trainer_coords(int(o))["dp"] for o in prompts.owner], np.int64)
        keep = self.cfg.train.prompts_per_step // self.routes.dp
        chunk = max(1, rc.stream_chunk // n) * n
        while True:
            todo = needs_generation(rows.finish, rows.lens)
            satisfied = self._satisfied(prompts.prompt_id, todo, dp_of, keep)
            active = np.flatnonzero(todo & ~satisfied[dp_of])
            if satisfied.all():
                break
            for start in range(0, len(active), chunk):
                self._segment(prompts, rows, active[start:start + chunk])
            self.stats.add("partial_segments", 1)
        out = rows.batch(prompts)
        for owner, part in out.by_owner():
            sender.send(self.genrm_of(owner), TAG_SAMPLES, part)
        self.stats.hold(-len(prompts))
        return len(out)

    def _satisfied(self, prompt_id: np.ndarray, todo: np.ndarray, dp_of: np.ndarray, keep: int) -> np.ndarray:
        """Per trainer replica, whether it has its groups complete (or nothing left to generate), summed over the
        rollout ranks: every rollout rank takes the same decision at the same segment."""
        dp = self.routes.dp
        mine = np.zeros(3 * dp, np.int64)
        for d in range(dp):
            rows = dp_of == d
            mine[d] = len(np.unique(prompt_id[rows]))
            mine[dp + d] = len(complete_groups(prompt_id[rows], todo[rows]))
            mine[2 * dp + d] = int(todo[rows].sum())
        total = np.zeros_like(mine)
        comm = self.world.group_comm
        wait_collective(comm, comm.Iallreduce(mine, total, op=MPI.SUM), label="partial segment")
        dispatched, complete, open_rows = total[:dp], total[dp:2 * dp], total[2 * dp:]
        return (complete >= np.minimum(keep, dispatched)) | (open_rows == 0)

    def _segment(self, prompts: SampleBatch, rows: _Responses, index: np.ndarray) -> None:
        """One segment of the rows at `index`: each continues from its prompt and its response so far."""
        from yatt_hpc.rollout import GenerationRequest  # rollout ranks only: the engines' modules load torch

        rc = self.cfg.rollout
        budget = segment_budget(rows.lens[index], rc.segment_tokens, rc.max_new_tokens)
        images = {pid: tuple(b.tobytes() for b in group) for pid, group in prompts.group_images().items()}
        prompt_tokens = prompts.ragged("prompt_tokens")
        requests = [GenerationRequest(sample_id=int(prompts.sample_id[i]),
                                      prompt_ids=np.concatenate([prompt_tokens[i], *rows.tokens[i]]),
                                      max_new_tokens=int(b), temperature=self.round.temperature, top_p=rc.top_p,
                                      seed=continuation_seed(self.cfg.train.seed, int(prompts.sample_id[i]),
                                                             int(rows.lens[i])),
                                      images=images.get(int(prompts.prompt_id[i]), ()))
                    for i, b in zip(index.tolist(), budget)]
        with self.stats.phase("rollout"):
            results = {r.sample_id: r for r in self.engine.generate(requests)}
        for i in index.tolist():
            got = results[int(prompts.sample_id[i])]
            rows.extend(i, got.response_ids, got.logprobs, self.version)
            rows.finish[i] = segment_finish(got.finish_reason, int(rows.lens[i]), rc.max_new_tokens)
            self.stats.add("response_tokens", len(got.response_ids))


class _Responses:
    """The responses of a partial wave's rows as they grow: per row its token, log-prob and version pieces."""

    def __init__(self, prompts: SampleBatch):
        self.lens = prompts.response_len.astype(np.int64)
        self.finish = prompts.finish.copy()
        self.tokens = [[t] for t in prompts.ragged("response_tokens")]
        self.logprobs = [[p] for p in prompts.ragged("logprobs")]
        self.versions = [[v] for v in prompts.ragged("token_version")]

    def extend(self, i: int, tokens: np.ndarray, logprobs: np.ndarray, version: int) -> None:
        self.tokens[i].append(tokens.astype(np.int32))
        self.logprobs[i].append(logprobs.astype(np.float32))
        self.versions[i].append(np.full(len(tokens), version, np.int32))
        self.lens[i] += len(tokens)

    def batch(self, prompts: SampleBatch) -> SampleBatch:
        flat = [np.concatenate([p for row in pieces for p in row]) if len(prompts) else np.zeros(0)
                for pieces in (self.tokens, self.logprobs, self.versions)]
        return prompts.select(np.arange(len(prompts)), response_len=self.lens.astype(np.int32),
                              response_tokens=flat[0].astype(np.int32), logprobs=flat[1].astype(np.float32),
                              token_version=flat[2].astype(np.int32), finish=self.finish.astype(np.int8))


class PartialScoring:
    """GenRM's partial wave (`GenRMController`)."""

    @property
    def handshake(self) -> bool:
        return self.cfg.rollout.over_dispatch_ratio > 1.0 and not _partial(self.cfg, self.round.evaluation)

    @property
    def partial(self) -> bool:
        return _partial(self.cfg, self.round.evaluation)

    def score_partial(self, sender) -> None:
        """Every dispatched row of each served replica (finished or paused); its `keep` lowest complete groups
        scored, sent to the owner with the other rows as they came (the owner keeps those for its next wave)."""
        wanted: dict[int, tuple[int, int]] = {}
        for d in self.replicas:
            owner = self.routes.trainer_owner(d)
            msg, _ = recv_ints(self.world.comm, owner, TAG_COUNT)
            wanted[owner] = (int(msg[0]), int(sum(msg[2::2])))
        parts: dict[int, list[SampleBatch]] = {owner: [] for owner in wanted}
        remaining = {owner: total for owner, (_, total) in wanted.items()}
        while any(remaining.values()):
            batch, _ = recv_batch(self.world.comm, MPI.ANY_SOURCE, TAG_SAMPLES)
            for owner, part in batch.by_owner():
                parts[owner].append(part.select(np.arange(len(part))))  # off the pooled receive buffer
                remaining[owner] -= len(part)
                assert remaining[owner] >= 0, (owner, remaining)
        for owner, (keep, _) in wanted.items():
            rows = SampleBatch.concat(parts[owner]).sorted_by_id()
            self.stats.hold(len(rows))
            kept = np.isin(rows.prompt_id, kept_groups(rows.prompt_id, needs_generation(rows.finish, rows.response_len),
                                                      keep))
            with self.stats.phase("reward"):
                scored = self.score(rows.select(np.flatnonzero(kept)))
            self.stats.add("scored", len(scored))
            sender.send(owner, TAG_SCORED, SampleBatch.concat([scored, rows.select(np.flatnonzero(~kept))]).sorted_by_id())
            self.stats.hold(-len(rows))


class PartialCarry:
    """The trainer replica's paused groups (`TrainerController`, through `AsyncSteps`): the owner holds them."""

    carry = SampleBatch()  # the paused groups (replaced, never written in place)
    partial_keep = 0  # the groups the wave being collected keeps

    @property
    def partial(self) -> bool:
        return self.cfg.rollout.partial_rollouts

    def dispatch_wave(self, keep: int, step: int) -> dict[int, int]:
        """Send this wave's groups: the paused ones still young enough first, then fresh prompts up to
        ceil(keep x ratio); {position: row id} of every group sent."""
        if not self.partial or not keep:
            return self.dispatch_prompts(keep)
        carry, self.carry = self.carry, SampleBatch()
        oldest = {int(g): int(carry.token_version[_tokens_of(carry, carry.prompt_id == g)].min(initial=step))
                  for g in np.unique(carry.prompt_id)}
        going = [g for g, v in oldest.items() if may_continue(v, step, self.staleness)]
        dropped = sorted(oldest.keys() - set(going))
        self.queue.give_back(dropped)  # generated afresh: the prompt is still consumed once
        on = np.isin(carry.prompt_id, going)
        self.stats.add("partial_dropped", int((~on).sum()))
        self.stats.add("partial_continued", int((on & (carry.finish == PAUSED)).sum()))
        self.stats.add("partial_kept_tokens", int(carry.response_len[on].sum()))
        self.stats.hold(-len(carry))
        self.partial_keep = keep
        return self.dispatch_prompts(keep, carry.select(np.flatnonzero(on)))

    def collect_wave(self, step: int, dispatched: dict[int, int]) -> SampleBatch:
        """The wave's kept groups (scored); with partial rollouts the rest of what came back (paused, or complete
        beyond the step's need) stays with the owner for its next wave."""
        got = self.collect_scored()
        if self.partial:
            for key in ("partial_paused", "partial_continued", "partial_dropped", "partial_kept_tokens"):
                self.stats.add(key, 0)  # the metrics appear every step, zero or not
        if self.partial and len(got):
            kept = np.isin(got.prompt_id, kept_groups(got.prompt_id, needs_generation(got.finish, got.response_len),
                                                      self.partial_keep))
            self.carry, got = got.select(np.flatnonzero(~kept)), got.select(np.flatnonzero(kept))
            self.stats.add("partial_paused", int((self.carry.finish == PAUSED).sum()))
            carried = set(np.unique(self.carry.prompt_id).tolist())
            dispatched = {p: r for p, r in dispatched.items() if p not in carried}
        self.settle(step, dispatched, got)
        return got

    def note_versions(self, batch: SampleBatch, step: int) -> None:
        """The trained batch's weight versions: per-sample span (max - min over its tokens) and the oldest token's
        age in updates."""
        if not self.partial or not self.is_owner:
            return
        spans = version_spans(batch.token_version, batch.response_len)
        self.stats.add("partial_span_sum", float(spans.sum()))
        self.stats.add("partial_span_samples", float(len(spans)))
        self.stats.values["partial_span_max"] = float(spans.max(initial=0))
        self.stats.values["partial_token_age_max"] = float(step - batch.token_version.min(initial=step))

    def carry_state(self) -> dict:
        return {"carry": batch_columns(self.carry)} if self.partial else {}

    def load_carry(self, position: dict, step: int) -> None:
        saved = position.get("carry")
        count = len(np.asarray(saved["sample_id"])) if saved is not None else 0
        if count and not self.partial:
            raise InputError(f"checkpoint step-{step} holds {count} paused samples of partial rollouts; resume it "
                             "with rollout.partial_rollouts=true (and the rollout.max_staleness it was written with)")
        self.carry = batch_from_columns(saved) if count else SampleBatch()
        self.stats.hold(len(self.carry))


def _tokens_of(batch: SampleBatch, rows: np.ndarray) -> np.ndarray:
    """Flat positions of the response tokens of the rows where `rows` is true."""
    return np.repeat(rows, batch.response_len)
