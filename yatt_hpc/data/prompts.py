"""Prompt sources for the trainer (the built-in demo task, JSONL or Parquet files, directories of shards),
walked in a seeded order.

    from yatt_hpc.data.prompts import build_prompt_source, open_prompt_source, PromptStream
    prompts = build_prompt_source(cfg.data, tokenizer)   # a PromptStream over data.source, data.seed
    row = prompts.row_at(position)  # a PromptRow (data/rows.py); epoch = position // len(prompts)
    ids = prompts.encode(row)       # the policy's input ids (data.format), within data.max_prompt_tokens
    PromptStream(open_prompt_source("data/train/"), seed=0).rows_at(start, count)

Shard-aware by construction: the row at a position is a pure function of (source, seed, position),
through `epoch_permutation(seed, epoch, size)`. A data-parallel rank computes the positions it owns
(e.g. `step * prompts_per_step + dp_rank * per_rank + k`) and asks only for those, so ranks never
read each other's rows and a restart at step N sees exactly the prompts it would have seen.

Lazy by construction: opening a source reads its first row (a misnamed column fails at once) and
Parquet footers; a JSONL file is indexed (the byte offsets of its lines, no JSON parsed) when a row
is first asked for; a row is parsed, checked and tokenized when it is read. A bad row fails when it
is reached, as a `DatasetError` naming the file, the row, the column and the fix.

`data.source` is `demo:train` / `demo:heldout` (the reverse-a-word task), `demo:shapes-train` /
`demo:shapes-heldout` (count the red shapes in an image, demo/shapes.py), a `.jsonl` file (one object
per line), a `.parquet` file, or a directory: all its `*.jsonl` or all its `*.parquet` files, in sorted
name order, as one list of rows. Columns: data.prompt_key (text), data.messages_key (chat, else the
prompt as the user's message), data.answer_key (optional with reward.mode=rm_only), data.images_key
(images, read when their row is read); the others become the row's metadata.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from yatt_hpc.data.encode import build_prompt_encoder
from yatt_hpc.data.jsonl import JsonlSource
from yatt_hpc.data.parquet import ParquetSource
from yatt_hpc.data.rows import BasePromptSource, DatasetError, PromptRow, RowSchema
from yatt_hpc.demo.shapes import shapes_row
from yatt_hpc.demo.task import SPLITS, demo_row
from yatt_hpc.vision.images import ImageLimits

if TYPE_CHECKING:
    from yatt_hpc.config.schema import DataConfig
    from yatt_hpc.data.tokenizer import Tokenizer
    from yatt_hpc.vision.processor import ImageProcessor

__all__ = ["BasePromptSource", "DatasetError", "DemoTaskSource", "JsonlSource", "ParquetSource", "PromptRow",
           "PromptStream", "RowSchema", "ShapesTaskSource", "ShardedSource", "build_prompt_source",
           "epoch_permutation", "open_prompt_source"]

DEMO_SOURCES = tuple(f"demo:{task}{s}" for task in ("", "shapes-") for s in SPLITS)
DEMO_CONTENT_SEED = 0
"""Seed of the demo task's words; the walk order has its own seed (`data.seed`)."""
_PERMUTATIONS_KEPT = 2  # a step can straddle two epochs; older ones are never asked for again
FileSource = JsonlSource | ParquetSource


class DemoTaskSource(BasePromptSource):
    """The first `size` rows of a demo-task split, generated on demand (no file, no memory)."""

    images_key: str | None = None  # the column of the task's images: none here

    def __init__(self, size: int = 4096, split: str = "train", seed: int = DEMO_CONTENT_SEED,
                 schema: RowSchema | None = None) -> None:
        if split not in SPLITS:
            raise DatasetError(f"unknown demo split {split!r}; use one of: " + ", ".join(DEMO_SOURCES))
        if size < 1:
            raise DatasetError(f"the demo task needs at least 1 prompt, got num_prompts={size}")
        self.size, self.split, self.seed = size, split, seed
        self.name = f"demo:{split}"
        # the demo's rows have fixed columns; the run's format, system prompt and image limits still apply
        self.schema = replace(schema or RowSchema(), prompt_key="prompt", answer_key="answer", require_answer=True,
                              metadata_columns=None, images_key=self.images_key)

    def __len__(self) -> int:
        return self.size

    def row(self, index: int) -> PromptRow:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name} has {self.size} rows, asked for row {index}")
        r = self._record(index)
        return self.schema.row_from({k: v for k, v in r.items() if k != "id"}, f"{self.name}#{index}", r["id"])

    def _record(self, index: int) -> dict:
        return demo_row(self.seed, index, self.split)


class ShapesTaskSource(DemoTaskSource):
    """The first `size` rows of a split of the count-the-shapes task (demo/shapes.py), each image drawn when
    its row is read."""

    images_key = "images"

    def __init__(self, size: int = 4096, split: str = "train", seed: int = DEMO_CONTENT_SEED,
                 schema: RowSchema | None = None) -> None:
        super().__init__(size, split, seed, schema)
        self.name = f"demo:shapes-{split}"

    def _record(self, index: int) -> dict:
        return shapes_row(self.seed, index, self.split)


class ShardedSource(BasePromptSource):
    """The files of a directory, in sorted name order, as one list of rows (a file may be empty)."""

    def __init__(self, directory: str | Path, shards: list[FileSource]) -> None:
        self.name, self.shards = str(directory), shards
        self._starts: np.ndarray | None = None

    @property
    def starts(self) -> np.ndarray:
        """Index of each shard's first row; the last entry is the total."""
        if self._starts is None:
            counts = [len(s) for s in self.shards]
            if not sum(counts):
                raise DatasetError(f"{self.name}: none of its {len(self.shards)} files has a row; write the prompts "
                                   "into them, or point data.source at another directory")
            self._starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        return self._starts

    def __len__(self) -> int:
        return int(self.starts[-1])

    def row(self, index: int) -> PromptRow:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name} has {len(self)} rows, asked for row {index}")
        k = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.shards[k].read(index - int(self.starts[k]), index)

    def probe(self) -> PromptRow:
        for shard in self.shards:
            first = shard.first_row()
            if first is not None:
                return first
        raise DatasetError(f"{self.name}: none of its {len(self.shards)} files has a row; write the prompts "
                           "into them, or point data.source at another directory")


def open_prompt_source(source: str, schema: RowSchema | None = None, *, num_prompts: int = 4096) -> BasePromptSource:
    """`demo:train` / `demo:heldout` (`demo` = `demo:train`), `demo:shapes-train` / `demo:shapes-heldout`, a JSONL
    or Parquet file, or a directory of them."""
    if source == "demo" or source.startswith("demo:"):
        split = source.partition(":")[2] or "train"
        if split.startswith("shapes-"):
            return ShapesTaskSource(num_prompts, split.removeprefix("shapes-"), schema=schema)
        return DemoTaskSource(num_prompts, split, schema=schema)
    path = Path(source)
    if not path.is_dir():
        return _open_file(path, schema)
    files = {ext: sorted(p for p in path.glob(f"*.{ext}") if p.is_file() and not p.name.startswith("."))
             for ext in ("jsonl", "parquet")}
    if files["jsonl"] and files["parquet"]:
        raise DatasetError(f"{source}: the directory holds both *.jsonl ({len(files['jsonl'])}) and *.parquet "
                           f"({len(files['parquet'])}) files, so which rows it holds is ambiguous; keep one kind "
                           "there, or point data.source at one file")
    shards = files["jsonl"] or files["parquet"]
    if not shards:
        seen = sorted(p.name for p in path.iterdir())
        raise DatasetError(f"{source}: the directory has no *.jsonl or *.parquet files (it has: "
                           f"{', '.join(seen[:8]) + (', ...' if len(seen) > 8 else '') if seen else 'nothing'}); "
                           "put the prompt files there, or point data.source at a file")
    return ShardedSource(source, [_open_file(p, schema) for p in shards])


def _open_file(path: Path, schema: RowSchema | None) -> FileSource:
    if not path.is_file():
        raise DatasetError(f"{path}: no such file or directory; data.source must be `demo:train`, a JSONL or Parquet "
                           "file, or a directory of *.jsonl or *.parquet files")
    with path.open("rb") as f:
        magic = f.read(4)
    if path.suffix in (".parquet", ".pq") or magic == b"PAR1":
        return ParquetSource(path, schema)
    return JsonlSource(path, schema)


def build_prompt_source(data: DataConfig, tokenizer: Tokenizer | None = None, *,
                        require_answer: bool = True, images: ImageProcessor | None = None,
                        tools: list[dict] | None = None) -> PromptStream:
    """The configured prompts in the configured order. The first row is read (and, with a tokenizer,
    encoded) at once, so that a misnamed column or a missing template fails before any training; every
    other row is checked when it is read. `require_answer=False` (no rule term scores the run) lets
    rows go without data.answer_key. `images`: a vision-language policy's processor (rows' images
    expand to their image-pad tokens). `tools`: the agent's tool schemas, for the chat template's `tools=`
    (chat-format prompts)."""
    schema = RowSchema(format=data.format, prompt_key=data.prompt_key, answer_key=data.answer_key,
                       messages_key=data.messages_key, system_prompt=data.system_prompt,
                       require_answer=require_answer,
                       metadata_columns=None if data.metadata_columns is None else tuple(data.metadata_columns),
                       images_key=data.images_key, image_limits=ImageLimits(max_pixels=data.max_image_pixels))
    source = open_prompt_source(data.source, schema, num_prompts=data.num_prompts)
    encode = build_prompt_encoder(data, tokenizer, images, tools) if tokenizer is not None else None
    first = source.probe()
    if encode is not None:
        encode(first)
    return PromptStream(source, data.seed, encode)


def epoch_permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    """The order of the source's rows in `epoch`: a pure function of its arguments."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(size)


class PromptStream:
    """An endless walk over a source: each epoch visits every row once, in a seeded order."""

    def __init__(self, source: BasePromptSource, seed: int,
                 encode: Callable[[PromptRow], list[int]] | None = None) -> None:
        self.source, self.seed = source, seed
        self._encode = encode
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

    def encode(self, row: PromptRow) -> list[int]:
        """The policy's input ids for `row` (DatasetError if over data.max_prompt_tokens)."""
        if self._encode is None:
            raise RuntimeError("this PromptStream was built without a tokenizer; pass one to build_prompt_source")
        return self._encode(row)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= _PERMUTATIONS_KEPT:
                del self._permutations[min(self._permutations)]
            self._permutations[epoch] = epoch_permutation(self.seed, epoch, len(self.source))
        return self._permutations[epoch]
