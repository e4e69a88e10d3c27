"""JSONL prompt files, read lazily: one streaming pass indexes the lines, a row is parsed when it is asked for.

    src = JsonlSource("data/train.jsonl", RowSchema())
    src.probe()     # the first row, read without any index (a misnamed column fails when the source opens)
    len(src)        # builds the index on first use: byte offsets of every non-blank line, no JSON parsed
    src.row(17)     # reads (os.pread) and checks that one line; its errors name path:line

The index is three arrays (16 bytes a row, plus 8 per blank line), built in chunks of 4 MiB with numpy
(newlines found vectorised; only lines that start with whitespace are looked at byte by byte), so memory
stays flat whatever the file's size. Blank (whitespace-only) lines are no rows.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from yatt_hpc.data.rows import BasePromptSource, DatasetError, PromptRow, RowSchema

_CHUNK = 1 << 22
_SPACE = np.zeros(256, bool)
_SPACE[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.strip() strips: a line of only these is blank


@dataclass(frozen=True)
class LineIndex:
    """Where the non-blank lines of a file are."""

    starts: np.ndarray
    """Byte offset of each non-blank line (int64)."""
    ends: np.ndarray
    """Byte offset just past each non-blank line, its newline excluded (int64)."""
    blank_before: np.ndarray
    """For each blank line, how many non-blank lines come before it (for line numbers)."""

    def __len__(self) -> int:
        return len(self.starts)

    def line_number(self, row: int) -> int:
        """The 1-based line number of non-blank line `row`."""
        return row + 1 + int(np.searchsorted(self.blank_before, row, side="right"))


def index_lines(path: str | Path) -> LineIndex:
    """One streaming pass over `path`: the offsets of its non-blank lines (no JSON parsed)."""
    starts, ends, blanks = [], [], []
    rows, off, line_start, has_text = 0, 0, 0, False
    buf = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            a = np.frombuffer(buf, np.uint8, n)
            nl = np.flatnonzero(a == 10)
            if not len(nl):  # a line longer than a chunk
                has_text = has_text or bool(buf[:n].strip())
                off += n
                continue
            first = np.concatenate(([0], nl[:-1] + 1))  # where each line that ends in this chunk starts here
            keep = ~_SPACE[a[first]]  # a line that starts with text has text; the rest (rare) are looked at
            for k in np.flatnonzero(~keep):
                keep[k] = bool(buf[first[k]:nl[k]].strip())
            keep[0] |= has_text  # the first line began in an earlier chunk
            begin = off + first
            begin[0] = line_start
            starts.append(begin[keep])
            ends.append(off + nl[keep])
            before = np.cumsum(keep)
            blanks.append(rows + before[~keep])
            rows += int(before[-1])
            line_start, has_text = off + int(nl[-1]) + 1, bool(buf[int(nl[-1]) + 1:n].strip())
            off += n
    if has_text:  # a last line without a newline
        starts.append(np.array([line_start]))
        ends.append(np.array([off]))

    def joined(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    return LineIndex(joined(starts), joined(ends), joined(blanks))


class JsonlSource(BasePromptSource):
    """The rows of a JSONL file (one object per line), each parsed and checked when it is read."""

    def __init__(self, path: str | Path, schema: RowSchema | None = None) -> None:
        self.path = Path(path)
        self.name = str(path)
        self.schema = schema or RowSchema()
        if not self.path.is_file():
            raise DatasetError(f"{path}: no such file; data.source must be `demo:train`, a JSONL or Parquet file, "
                               "or a directory of *.jsonl or *.parquet files")
        self._index: LineIndex | None = None
        self._fd: int | None = None

    @property
    def index(self) -> LineIndex:
        if self._index is None:
            self._index = index_lines(self.path)
        return self._index

    def __len__(self) -> int:
        return len(self.index)

    def row(self, index: int) -> PromptRow:
        return self.read(index, index)

    def read(self, local: int, index: int) -> PromptRow:
        """Line `local` of this file as the row at `index` of the source it belongs to."""
        ix = self.index
        if not 0 <= local < len(ix):
            raise IndexError(f"{self.path} has {len(ix)} rows, asked for row {local}")
        start, end = int(ix.starts[local]), int(ix.ends[local])
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._parse(os.pread(self._fd, end - start, start), ix.line_number(local), index)

    def first_row(self) -> PromptRow | None:
        """The first row, read without the index; None for a file without rows."""
        with self.path.open("rb") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    return self._parse(line, lineno, 0)
        return None

    def probe(self) -> PromptRow:
        first = self.first_row()
        if first is None:
            s = self.schema
            raise DatasetError(f"{self.path}: the file has no rows; add one JSON object per line, e.g. "
                               f"{{\"{s.prompt_key}\": \"What is 2+2?\", \"{s.answer_key}\": \"4\"}}")
        return first

    def _parse(self, data: bytes, lineno: int, index: int) -> PromptRow:
        where = f"{self.path}:{lineno}"
        try:
            text = data.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as e:
            raise DatasetError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line); "
                               "save the file as UTF-8") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                               f"each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}; "
                               "each line must be one JSON object")
        return self.schema.row_from(obj, where, index, base=self.path.parent)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
