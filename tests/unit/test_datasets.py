"""Dataset files: JSONL and Parquet give the same rows, directories of shards read as one list, rows are
read lazily by position (the JSONL line index, Parquet row groups), and every bad file or row is a
`DatasetError` naming the file, the row, the column and the fix.

    .venv/bin/python -m pytest tests/unit/test_datasets.py -q
"""
from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from yatt_hpc.config.schema import DataConfig
from yatt_hpc.data import jsonl
from yatt_hpc.data.jsonl import JsonlSource, index_lines
from yatt_hpc.data.parquet import ParquetSource
from yatt_hpc.data.prompts import PromptStream, ShardedSource, build_prompt_source, open_prompt_source
from yatt_hpc.data.rows import DatasetError, RowSchema

RECORDS = [{"id": 100 + i, "prompt": f"reverse w{i}=", "answer": f"{i}w", "level": i % 3, "tags": ["a", str(i)]}
           for i in range(25)]


def _jsonl(path, records, blank_every: int = 0):
    lines = []
    for i, r in enumerate(records):
        lines.append(json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _parquet(path, records, row_group_size: int = 4, schema=None):
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path, row_group_size=row_group_size)
    return path


def _rows(source) -> list[dict]:
    return [{k: v for k, v in source.row(i).items() if k != "origin"} for i in range(len(source))]


# ------------------------------------------------------------------ the same rows, whatever the layout


def test_jsonl_parquet_and_a_directory_of_three_shards_give_the_same_rows(tmp_path):
    whole = JsonlSource(_jsonl(tmp_path / "all.jsonl", RECORDS, blank_every=4))
    par = ParquetSource(_parquet(tmp_path / "all.parquet", RECORDS, row_group_size=4))
    assert par._file.metadata.num_row_groups == 7
    (tmp_path / "jshards").mkdir()
    (tmp_path / "pshards").mkdir()
    for k, (a, b) in enumerate([(0, 9), (9, 10), (10, 25)]):  # written out of order: read in name order
        _jsonl(tmp_path / "jshards" / f"part-{2 - k}.jsonl", RECORDS[a:b])
        _parquet(tmp_path / "pshards" / f"part-{2 - k}.parquet", RECORDS[a:b], row_group_size=3)
    jshards, pshards = open_prompt_source(str(tmp_path / "jshards")), open_prompt_source(str(tmp_path / "pshards"))
    assert isinstance(jshards, ShardedSource) and [s.path.name for s in jshards.shards] == [
        "part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]
    expected = _rows(whole)
    assert len(expected) == 25 and expected[3]["metadata"] == {"id": 103, "level": 0, "tags": ["a", "3"]}
    reordered = RECORDS[10:25] + RECORDS[9:10] + RECORDS[0:9]  # part-0 holds rows 10..24
    assert [r["id"] for r in _rows(jshards)] == [r["id"] for r in reordered]
    assert _rows(par) == expected
    assert _rows(jshards) == _rows(pshards)
    assert jshards.row(0)["origin"] == f"{tmp_path}/jshards/part-0.jsonl:1"
    assert pshards.row(16)["origin"] == f"{tmp_path}/pshards/part-2.parquet row 0"


def test_rows_without_an_id_are_numbered_by_their_place_in_the_whole_directory(tmp_path):
    (tmp_path / "d").mkdir()
    plain = [{"prompt": f"p{i}", "answer": "a"} for i in range(6)]
    _jsonl(tmp_path / "d" / "a.jsonl", plain[:2])
    (tmp_path / "d" / "b.jsonl").write_text("\n")  # an empty shard is allowed
    _jsonl(tmp_path / "d" / "c.jsonl", plain[2:])
    source = open_prompt_source(str(tmp_path / "d"))
    assert [source.row(i)["id"] for i in range(len(source))] == list(range(6))
    assert source.row(2)["origin"] == f"{tmp_path}/d/c.jsonl:1"


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "shards"])
def test_positions_map_to_the_same_rows_across_two_opens(tmp_path, kind):
    if kind == "jsonl":
        path = _jsonl(tmp_path / "p.jsonl", RECORDS)
    elif kind == "parquet":
        path = _parquet(tmp_path / "p.parquet", RECORDS)
    else:
        path = tmp_path / "d"
        path.mkdir()
        for k in range(3):
            _parquet(path / f"{k}.parquet", RECORDS[k * 9:(k + 1) * 9])
    first = build_prompt_source(DataConfig(source=str(path), seed=7))
    second = build_prompt_source(DataConfig(source=str(path), seed=7))
    positions = [0, 5, 24, 25, 49, 60, 1000]  # several epochs
    assert [first.row_at(p) for p in positions] == [second.row_at(p) for p in reversed(positions)][::-1]
    epoch = [first.row_at(p)["id"] for p in range(25, 50)]
    assert sorted(epoch) == [r["id"] for r in RECORDS]


def test_a_bigger_stream_walks_every_row_once_per_epoch(tmp_path):
    stream = PromptStream(JsonlSource(_jsonl(tmp_path / "p.jsonl", RECORDS)), seed=3)
    for epoch in range(2):
        assert sorted(stream.row_at(epoch * 25 + k)["id"] for k in range(25)) == [r["id"] for r in RECORDS]


# ------------------------------------------------------------------ lazy reading


def test_a_line_never_asked_for_is_never_parsed_and_asking_for_it_names_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", RECORDS)
    lines = path.read_text().splitlines()
    lines[17] = '{"prompt": "broken", "answer": '
    path.write_text("\n".join(lines) + "\n")
    stream = build_prompt_source(DataConfig(source=str(path), seed=1))
    assert len(stream) == 25  # indexed without parsing
    for i in (0, 16, 18, 24):
        assert stream.source.row(i)["id"] == 100 + i
    with pytest.raises(DatasetError, match=f"^{path}:18: not valid JSON .*each line must be one JSON object"):
        stream.source.row(17)


def test_opening_reads_neither_the_index_nor_more_than_the_first_row(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", RECORDS)
    stream = build_prompt_source(DataConfig(source=str(path)))
    assert stream.source._index is None  # a tensor-parallel peer that never reads pays nothing more
    stream.row_at(3)
    assert len(stream.source._index) == 25


def test_parquet_reads_only_the_row_groups_asked_for(tmp_path, monkeypatch):
    source = ParquetSource(_parquet(tmp_path / "p.parquet", RECORDS, row_group_size=5))
    read = []
    real = source._file.read_row_group
    monkeypatch.setattr(source._file, "read_row_group", lambda g, columns: read.append(g) or real(g, columns=columns))
    assert len(source) == 25 and read == []  # from the footer
    source.row(12), source.row(13), source.row(24), source.row(11)
    assert read == [2, 4]


def _reference_index(data: bytes) -> tuple[list[tuple[int, int]], list[int]]:
    spans, numbers, pos = [], [], 0
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            spans.append((pos, pos + len(line)))
            numbers.append(lineno)
        pos += len(line) + 1
    return spans, numbers


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 22])
def test_the_line_index_is_right_across_chunk_boundaries(tmp_path, monkeypatch, chunk):
    rng = random.Random(chunk)
    print("seed", chunk)
    parts = []
    for _ in range(60):
        parts.append(rng.choice(["", " ", "\t \r", '{"a": 1}', '{"prompt": "x y"}\r', "  {}  ", "é" * rng.randrange(5)]))
    data = "\n".join(parts).encode()
    for tail in (b"", b"\n", b'\n{"last": 1}'):
        path = tmp_path / "x.jsonl"
        path.write_bytes(data + tail)
        monkeypatch.setattr(jsonl, "_CHUNK", chunk)
        ix = index_lines(path)
        spans, numbers = _reference_index(data + tail)
        assert list(zip(ix.starts.tolist(), ix.ends.tolist())) == spans
        assert [ix.line_number(r) for r in range(len(ix))] == numbers


# ------------------------------------------------------------------ answers and metadata


def test_answers_are_optional_when_no_rule_term_needs_them(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "judge me"}, {"prompt": "me too", "answer": None}])
    stream = build_prompt_source(DataConfig(source=str(path)), require_answer=False)
    assert [stream.source.row(i)["answer"] for i in range(2)] == ["", ""]
    with pytest.raises(DatasetError, match=f"{path}:1: row has no 'answer' column .*reward.mode=rm_only"):
        build_prompt_source(DataConfig(source=str(path)))
    par = _parquet(tmp_path / "p.parquet", [{"prompt": "judge me"}])
    assert build_prompt_source(DataConfig(source=str(par)), require_answer=False).row_at(0)["answer"] == ""
    with pytest.raises(DatasetError, match=f"{par}: no 'answer' column .*reward.mode=rm_only"):
        build_prompt_source(DataConfig(source=str(par)))


def test_metadata_columns_select_what_reward_functions_see(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", RECORDS[:3])
    row = build_prompt_source(DataConfig(source=str(path), metadata_columns=["level"])).row_at(0)
    assert row["metadata"] == {"level": RECORDS[row["id"] - 100]["level"]}
    assert build_prompt_source(DataConfig(source=str(path), metadata_columns=[])).row_at(0)["metadata"] == {}
    with pytest.raises(DatasetError, match=f"{path}:1: data.metadata_columns names 'nope' but the row has no such"):
        build_prompt_source(DataConfig(source=str(path), metadata_columns=["nope"]))
    par = _parquet(tmp_path / "p.parquet", RECORDS[:3])
    assert build_prompt_source(DataConfig(source=str(par), metadata_columns=["tags"])).row_at(0)["metadata"]["tags"][0] == "a"
    with pytest.raises(DatasetError, match=f"{par}: data.metadata_columns names 'nope'"):
        build_prompt_source(DataConfig(source=str(par), metadata_columns=["nope"]))


def test_a_parquet_column_without_json_values_must_be_left_out_of_the_metadata(tmp_path):
    records = [{"prompt": "describe", "answer": "cat", "image": {"bytes": b"\x89PNG", "path": "a.png"}}]
    path = _parquet(tmp_path / "img.parquet", records)
    with pytest.raises(DatasetError, match=f"{path}: column 'image' has type struct<bytes: binary, path: string>.*"
                                           r"data.metadata_columns \(without 'image'\)"):
        ParquetSource(path)
    assert ParquetSource(path, RowSchema(metadata_columns=())).columns == ["prompt", "answer"]  # image bytes never read


# ------------------------------------------------------------------ bad files: file, row, column, fix


@pytest.mark.parametrize("records,needle", [
    pytest.param([{"question": "q", "answer": "a"}], r"no 'prompt' column \(it has: 'question', 'answer'\); add it, "
                 "or set data.prompt_key", id="missing-column"),
    pytest.param([{"prompt": 3, "answer": "a"}], "column 'prompt' has type int64; the prompt column must hold "
                 "strings", id="int-prompt-column"),
    pytest.param([{"prompt": "q", "answer": True}], "column 'answer' has type bool; the reference answer must be",
                 id="bool-answer-column"),
    pytest.param([{"messages": [{"role": "user", "content": "hi"}], "answer": "a"}],
                 "no 'prompt' column .*column 'messages' holds chat messages: set data.format=chat", id="chat-in-text"),
])
def test_bad_parquet_columns_are_named_when_the_file_opens(tmp_path, records, needle):
    path = _parquet(tmp_path / "bad.parquet", records)
    with pytest.raises(DatasetError, match=needle) as err:
        ParquetSource(path)
    assert str(err.value).startswith(f"{path}: ")


def test_a_null_prompt_in_parquet_names_the_row_and_the_column(tmp_path):
    path = _parquet(tmp_path / "p.parquet", [{"prompt": "fine", "answer": "a"}, {"prompt": None, "answer": "b"}])
    source = ParquetSource(path)
    assert source.row(0)["prompt"] == "fine"
    with pytest.raises(DatasetError, match=f"^{path} row 1: column 'prompt' must be a non-empty string, got null"):
        source.row(1)


def test_unreadable_and_truncated_parquet_files_are_dataset_errors(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(DatasetError, match=f"^{garbage}: not a readable Parquet file .*rewrite it"):
        open_prompt_source(str(garbage))
    good = _parquet(tmp_path / "good.parquet", RECORDS)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DatasetError, match=f"^{cut}: not a readable Parquet file"):
        open_prompt_source(str(cut))


def test_a_parquet_file_without_the_suffix_is_recognised_by_its_magic(tmp_path):
    path = tmp_path / "prompts.data"
    _parquet(path, RECORDS[:2])
    assert isinstance(open_prompt_source(str(path)), ParquetSource)


def test_directory_errors_name_the_directory_and_the_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("x")
    with pytest.raises(DatasetError, match=f"^{empty}: the directory has no \\*.jsonl or \\*.parquet files "
                                           r"\(it has: README.md\)"):
        open_prompt_source(str(empty))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _jsonl(mixed / "a.jsonl", RECORDS[:1])
    _parquet(mixed / "b.parquet", RECORDS[:1])
    with pytest.raises(DatasetError, match=f"^{mixed}: the directory holds both .*keep one kind"):
        open_prompt_source(str(mixed))
    blank = tmp_path / "blank"
    blank.mkdir()
    for k in range(2):
        (blank / f"{k}.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match=f"^{blank}: none of its 2 files has a row"):
        build_prompt_source(DataConfig(source=str(blank)))
    with pytest.raises(DatasetError, match="no such file or directory; data.source must be"):
        open_prompt_source(str(tmp_path / "nowhere"))


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(json.dumps(RECORDS[0]).encode() + b'\n{"prompt": "\xff", "answer": "a"}\n')
    with pytest.raises(DatasetError, match=f"^{path}:2: not valid UTF-8 .*save the file as UTF-8"):
        JsonlSource(path).row(1)


def test_a_utf8_bom_before_the_first_row_is_allowed(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORDS[0]).encode() + b"\n")
    assert JsonlSource(path).row(0)["prompt"] == RECORDS[0]["prompt"] == JsonlSource(path).probe()["prompt"]


def test_the_index_of_a_file_is_three_flat_arrays(tmp_path):
    ix = index_lines(_jsonl(tmp_path / "p.jsonl", RECORDS, blank_every=5))
    assert ix.starts.dtype == ix.ends.dtype == np.int64 and len(ix) == 25 and len(ix.blank_before) == 5
