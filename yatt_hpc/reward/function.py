"""User reward functions: code the config names (`reward.terms: [{kind: function, function: "pkg.mod:fn"}]`).

    fn = load_function("my_rewards.length:penalty", term="len")     # imported only because the config names it
    metadata = row_metadata(batch.sample_id, batch.prompt_id, batch.owner, batch.response_len, batch.finish)
    def penalty(prompt: str, response: str, answer: str, metadata: dict) -> float: ...
    def penalty_batched(prompts: list[str], responses: list[str], answers: list[str],
                        metadata: list[dict]) -> list[float]: ...   # with `batched: true`

`metadata` holds the row's own metadata columns (when the batch carries them) and the sample's `sample_id`,
`prompt_id` (its data position at the owning trainer replica), `owner` (that replica's world rank),
`response_tokens` (the response's length in policy tokens) and `finish` (`stop`, `length` or `abort`).
The module must be importable on every GenRM rank (installed, or its directory on PYTHONPATH). A function
that raises, or returns anything but a finite number, stops the run with one `RewardError` naming the
term, the row and the function's own traceback: a failed row is never scored 0 in silence.
"""
from __future__ import annotations

import importlib
import math
import numbers
import re
import traceback
from collections.abc import Callable, Sequence

from yatt_hpc.reward.errors import RewardError

SPEC = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*$")
FINISH = {0: "stop", 1: "length", 2: "abort"}


def load_function(spec: str, term: str) -> Callable:
    """The callable `package.module:function` names (`function` may be dotted: `Class.method`)."""
    if not SPEC.match(spec):
        raise RewardError(f"reward term {term!r}: function={spec!r} is not of the form package.module:function")
    module_name, _, attr = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises on import, name it
        raise RewardError(f"reward term {term!r}: module {module_name!r} of function={spec!r} cannot be imported "
                          f"({err.__class__.__name__}: {err}); install it, or put its directory on PYTHONPATH of "
                          f"every GenRM rank\n{_user_traceback(err)}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise RewardError(f"reward term {term!r}: {module_name!r} has no {attr!r} (function={spec!r}); "
                              f"name a function the module defines")
        target = getattr(target, part)
    if not callable(target):
        raise RewardError(f"reward term {term!r}: function={spec!r} is a {type(target).__name__}, not a function")
    return target


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's frames on (our calling frame is dropped)."""
    tb = err.__traceback__.tb_next if err.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(err), err, tb)).rstrip()


def _as_score(value: object) -> float | None:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


class FunctionTerm:
    """Scores rows with a user function, one row per call or (batched) all rows in one call."""

    def __init__(self, name: str, spec: str, batched: bool = False) -> None:
        self.name, self.spec, self.batched = name, spec, batched
        self.fn = load_function(spec, name)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str],
                 metadata: Sequence[dict]) -> list[float]:
        return self._batched(prompts, responses, answers, metadata) if self.batched else \
            [self._one(i, prompts, responses, answers, metadata) for i in range(len(prompts))]

    def _one(self, i: int, prompts, responses, answers, metadata) -> float:
        try:
            value = self.fn(prompts[i], responses[i], answers[i], dict(metadata[i]))
        except Exception as err:  # noqa: BLE001 - any error of user code stops the run, named
            raise RewardError(f"{self._where()} raised on {_row(metadata[i], prompts[i])}: "
                              f"{err.__class__.__name__}: {err}\n{_user_traceback(err)}\n"
                              f"fix the function (a reward function must return a float for every row)") from None
        score = _as_score(value)
        if score is None:
            raise RewardError(f"{self._where()} returned {value!r} on {_row(metadata[i], prompts[i])}; a reward "
                              f"function must return a finite number (int or float)")
        return score

    def _batched(self, prompts, responses, answers, metadata) -> list[float]:
        rows = f"a batch of {len(prompts)} rows (prompt ids {sorted({m['prompt_id'] for m in metadata})})"
        try:
            values = self.fn(list(prompts), list(responses), list(answers), [dict(m) for m in metadata])
        except Exception as err:  # noqa: BLE001 - any error of user code stops the run, named
            raise RewardError(f"{self._where()} (batched) raised on {rows}: {err.__class__.__name__}: {err}\n"
                              f"{_user_traceback(err)}\nfix the function (it must return one float per row)") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"{self._where()} (batched) returned {values!r} on {rows}; it must return a list of "
                              f"{len(prompts)} floats") from None
        if len(values) != len(prompts):
            raise RewardError(f"{self._where()} (batched) returned {len(values)} scores for {rows}; it must return "
                              f"one per row ({len(prompts)})")
        scores = [_as_score(v) for v in values]
        bad = [i for i, s in enumerate(scores) if s is None]
        if bad:
            i = bad[0]
            raise RewardError(f"{self._where()} (batched) returned {values[i]!r} for {_row(metadata[i], prompts[i])} "
                              f"({len(bad)} such rows); a reward function must return finite numbers")
        return scores  # type: ignore[return-value]

    def _where(self) -> str:
        return f"reward term {self.name!r} (function {self.spec})"


def row_metadata(sample_id, prompt_id, owner, response_tokens, finish, extra: Sequence[dict] | None = None) -> list[dict]:
    """The `metadata` dict of each sample, from the batch columns of the same names, over the row's own
    columns `extra` (the dataset's metadata; on a clash of names the sample's keys win)."""
    extra = extra if extra is not None else [{}] * len(sample_id)
    return [{**e, "sample_id": int(s), "prompt_id": int(p), "owner": int(o), "response_tokens": int(n),
             "finish": FINISH.get(int(f), str(int(f)))}
            for s, p, o, n, f, e in zip(sample_id, prompt_id, owner, response_tokens, finish, extra, strict=True)]


def _row(meta: dict, prompt: str) -> str:
    shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    return (f"sample {meta['sample_id']} (prompt id {meta['prompt_id']} of the trainer replica at world rank "
            f"{meta['owner']}, prompt {shown!r})")
