"""Multi-turn rollouts on any engine: model turn -> tool calls -> tool results -> next model turn.

    loop = AgentLoop(cfg.agent, tokenizer, max_new_tokens=64, engine_seed=0, toolbox=build_toolbox(cfg.agent))
    results = loop.run(engine, requests, rows)      # one AgentResult per request, in order
    results[0].result.response_ids, results[0].mask  # every token after the prompt; 1 where the model sampled it

Test: .venv/bin/python -m pytest tests/unit/test_agent_loop.py (HF engine, real tokenizers);
      tests/mpi/test_agent_run.py (a run over mpirun).

Turn schedules (`agent.turn_schedule`): `lockstep` sends turn k of every live trajectory in one engine call once
all of turn k - 1's tool results are back, so each call's batch is a function of the data (bitwise reproducible);
`as_ready` submits each trajectory's calls without waiting (`ToolBox.start`, or the tools group's
`RemoteToolBox.start`) and calls the engine for the trajectories whose results are back while others still wait,
so a slow tool holds back only its own trajectory; the batches then depend on tool timing (docs/agentic.md).

Token-in/token-out: a trajectory is one list of token ids. Each engine call takes its trajectories as requests
whose prompt is the row's prompt plus everything so far (`GenerationRequest.prompt_ids`:
the HF engine's decode and SGLang's `input_ids` alike), so the model's tokens are never decoded and encoded
again; tool results are rendered by the chat template and appended as ids with mask 0 and logprob 0.
Turn k of a sample samples with a seed mixed from its first turn's seed and k: a sample is a function of its
seed, the weights and the (deterministic) tools, so a resumed run regenerates it exactly.

A trajectory ends `stop` when a model turn that ended on a stop token calls no tool (the answer) or the
environment says done; `length` when a turn hit its token cap, the response budget
(`agent.max_response_tokens`) cannot hold the tool results and another turn, or the last allowed turn
(`agent.max_turns`) still calls tools; `abort` when the engine aborted a turn or `cancelled()` turned true
between turns (over-dispatch: the owner's groups are complete).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from yatt_hpc.agent.calls import TurnRenderer, parse_tool_calls
from yatt_hpc.agent.tools import ToolBox, ToolCall, import_object
from yatt_hpc.config.agent import AgentConfig
from yatt_hpc.rollout.engine import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)
_SEED_LIMIT = 2**63


@dataclass(frozen=True)
class AgentResult:
    result: GenerationResult
    """The trajectory as one response: every token after the prompt, logprob 0 where the model did not sample."""
    mask: np.ndarray
    """uint8 per response token: 1 sampled by the model (trained on), 0 tool results and template tokens."""
    turns: int
    env_reward: float = 0.0


@dataclass
class _Trajectory:
    request: GenerationRequest
    env: object | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    finish: str | None = None
    version: int = -1
    env_reward: float = 0.0
    tool_ok: int = 0

    def extend(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.tokens.extend(int(i) for i in ids)
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs])
        self.mask.extend([0 if logprobs is None else 1] * len(ids))


def turn_seed(first: int, turn: int) -> int:
    """The seed of turn `turn` (>= 1) of a sample whose first turn samples with `first`."""
    mixed = np.random.SeedSequence([first & 0xFFFFFFFF, (first >> 32) & 0xFFFFFFFF, turn])
    return int(mixed.generate_state(1, dtype=np.uint64)[0] % _SEED_LIMIT)


class AgentLoop:
    """Drives one rollout rank's multi-turn trajectories (see the module docstring)."""

    def __init__(self, cfg: AgentConfig, tokenizer, *, max_new_tokens: int, engine_seed: int,
                 toolbox: ToolBox | None = None, template: str | None = None) -> None:
        self.cfg, self.tokenizer, self.toolbox = cfg, tokenizer, toolbox
        self.max_new_tokens, self.engine_seed = max_new_tokens, engine_seed
        self.renderer = TurnRenderer(tokenizer, template, cfg.tool_role)
        self.env_class = import_object(cfg.environment, "agent.environment") if cfg.environment else None
        self.stats: Counter = Counter()  # counted since the last `take_stats`

    def take_stats(self) -> dict[str, float]:
        out, self.stats = dict(self.stats), Counter()
        return out

    def run(self, engine, requests: Sequence[GenerationRequest], rows: Sequence[dict] | None = None,
            cancelled: Callable[[], bool] = lambda: False) -> list[AgentResult]:
        trajs = [_Trajectory(r) for r in requests]
        if self.env_class is not None:
            for traj, row in zip(trajs, rows or [{}] * len(trajs)):
                self._reset_env(traj, row)
        if self.cfg.turn_schedule == "as_ready":
            self._run_as_ready(engine, trajs, cancelled)
        else:
            self._run_lockstep(engine, trajs, cancelled)
        for t in trajs:
            if t.finish is None:
                t.finish = "length"
        return [self._result(t) for t in trajs]

    def _run_lockstep(self, engine, trajs: list[_Trajectory], cancelled: Callable[[], bool]) -> None:
        """Turn k of every live trajectory in one engine call, once all of turn k - 1's tool results are back."""
        for _ in range(self.cfg.max_turns):
            live = [t for t in trajs if t.finish is None]
            if not live:
                break
            if cancelled():
                for t in live:
                    t.finish = "abort"
                break
            pending = self._model_turn(engine, live)
            if pending:
                began = time.monotonic()
                outcomes = iter(self.toolbox.run([c for _, calls, _ in pending for c in calls]))
                waited = time.monotonic() - began
                self.stats["agent_engine_idle_s"] += waited  # the engine has nothing to do until all are back
                for traj, calls, res in pending:
                    self._deliver(traj, res, [next(outcomes) for _ in calls], waited)

    def _run_as_ready(self, engine, trajs: list[_Trajectory], cancelled: Callable[[], bool]) -> None:
        """Each trajectory's calls submitted without waiting; the engine takes every trajectory whose results are
        back (in the requests' order) while the others' tools still run; it waits only when all of them wait."""
        order = {id(t): i for i, t in enumerate(trajs)}
        ready = [t for t in trajs if t.finish is None]
        waiting: dict[int, tuple] = {}  # request index -> (trajectory, its model turn, its pending calls, since)
        while ready or waiting:
            if cancelled():
                for t in ready + [w[0] for w in waiting.values()]:
                    t.finish = "abort"  # a pending call's results are not waited for
                return
            if ready:
                for traj, calls, res in self._model_turn(engine, ready):
                    waiting[order[id(traj)]] = (traj, res, self.toolbox.start(calls), time.monotonic())
            else:
                began = time.monotonic()
                self.toolbox.wait_any([w[2] for w in waiting.values()])
                self.stats["agent_engine_idle_s"] += time.monotonic() - began
            # next: those whose turn went on without a call (an environment's observation), and those whose
            # results are back
            going = {order[id(t)]: t for t in ready if t.finish is None and order[id(t)] not in waiting}
            for i in sorted(waiting):
                traj, res, handle, since = waiting[i]
                if (outcomes := handle.poll()) is not None:
                    del waiting[i]
                    self._deliver(traj, res, outcomes, time.monotonic() - since)
                    if traj.finish is None:
                        going[i] = traj
            ready = [going[i] for i in sorted(going)]

    def _model_turn(self, engine, live: list[_Trajectory]) -> list[tuple[_Trajectory, list, GenerationResult]]:
        """One engine call for the next turn of each of `live`; the trajectories whose turn called tools (with
        their calls and the turn). A trajectory's turn k samples with `turn_seed` whatever shares the call."""
        self.stats["agent_engine_calls"] += 1
        results = engine.generate([self._request(t, t.turns) for t in live])
        pending: list[tuple[_Trajectory, list[ToolCall | str], GenerationResult]] = []
        for traj, res in zip(live, results):
            traj.turns += 1
            traj.version = res.weight_version if traj.version < 0 else traj.version
            traj.extend(res.response_ids, res.logprobs)
            if res.finish_reason == "abort":
                traj.finish = "abort"
                continue
            text = self.tokenizer.decode(res.response_ids.tolist())
            calls = parse_tool_calls(text, self.cfg.tool_call_pattern) if self.toolbox is not None else []
            if calls and traj.turns >= self.cfg.max_turns:  # no turn left to read the results in
                self.stats["agent_turn_limit"] += 1
                traj.finish = "length"
            elif calls:
                pending.append((traj, calls, res))
            elif res.finish_reason != "stop":
                traj.finish = "length"  # the turn was cut before it answered
            elif traj.env is not None:
                self._env_step(traj, text, res)
            else:
                traj.finish = "stop"
        return pending

    def _request(self, traj: _Trajectory, turn: int) -> GenerationRequest:
        r = traj.request
        budget = self.cfg.max_response_tokens - len(traj.tokens)
        seed = r.seed if turn == 0 else turn_seed(r.effective_seed(self.engine_seed), turn)
        prompt = r.prompt_ids if turn == 0 else np.concatenate([r.prompt_ids, np.asarray(traj.tokens, np.int32)])
        return GenerationRequest(sample_id=r.sample_id, prompt_ids=prompt, max_new_tokens=min(self.max_new_tokens, budget),
                                 temperature=r.temperature, top_p=r.top_p, seed=seed, images=r.images)

    def _deliver(self, traj: _Trajectory, res: GenerationResult, outcomes: list, waited: float) -> None:
        """A model turn's tool outcomes, back after `waited` seconds, appended as one tool turn."""
        self.stats["agent_tool_turns"] += 1
        self.stats["agent_tool_wait_s"] += waited
        for o in outcomes:
            self.stats["agent_tool_calls"] += 1
            self.stats["agent_tool_seconds"] += o.seconds
            self.stats[f"agent_tool_{o.status}"] += 1
            traj.tool_ok += o.status == "ok"
        self._append(traj, [o.content for o in outcomes], res)

    def _append(self, traj: _Trajectory, contents: list[str], res: GenerationResult, role: str | None = None) -> None:
        last = int(res.response_ids[-1]) if len(res.response_ids) and res.finish_reason == "stop" else None
        ids = self.renderer.results(contents, last, role)
        if len(traj.tokens) + len(ids) >= self.cfg.max_response_tokens:  # no room for them and a next turn
            self.stats["agent_budget_ends"] += 1
            traj.finish = "length"
            return
        traj.extend(ids, None)

    def _reset_env(self, traj: _Trajectory, row: dict) -> None:
        try:
            traj.env = self.env_class(**self.cfg.environment_args)
            traj.env.reset(row)
        except Exception as err:  # noqa: BLE001 - a failing environment ends its trajectory, not the rank
            log.warning("agent.environment %s failed in reset: %s: %s", self.cfg.environment, type(err).__name__, err)
            self.stats["agent_env_errors"] += 1
            traj.finish = "stop"

    def _env_step(self, traj: _Trajectory, text: str, res: GenerationResult) -> None:
        try:
            observation, reward, done = traj.env.step(text)
            traj.env_reward += float(reward)
        except Exception as err:  # noqa: BLE001
            log.warning("agent.environment %s failed in step: %s: %s", self.cfg.environment, type(err).__name__, err)
            self.stats["agent_env_errors"] += 1
            traj.finish = "stop"
            return
        if done or observation is None:
            traj.finish = "stop"
        elif traj.turns >= self.cfg.max_turns:
            traj.finish = "length"
        else:
            self.stats["agent_env_observations"] += 1
            self._append(traj, [str(observation)], res, role="user")

    def _result(self, traj: _Trajectory) -> AgentResult:
        mask = np.asarray(traj.mask, np.uint8)
        self.stats["agent_trajectories"] += 1
        self.stats["agent_turns"] += traj.turns
        self.stats["agent_used_tools"] += traj.tool_ok > 0
        self.stats["agent_masked_tokens"] += int((mask == 0).sum())
        self.stats["agent_response_tokens"] += len(mask)
        result = GenerationResult(sample_id=traj.request.sample_id, prompt_ids=traj.request.prompt_ids,
                                  response_ids=np.asarray(traj.tokens, np.int32),
                                  logprobs=np.asarray(traj.logprobs, np.float32), finish_reason=traj.finish,
                                  weight_version=max(traj.version, 0))
        return AgentResult(result, mask, traj.turns, traj.env_reward)
