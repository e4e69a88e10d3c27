"""The rollout's finished-results stream when a send fails: the error reaches the caller, never a hang.

The helper thread that sends what the engine finishes may take the engine's end mark in the same
sweep as the last results; if a send then fails, it must not wait for an end mark it already took.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from yatt_hpc.batch import SampleBatch
from yatt_hpc.config import load_config
from yatt_hpc.roles.rollout import RolloutController
from yatt_hpc.rollout.engine import GenerationResult
from yatt_hpc.runtime.rank_stats import RankStats
from yatt_hpc.sched.overdispatch import RolloutWork

REPO = Path(__file__).resolve().parents[2]


class _EngineDoneAtOnce:
    """Finishes every request before the helper wakes: results and end mark are queued together."""

    def generate(self, requests, on_result=None):
        out = [GenerationResult(sample_id=r.sample_id, prompt_ids=np.asarray(r.prompt_ids, np.int32),
                                response_ids=np.array([5, 6], np.int32), logprobs=np.zeros(2, np.float32),
                                finish_reason="stop", weight_version=0) for r in requests]
        for result in out:
            on_result(result)
        return out

    def abort(self):
        pass


class _BrokenSender:
    def send(self, dest, tag, batch):
        raise ConnectionError("the link to GenRM went down")


@pytest.mark.parametrize("streaming", ["finished_groups", "finished_samples"])
def test_a_failed_send_after_the_engine_ended_is_raised_not_waited_on(streaming):
    cfg = load_config(REPO / "configs/partial_cpu.yaml", [f"rollout.streaming={streaming}", "rollout.samples_per_prompt=2"])
    ctl = object.__new__(RolloutController)
    ctl.cfg, ctl.streaming, ctl.handshake = cfg, streaming, False
    ctl.stats, ctl.engine = RankStats("rollout"), _EngineDoneAtOnce()
    ctl.genrm_of = lambda owner: 3
    prompts = SampleBatch(sample_id=np.arange(4, dtype=np.int64), prompt_id=np.array([0, 0, 1, 1], np.int64),
                          owner=np.zeros(4, np.int32), prompt_len=np.full(4, 3, np.int32),
                          prompt_tokens=np.arange(12, dtype=np.int32) % 7 + 3)
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
