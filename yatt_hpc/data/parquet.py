"""Parquet prompt files, read lazily by row group: the footer gives the row counts, a row is read when asked for.

    src = ParquetSource("data/train-00000-of-00003.parquet", RowSchema())
    len(src)        # from the footer: no data read
    src.row(17)     # decodes row 17's row group, only the columns the run uses; the last two stay cached

Columns are checked against the file's schema when it is opened (names and types, nothing read);
values (a null prompt, an empty message list) when their row is read. A read decodes a whole row
group, so files meant for random access want row groups of at most some thousands of rows
(`pyarrow.parquet.write_table(..., row_group_size=1000)`; Hugging Face datasets writes them so).
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from yatt_hpc.data.rows import BasePromptSource, DatasetError, PromptRow, RowSchema

_GROUPS_KEPT = 2


class ParquetSource(BasePromptSource):
    """The rows of one Parquet file, each checked when it is read."""

    def __init__(self, path: str | Path, schema: RowSchema | None = None) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = Path(path)
        self.name = str(path)
        self.schema = schema or RowSchema()
        try:
            self._file = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as err:
            raise DatasetError(f"{path}: not a readable Parquet file ({_first_line(err)}); the file is damaged or "
                               "not Parquet: rewrite it (pyarrow.parquet.write_table) or point data.source "
                               "elsewhere") from None
        self.columns = self._check_columns(self._file.schema_arrow)
        meta = self._file.metadata
        counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        self._groups: OrderedDict[int, object] = OrderedDict()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def row(self, index: int) -> PromptRow:
        return self.read(index, index)

    def read(self, local: int, index: int) -> PromptRow:
        """Row `local` of this file as the row at `index` of the source it belongs to."""
        if not 0 <= local < len(self):
            raise IndexError(f"{self.path} has {len(self)} rows, asked for row {local}")
        g = int(np.searchsorted(self._starts, local, side="right")) - 1
        obj = self._group(g).slice(local - int(self._starts[g]), 1).to_pylist()[0]
        return self.schema.row_from(obj, f"{self.path} row {local}", index, base=self.path.parent)

    def first_row(self) -> PromptRow | None:
        """The first row; None for a file without rows."""
        return self.row(0) if len(self) else None

    def probe(self) -> PromptRow:
        if not len(self):
            raise DatasetError(f"{self.path}: the file has no rows; write the prompts into it, or point data.source "
                               "elsewhere")
        return self.row(0)

    def _group(self, g: int):
        import pyarrow as pa

        if g in self._groups:
            self._groups.move_to_end(g)
            return self._groups[g]
        try:
            table = self._file.read_row_group(g, columns=self.columns)
        except (pa.ArrowException, OSError) as err:
            raise DatasetError(f"{self.path}: row group {g} (rows {self._starts[g]}..{self._starts[g + 1] - 1}) cannot "
                               f"be read ({_first_line(err)}); the file is damaged: rewrite it") from None
        self._groups[g] = table
        if len(self._groups) > _GROUPS_KEPT:
            self._groups.popitem(last=False)
        return table

    def _check_columns(self, arrow_schema) -> list[str]:
        """The columns to read; every column the run needs present and of a usable type."""
        self._check_row_columns(arrow_schema)
        wanted = [c for c in self.schema.consumed if c in arrow_schema.names] + self._metadata_columns(arrow_schema)
        return [c for c in dict.fromkeys(wanted + ["id"]) if c in arrow_schema.names]

    def _check_row_columns(self, arrow_schema) -> None:
        s, names = self.schema, arrow_schema.names
        has = ", ".join(map(repr, names)) or "none"

        def kind(name: str):
            return arrow_schema.field(name).type

        chat_rows = s.format == "chat" and s.messages_key in names
        if s.prompt_key not in names and not chat_rows:
            if s.format == "text" and s.messages_key in names:
                fix = f"column {s.messages_key!r} holds chat messages: set data.format=chat"
            elif s.format == "chat":
                fix = (f"give the file a {s.messages_key!r} column (list of {{role, content}}) or a {s.prompt_key!r} "
                       "column (strings), or set data.messages_key / data.prompt_key to the columns that hold them")
            else:
                fix = "add it, or set data.prompt_key to the column that holds the prompt"
            raise DatasetError(f"{self.path}: no {s.prompt_key!r} column (it has: {has}); {fix}")
        if s.prompt_key in names and not _is_string(kind(s.prompt_key)):
            raise DatasetError(f"{self.path}: column {s.prompt_key!r} has type {kind(s.prompt_key)}; the prompt column "
                               "must hold strings: convert it, or set data.prompt_key to the column that does")
        if chat_rows and not _is_messages(kind(s.messages_key)):
            raise DatasetError(f"{self.path}: column {s.messages_key!r} has type {kind(s.messages_key)}; chat messages "
                               "must be a list of struct<role: string, content: string>: convert it, or set "
                               "data.messages_key to the column that holds them")
        if s.answer_key in names:
            if not (_is_string(kind(s.answer_key)) or _is_number(kind(s.answer_key))):
                raise DatasetError(f"{self.path}: column {s.answer_key!r} has type {kind(s.answer_key)}; the reference "
                                   "answer must be a string or a number: convert it, or set data.answer_key")
        elif s.require_answer:
            raise DatasetError(f"{self.path}: no {s.answer_key!r} column (it has: {has}); add the reference answer the "
                               "rule verifier checks, set data.answer_key to the column that holds it, or score "
                               "with the GenRM alone (reward.mode=rm_only)")
        if s.images_key is not None:
            self._check_images_column(arrow_schema)

    def _check_images_column(self, arrow_schema) -> None:
        key, names = self.schema.images_key, arrow_schema.names
        if key not in names:
            raise DatasetError(f"{self.path}: no {key!r} column (data.images_key; it has: "
                               f"{', '.join(map(repr, names)) or 'none'}); set data.images_key to the column that holds "
                               "the images, or unset it for a text-only dataset")
        kind = arrow_schema.field(key).type
        if not _is_images(kind):
            raise DatasetError(f"{self.path}: column {key!r} (data.images_key) has type {kind}; images must be a "
                               "list of struct<bytes: binary, path: string> (Hugging Face's Image feature), one such "
                               "struct, encoded bytes or file paths, or a list of those: convert it, or set "
                               "data.images_key to the column that holds them")

    def _metadata_columns(self, arrow_schema) -> list[str]:
        s, names = self.schema, arrow_schema.names
        has = ", ".join(map(repr, names)) or "none"
        if s.metadata_columns is None:
            metadata = [n for n in names if n not in s.consumed]
        else:
            metadata = list(s.metadata_columns)
            missing = [c for c in metadata if c not in names]
            if missing:
                raise DatasetError(f"{self.path}: data.metadata_columns names {', '.join(map(repr, missing))} but the "
                                   f"file has no such column (it has: {has}); fix data.metadata_columns")
        for name in metadata:
            kind = arrow_schema.field(name).type
            if not _is_json(kind):
                images = f"; if it holds the images, set data.images_key={name}" if _is_images(kind) else ""
                raise DatasetError(f"{self.path}: column {name!r} has type {kind}, which has no JSON value to "
                                   "pass to reward functions as metadata; list the columns they need in "
                                   f"data.metadata_columns (without {name!r}), or [] for none{images}")
        return metadata


def _is_string(t) -> bool:
    import pyarrow.types as pt

    if pt.is_dictionary(t):
        return _is_string(t.value_type)
    return pt.is_string(t) or pt.is_large_string(t) or getattr(pt, "is_string_view", lambda _: False)(t) \
        or pt.is_null(t)


def _is_number(t) -> bool:
    import pyarrow.types as pt

    return pt.is_integer(t) or pt.is_floating(t)


def _is_list(t) -> bool:
    import pyarrow.types as pt

    return pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t)


def _is_messages(t) -> bool:
    import pyarrow.types as pt

    if not _is_list(t) or not pt.is_struct(t.value_type):
        return False
    fields = {t.value_type.field(i).name: t.value_type.field(i).type for i in range(t.value_type.num_fields)}
    return all(f in fields and _is_string(fields[f]) for f in ("role", "content"))


def _is_images(t) -> bool:
    """One image or a list of them: encoded bytes, a path, or a struct of `bytes` and/or `path`."""
    import pyarrow.types as pt

    def one(u) -> bool:
        if pt.is_struct(u):
            check = {"bytes": _is_binary, "path": _is_string}
            fields = [u.field(i) for i in range(u.num_fields)]
            return bool(fields) and all(f.name in check and check[f.name](f.type) for f in fields)
        return _is_binary(u) or _is_string(u)

    return one(t.value_type) if _is_list(t) else one(t)


def _is_binary(t) -> bool:
    import pyarrow.types as pt

    return pt.is_binary(t) or pt.is_large_binary(t) or pt.is_fixed_size_binary(t) \
        or getattr(pt, "is_binary_view", lambda _: False)(t) or pt.is_null(t)


def _is_json(t) -> bool:
    """Values that `to_pylist` gives as JSON values (None, bool, numbers, str, lists, dicts)."""
    import pyarrow.types as pt

    if pt.is_dictionary(t):
        return _is_json(t.value_type)
    if _is_list(t):
        return _is_json(t.value_type)
    if pt.is_struct(t):
        return all(_is_json(t.field(i).type) for i in range(t.num_fields))
    return pt.is_boolean(t) or _is_number(t) or _is_string(t)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
