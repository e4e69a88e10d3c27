"""Prompt sources for the trainer (the built-in demo task or a JSONL file), walked in a seeded order.

    from yatt_hpc.data.prompts import build_prompt_source, open_prompt_source, PromptStream
    prompts = build_prompt_source(cfg.data, tokenizer)   # a PromptStream over data.source, data.seed
    prompts.row_at(position)      # {"id", "prompt", "answer", "origin"}; epoch = position // len(prompts)
    PromptStream(open_prompt_source("data/prompts.jsonl"), seed=0).rows_at(start, count)

Shard-aware by construction: the row at a position is a pure function of (source, seed, position),
through `epoch_permutation(seed, epoch, size)`. A data-parallel rank computes the positions it owns
(e.g. `step * prompts_per_step + dp_rank * per_rank + k`) and asks only for those, so ranks never
read each other's rows and a restart at step N sees exactly the prompts it would have seen.

A JSONL file holds one object per line, `{"prompt": "...", "answer": "..."}` (the keys can be
renamed through data.prompt_key / data.answer_key). Every problem with a file raises `DatasetError`,
whose message names the file, the line and the fix, for the CLI to print as is.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from yatt_hpc.demo.task import SPLITS, demo_row

if TYPE_CHECKING:
    from yatt_hpc.config.schema import DataConfig
    from yatt_hpc.demo.char_tokenizer import CharTokenizer

DEMO_CONTENT_SEED = 0
"""Seed of the demo task's words; the walk order has its own seed (`data.seed`)."""
_PERMUTATIONS_KEPT = 2  # a step can straddle two epochs; older ones are never asked for again


class DatasetError(ValueError):
    """A user error in a prompt dataset; the message is complete and meant to be printed as is."""


class PromptRow(TypedDict):
    """One prompt. `id`: the row's own `id` field if it has one, else its 0-based index in the
    source; `answer`: the reference the rule verifier checks; `origin`: `path:line` or
    `demo:split#index`, for error messages."""

    id: int
    prompt: str
    answer: str
    origin: str


class BasePromptSource(ABC):
    """A finite, indexable list of prompt rows."""

    name: str

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def row(self, index: int) -> PromptRow:
        """Row `index` in 0..len-1 of the source's own (unshuffled) order."""


class DemoTaskSource(BasePromptSource):
    """The first `size` rows of a demo-task split, generated on demand (no file, no memory)."""

    def __init__(self, size: int = 4096, split: str = "train", seed: int = DEMO_CONTENT_SEED) -> None:
        if split not in SPLITS:
            raise DatasetError(f"unknown demo split {split!r}; use one of: "
                               + ", ".join(f"demo:{s}" for s in SPLITS))
        if size < 1:
            raise DatasetError(f"the demo task needs at least 1 prompt, got num_prompts={size}")
        self.size, self.split, self.seed = size, split, seed
        self.name = f"demo:{split}"

    def __len__(self) -> int:
        return self.size

    def row(self, index: int) -> PromptRow:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name} has {self.size} rows, asked for row {index}")
        r = demo_row(self.seed, index, self.split)
        return PromptRow(id=r["id"], prompt=r["prompt"], answer=r["answer"], origin=f"{self.name}#{index}")


class JsonlSource(BasePromptSource):
    """All rows of a JSONL file, read and checked once so that errors surface before training."""

    def __init__(self, path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> None:
        self.path = Path(path)
        self.name = str(path)
        if not self.path.is_file():
            raise DatasetError(f"{path}: no such file; data.source must be `demo:train` or a JSONL file "
                               f"with one {{\"{prompt_key}\": ..., \"{answer_key}\": ...}} object per line")
        self._rows: list[PromptRow] = []
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    self._rows.append(self._parse(line, lineno, prompt_key, answer_key))
        if not self._rows:
            raise DatasetError(f"{path}: the file has no rows; add one JSON object per line, e.g. "
                               f"{{\"{prompt_key}\": \"reverse abcd=\", \"{answer_key}\": \"dcba\"}}")

    def _parse(self, line: str, lineno: int, prompt_key: str, answer_key: str) -> PromptRow:
        where = f"{self.path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                               f"each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if prompt_key not in obj:
            raise DatasetError(f"{where}: row has no {prompt_key!r} key (it has: {', '.join(map(repr, obj)) or 'none'}); "
                               f"add it, or set data.prompt_key to the key that holds the prompt")
        if answer_key not in obj:
            raise DatasetError(f"{where}: row has no {answer_key!r} key (it has: {', '.join(map(repr, obj))}); "
                               f"add the reference answer (\"\" for prompts only the GenRM judges, with "
                               f"reward.mode=rm_only), or set data.answer_key")
        prompt, answer = obj[prompt_key], obj[answer_key]
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{where}: {prompt_key!r} must be a non-empty string, got {prompt!r}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise DatasetError(f"{where}: {answer_key!r} must be a string or a number, got {answer!r}")
        row_id = obj["id"] if isinstance(obj.get("id"), int) else len(self._rows)
        return PromptRow(id=row_id, prompt=prompt, answer=str(answer), origin=where)

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> PromptRow:
        return self._rows[index]


def open_prompt_source(source: str, *, num_prompts: int = 4096, prompt_key: str = "prompt",
                       answer_key: str = "answer") -> BasePromptSource:
    """`demo:train` / `demo:heldout` (`demo` = `demo:train`) or the path of a JSONL file."""
    if source == "demo" or source.startswith("demo:"):
        return DemoTaskSource(num_prompts, source.partition(":")[2] or "train")
    return JsonlSource(source, prompt_key, answer_key)


def build_prompt_source(data: DataConfig, tokenizer: CharTokenizer | None = None) -> PromptStream:
    """The configured prompts in the configured order; with a tokenizer, every prompt is checked
    against `data.max_prompt_tokens` up front so that a long row fails before any training."""
    source = open_prompt_source(data.source, num_prompts=data.num_prompts, prompt_key=data.prompt_key,
                                answer_key=data.answer_key)
    if tokenizer is not None:
        check_prompt_lengths(source, tokenizer.encode_prompt, data.max_prompt_tokens)
    return PromptStream(source, data.seed)


def epoch_permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    """The order of the source's rows in `epoch`: a pure function of its arguments."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(size)


class PromptStream:
    """An endless walk over a source: each epoch visits every row once, in a seeded order."""

    def __init__(self, source: BasePromptSource, seed: int) -> None:
        self.source, self.seed = source, seed
        self._permutations: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Rows per epoch."""
        return len(self.source)

    def epoch_of(self, position: int) -> int:
        return position // len(self.source)

    def row_at(self, position: int) -> PromptRow:
        if position < 0:
            raise IndexError(f"prompt positions start at 0, got {position}")
        epoch, offset = divmod(position, len(self.source))
        return self.source.row(int(self._permutation(epoch)[offset]))

    def rows_at(self, start: int, count: int) -> list[PromptRow]:
        return [self.row_at(p) for p in range(start, start + count)]

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= _PERMUTATIONS_KEPT:
                del self._permutations[min(self._permutations)]
            self._permutations[epoch] = epoch_permutation(self.seed, epoch, len(self.source))
        return self._permutations[epoch]


def check_prompt_lengths(source: BasePromptSource, encode: Callable[[str], list[int]], max_tokens: int) -> None:
    """Raise `DatasetError` naming the first row whose prompt is longer than `max_tokens` tokens."""
    for i in range(len(source)):
        row = source.row(i)
        n = len(encode(row["prompt"]))
        if n > max_tokens:
            raise DatasetError(f"{row['origin']}: prompt is {n} tokens, over data.max_prompt_tokens={max_tokens}; "
                               f"shorten the prompt or raise data.max_prompt_tokens")
