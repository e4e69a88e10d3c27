"""The `code` reward term's runs: a rollout rank scores each finished response by running its program on the row's tests.

    reward = build_code_reward(cfg, remote=remote_tools)   # None without a `code` term; remote: the tools group
    scores = reward.score(rows, results, masks)            # [float] per result: the batch's `code_reward` column
    reward.take_stats()                                    # code_* counters for the step's `code/...` metrics

    pool = CodeRunPool(cfg.agent)        # where programs run: the sandbox (probed, refused as the python tool is)
    runs = pool.run_code(sources)        # one SandboxRun per program, in order, on agent.tool_workers threads

Test: .venv/bin/python -m pytest tests/unit/test_code_reward.py tests/mpi/test_code_reward_run.py

The answer (the last model turn) is decoded with the policy's tokenizer, its program and the row's tests made into
one sandbox program per test (`code_tests.py`), and all the programs of an engine call's responses run together:
on the tools group (`placement.tools`, the rollout rank's `RemoteToolBox.run_code`; the rank runs none of them)
or else in this rank's own pool. A response with no ```python block scores 0 (a parse failure); a row whose tests
are missing or malformed scores 0, is counted and logged with the fix; an aborted response runs nothing. GenRM's
`code` term reads the column; the programs never run there.
"""
from __future__ import annotations

import concurrent.futures as futures
import logging
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from yatt_hpc.agent.code_tests import (
    TESTS_KEY,
    CodeTests,
    CodeTestsError,
    code_score,
    extract_program,
    harness_source,
    parse_tests,
    run_passed,
)
from yatt_hpc.agent.sandbox import PythonSandbox, SandboxRun
from yatt_hpc.config.agent import AgentConfig, code_term

if TYPE_CHECKING:  # a tool rank imports this module and must not import torch (rollout/engine.py does)
    from yatt_hpc.rollout.engine import GenerationResult

log = logging.getLogger(__name__)
CODE_OUTPUT_CHARS = 65536
"""Characters of a test run's output kept for the comparison (the model never reads them): an expected output
longer than this cannot match."""


class CodeRunPool:
    """Programs run in the sandbox (`agent.sandbox`'s limits) on `agent.tool_workers` threads."""

    def __init__(self, cfg: AgentConfig) -> None:
        limits = cfg.sandbox.model_copy(update={"output_chars": max(cfg.sandbox.output_chars, CODE_OUTPUT_CHARS)})
        # probes: refused here as the python tool is, naming the setting
        self.sandbox = PythonSandbox(limits, user="the code reward term's tests")
        self._pool = futures.ThreadPoolExecutor(cfg.tool_workers, thread_name_prefix="code")

    def run_code(self, sources: Sequence[str]) -> list[SandboxRun]:
        return list(self._pool.map(self.sandbox.run, sources))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class CodeReward:
    """A rollout rank's side of the `code` term: programs out of answers, runs, a score per response."""

    def __init__(self, runner, tokenizer, *, all_or_nothing: bool, secret: int, remote: bool) -> None:
        self.runner, self.tokenizer, self.remote = runner, tokenizer, remote
        self.all_or_nothing, self.secret = all_or_nothing, secret
        self.stats: Counter = Counter()

    def take_stats(self) -> dict[str, float]:
        out, self.stats = dict(self.stats), Counter()
        return out

    def score(self, rows: Sequence[dict], results: Sequence[GenerationResult],
              masks: Sequence[np.ndarray | None]) -> list[float]:
        """Each result's score; `rows` are its prompt rows (prompt_id, metadata), `masks` its response masks
        (None: every token sampled, a single-turn response)."""
        jobs: list[tuple[int, str, CodeTests]] = []  # (result index, program, tests)
        for i, (row, res, mask) in enumerate(zip(rows, results, masks)):
            if res.finish_reason == "abort":  # over-dispatch dropped it: nobody reads its score
                continue
            self.stats["code_samples"] += 1
            program = extract_program(self.tokenizer.decode(final_turn(res.response_ids, mask).tolist()))
            if program is None:
                self.stats["code_parse_failures"] += 1
                continue
            try:
                jobs.append((i, program, parse_tests(row["metadata"].get(TESTS_KEY))))
            except CodeTestsError as err:
                self.stats["code_bad_tests"] += 1
                log.warning("reward term code: prompt row %s (prompt_id %d) scores 0: %s", _row_name(row),
                            row["prompt_id"], err)
        sources = [harness_source(p, t, k, self.secret) for _, p, t in jobs for k in range(len(t))]
        runs = iter(self.runner.run_code(sources) if sources else [])
        scores = [0.0] * len(results)
        for i, program, tests in jobs:
            mine = [next(runs) for _ in range(len(tests))]
            passed = [run_passed(r.status, r.output, program, tests, k, self.secret) for k, r in enumerate(mine)]
            scores[i] = code_score(passed, self.all_or_nothing)
            self.stats["code_tests"] += len(passed)
            self.stats["code_tests_passed"] += sum(passed)
            self.stats["code_all_passed"] += all(passed)
            self.stats["code_timeouts"] += sum(r.status == "timeout" for r in mine)
            self.stats["code_run_errors"] += sum(r.status == "error" for r in mine)
            self.stats["code_run_seconds"] += sum(r.seconds for r in mine)
            self.stats["code_score_sum"] += scores[i]
        self.stats["code_runs_remote" if self.remote else "code_runs_local"] += len(sources)
        return scores

    def close(self) -> None:
        if not self.remote:
            self.runner.close()


def final_turn(tokens: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The response's last run of model-sampled tokens (`SampleBatch.final_turns`' rule, for one response)."""
    if mask is None:
        return tokens
    outside = np.flatnonzero(np.asarray(mask) == 0)
    return tokens[outside[-1] + 1:] if outside.size else tokens


def _row_name(row: dict) -> str:
    prompt = str(row.get("prompt", ""))
    return repr(prompt if len(prompt) <= 60 else prompt[:60] + "...")


def build_code_reward(cfg, remote=None, tokenizer=None) -> CodeReward | None:
    """The rollout rank's code reward (None without a `code` term). `remote`: the tools group's client, whose
    ranks run the programs (this rank then starts no sandbox); else this rank's own pool."""
    term = code_term(cfg)
    if term is None:
        return None
    if tokenizer is None:
        from yatt_hpc.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
    runner = remote if remote is not None else CodeRunPool(cfg.agent)
    return CodeReward(runner, tokenizer, all_or_nothing=term.all_or_nothing, secret=cfg.train.seed,
                      remote=remote is not None)
