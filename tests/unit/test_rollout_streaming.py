"""The rollout's finished-results stream when a send fails: the error reaches the caller, never a hang.

What the engine finishes is sent from inside its call (`on_result` / `on_step`, on the engine's
thread); a send that fails there must end the engine call and reach the rollout's caller.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from yatt_hpc.batch import SampleBatch
from yatt_hpc.config import load_config
from yatt_hpc.roles.base import training_round
from yatt_hpc.roles.rollout import RolloutController
from yatt_hpc.rollout.engine import GenerationResult
from yatt_hpc.runtime.rank_stats import RankStats
from yatt_hpc.sched.overdispatch import RolloutWork

REPO = Path(__file__).resolve().parents[2]


class _EngineDoneAtOnce:
    """Finishes every request at its first decode step."""

    reports_while_decoding = True

    def generate(self, requests, on_result=None, on_step=None):
        out = [GenerationResult(sample_id=r.sample_id, prompt_ids=np.asarray(r.prompt_ids, np.int32),
                                response_ids=np.array([5, 6], np.int32), logprobs=np.zeros(2, np.float32),
                                finish_reason="stop", weight_version=0) for r in requests]
        for result in out:
            on_result(result)
        on_step()
        return out

    def abort(self):
        pass


class _BrokenSender:
    def has_room(self):
        return True

    def send(self, dest, tag, batch):
        raise ConnectionError("the link to GenRM went down")


class _EngineOneGroupPerStep:
    """Finishes one prompt group (2 samples) per decode step, in sample order; counts its steps."""

    reports_while_decoding = True

    def __init__(self):
        self.steps = 0

    def generate(self, requests, on_result=None, on_step=None):
        out = []
        for start in range(0, len(requests), 2):
            for r in requests[start:start + 2]:
                out.append(GenerationResult(sample_id=r.sample_id, prompt_ids=np.asarray(r.prompt_ids, np.int32),
                                            response_ids=np.array([5, 6, r.sample_id % 5 + 3], np.int32),
                                            logprobs=np.zeros(3, np.float32), finish_reason="stop", weight_version=0))
                on_result(out[-1])
            self.steps += 1
            on_step()
        return out


class _EngineFinishingAt:
    """Finishes the requests at the given positions at each decode step (`steps`: one list per step)."""

    reports_while_decoding = True

    def __init__(self, steps):
        self.plan, self.steps = steps, 0

    def generate(self, requests, on_result=None, on_step=None):
        out = {}
        for rows in self.plan:
            for i in rows:
                r = requests[i]
                out[i] = GenerationResult(sample_id=r.sample_id, prompt_ids=np.asarray(r.prompt_ids, np.int32),
                                          response_ids=np.array([5, 6], np.int32), logprobs=np.zeros(2, np.float32),
                                          finish_reason="stop", weight_version=0)
                on_result(out[i])
            self.steps += 1
            on_step()
        return [out[i] for i in range(len(requests))]

    def abort(self):
        pass


class _SenderRoomAfter:
    """Has room only from decode step `after` of `engine` on; records (step, sample ids) of each send."""

    def __init__(self, engine, after):
        self.engine, self.after, self.sent = engine, after, []

    def has_room(self):
        return self.engine.steps >= self.after

    def send(self, dest, tag, batch):
        self.sent.append((self.engine.steps, batch.sample_id.tolist(), batch.response_len.tolist()))


def _controller(streaming: str, engine, n: int = 2):
    cfg = load_config(REPO / "configs/partial_cpu.yaml", [f"rollout.streaming={streaming}", f"rollout.samples_per_prompt={n}"])
    ctl = object.__new__(RolloutController)
    ctl.cfg, ctl.streaming = cfg, streaming  # no over-dispatch in this config: no STOP handshake
    ctl.stats, ctl.engine = RankStats("rollout"), engine
    ctl.genrm_of = lambda owner: 3
    ctl.round = training_round(cfg)
    return ctl


def _prompts(groups: int) -> SampleBatch:
    n = 2 * groups
    return SampleBatch(sample_id=np.arange(n, dtype=np.int64), prompt_id=np.repeat(np.arange(groups, dtype=np.int64), 2),
                       owner=np.zeros(n, np.int32), prompt_len=np.full(n, 3, np.int32),
                       prompt_tokens=np.arange(3 * n, dtype=np.int32) % 7 + 3)


@pytest.mark.parametrize("after, steps_sent", [(3, [3, 3, 3, 4, 5]), (99, [5, 5, 5, 5, 5])])
def test_finished_groups_wait_for_room_in_the_sender_without_holding_the_engine(after, steps_sent):
    """With no room in the sender (GenRM busy), the engine goes on decoding; the due groups go out,
    in order and each once, at the first step with room, or, if none comes, when the call ends."""
    engine = _EngineOneGroupPerStep()
    ctl, sender = _controller("finished_groups", engine), _SenderRoomAfter(engine, after)
    work = RolloutWork(np.zeros(10, np.int32), np.repeat(np.arange(5), 2), chunk_groups=5)
    assert ctl.generate_streaming(_prompts(5), work, sender) == 10
    assert engine.steps == 5  # the engine never waited: every group decoded
    assert sender.sent == [(step, [2 * g, 2 * g + 1], [3, 3]) for g, step in enumerate(steps_sent)]
    assert work.sent[0] == 10


@pytest.mark.parametrize("streaming", ["finished_groups", "finished_samples"])
def test_a_failed_send_during_the_engine_call_is_raised_not_waited_on(streaming):
    ctl, prompts = _controller(streaming, _EngineDoneAtOnce()), _prompts(2)
    work = RolloutWork(prompts.owner, prompts.prompt_id, chunk_groups=2)
    raised: list[BaseException] = []

    def run():
        try:
            ctl.generate_streaming(prompts, work, _BrokenSender())
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the assertion below names it
            raised.append(exc)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(timeout=60)  # a guard only: the call returns at once, or hangs for good
    assert not caller.is_alive(), "generate_streaming hung after a failed send"
    assert [repr(e) for e in raised] == [repr(ConnectionError("the link to GenRM went down"))]


def test_finished_samples_of_two_replicas_scored_by_one_genrm_rank_share_a_message():
    """Replicas 0 and 1 both score on GenRM rank 3: their finished samples go out together, a group's
    worth at a time, and each replica is credited with its own samples."""
    engine = _EngineOneGroupPerStep()
    ctl, sender = _controller("finished_samples", engine), _SenderRoomAfter(engine, 0)
    prompts = _prompts(4)
    prompts.owner[:] = [0, 1, 0, 1, 0, 1, 0, 1]  # each group of 2 (= n) has one sample of each replica
    work = RolloutWork(prompts.owner, prompts.prompt_id, chunk_groups=4)
    assert ctl.generate_streaming(prompts, work, sender) == 8
    assert [ids for _, ids, _ in sender.sent] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert work.sent[0] == work.sent[1] == 4


def test_a_message_of_two_replicas_splits_into_one_part_per_replica():
    """What GenRM does with a finished_samples message (`arrivals`) and the rollout with a chunk (`send_parts`)."""
    batch = _prompts(3)
    batch.owner[:] = [2, 5, 2, 2, 5, 2]
    parts = batch.by_owner()
    assert [(o, p.sample_id.tolist()) for o, p in parts] == [(2, [0, 2, 3, 5]), (5, [1, 4])]
    batch.owner[:] = 5
    assert batch.by_owner()[0][1] is batch  # one replica: the message as it came


def test_finished_samples_that_finish_at_one_decode_step_go_in_one_message():
    """A long tail's last rows finish together (the capped ones at the last step): they go to the judge
    as one message, not one each (each its own judge call after the rollout ended)."""
    engine = _EngineFinishingAt([[0, 1, 2, 3, 4, 5], [], [6, 7]])
    ctl = _controller("finished_samples", engine, n=4)
    sender = _SenderRoomAfter(engine, 0)
    prompts = _prompts(4)
    prompts.prompt_id[:] = np.repeat([0, 1], 4)  # 2 groups of n = 4
    work = RolloutWork(prompts.owner, prompts.prompt_id, chunk_groups=2)
    assert ctl.generate_streaming(prompts, work, sender) == 8
    assert [(step, ids) for step, ids, _ in sender.sent] == [(1, [0, 1, 2, 3, 4, 5]), (3, [6, 7])]
