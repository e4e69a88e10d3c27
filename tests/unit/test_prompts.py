"""Prompt sources: the demo source, JSONL rows and their errors, and the seeded shard-aware walk
(Parquet, directories of shards, lazy reading: test_datasets.py; chat prompts: test_chat_prompts.py).

    .venv/bin/python -m pytest tests/unit/test_prompts.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from yatt_hpc.config.schema import DataConfig
from yatt_hpc.data.prompts import (
    DatasetError,
    DemoTaskSource,
    JsonlSource,
    PromptStream,
    RowSchema,
    build_prompt_source,
    epoch_permutation,
    open_prompt_source,
)
from yatt_hpc.data.tokenizer import CharTokenizerAdapter
from yatt_hpc.demo.char_tokenizer import CharTokenizer
from yatt_hpc.demo.task import demo_row

REPO = Path(__file__).resolve().parents[2]
CHAR = CharTokenizerAdapter(CharTokenizer())


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_demo_source_serves_the_demo_task_rows():
    source = DemoTaskSource(size=32, split="heldout")
    assert len(source) == 32
    row = source.row(5)
    expected = demo_row(source.seed, 5, "heldout")
    assert row == {"id": 5, "prompt": expected["prompt"], "messages": None, "question": expected["prompt"],
                   "answer": expected["answer"], "metadata": {}, "images": [], "image_names": [], "origin": "demo:heldout#5"}
    with pytest.raises(IndexError):
        source.row(32)


def test_epoch_permutation_is_pure_and_changes_with_seed_and_epoch():
    a = epoch_permutation(1234, 0, 100)
    assert np.array_equal(a, epoch_permutation(1234, 0, 100))
    assert sorted(a.tolist()) == list(range(100))
    assert not np.array_equal(a, epoch_permutation(1234, 1, 100))
    assert not np.array_equal(a, epoch_permutation(1235, 0, 100))


def test_each_epoch_visits_every_row_once():
    stream = PromptStream(DemoTaskSource(size=40), seed=3)
    for epoch in range(3):
        ids = [stream.row_at(p)["id"] for p in range(epoch * 40, (epoch + 1) * 40)]
        assert sorted(ids) == list(range(40))
    assert stream.epoch_of(79) == 1 and stream.epoch_of(80) == 2 and len(stream) == 40


def test_ranks_computing_their_own_shards_cover_a_step_without_overlap():
    prompts_per_step, dp = 16, 4
    per_rank = prompts_per_step // dp
    whole = PromptStream(DemoTaskSource(size=50), seed=9)
    for step in (0, 3, 7):  # step 3 straddles the epoch boundary at position 50
        first = step * prompts_per_step
        shards = [PromptStream(DemoTaskSource(size=50), seed=9).rows_at(first + r * per_rank, per_rank)
                  for r in range(dp)]
        assert [row for shard in shards for row in shard] == whole.rows_at(first, prompts_per_step)


def test_jsonl_source_reads_rows_skipping_blank_lines(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "2+2=", "answer": 4}), "",
                                         json.dumps({"prompt": "hi", "answer": "yo", "id": 77})])
    source = JsonlSource(path)
    assert len(source) == 2
    assert source.row(0) == {"id": 0, "prompt": "2+2=", "messages": None, "question": "2+2=", "answer": "4",
                             "metadata": {}, "images": [], "image_names": [], "origin": f"{path}:1"}
    assert source.row(1) == {"id": 77, "prompt": "hi", "messages": None, "question": "hi", "answer": "yo",
                             "metadata": {"id": 77}, "images": [], "image_names": [], "origin": f"{path}:3"}


def test_jsonl_keys_can_be_renamed(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"question": "q", "solution": "s"})])
    row = open_prompt_source(str(path), RowSchema(prompt_key="question", answer_key="solution")).row(0)
    assert (row["prompt"], row["answer"]) == ("q", "s")


def test_row_without_prompt_names_the_file_the_line_and_the_key(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok", "answer": "a"}),
                                           json.dumps({"question": "where?", "answer": "b"})])
    with pytest.raises(DatasetError) as err:
        JsonlSource(path).row(1)
    message = str(err.value)
    assert f"{path}:2" in message and "'prompt'" in message and "'question'" in message
    assert "data.prompt_key" in message


@pytest.mark.parametrize("line,needle", [
    pytest.param('{"prompt": "x", "answer": ', "not valid JSON", id="broken-json"),
    pytest.param('["prompt", "answer"]', "expected a JSON object", id="not-an-object"),
    pytest.param('{"prompt": "x"}', "no 'answer' column", id="missing-answer"),
    pytest.param('{"prompt": 7, "answer": "a"}', "'prompt' must be a non-empty string, got int 7", id="int-prompt"),
    pytest.param('{"prompt": "x", "answer": true}', "string or a number, got bool True", id="bool-answer"),
    pytest.param('{"prompt": "", "answer": "a"}', "non-empty string", id="empty-prompt"),
    pytest.param('{"prompt": "x", "answer": null}', "string or a number", id="null-answer"),
])
def test_bad_rows_raise_dataset_error_with_the_line_number(tmp_path, line, needle):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok", "answer": "a"}), line])
    source = JsonlSource(path)
    assert source.row(0)["prompt"] == "ok"  # the bad line is only read when asked for
    with pytest.raises(DatasetError, match=needle) as err:
        source.row(1)
    assert f"{path}:2:" in str(err.value)


def test_missing_and_empty_files_are_dataset_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        open_prompt_source(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DatasetError, match="no rows"):
        open_prompt_source(str(_write(tmp_path / "empty.jsonl", ["", "  "]))).probe()
    assert issubclass(DatasetError, ValueError)


def test_build_prompt_source_follows_the_data_config(tmp_path):
    stream = build_prompt_source(DataConfig(source="demo:train", num_prompts=64, seed=5), CHAR)
    assert len(stream) == 64 and stream.seed == 5
    assert stream.row_at(3) == PromptStream(DemoTaskSource(64), 5).row_at(3)


def test_prompts_over_the_token_limit_fail_when_read_naming_the_row(tmp_path):
    path = _write(tmp_path / "long.jsonl", [json.dumps({"prompt": "short", "answer": "a"}),
                                            json.dumps({"prompt": "x" * 40, "answer": "a"})])
    stream = build_prompt_source(DataConfig(source=str(path), max_prompt_tokens=16), CHAR)  # nothing tokenized yet
    assert stream.encode(stream.source.row(0)) == CHAR.encode("short")
    with pytest.raises(DatasetError, match=f"{path}:2: prompt is 40 tokens, over data.max_prompt_tokens=16; "
                                           "shorten the prompt or raise data.max_prompt_tokens"):
        stream.encode(stream.source.row(1))
    first = _write(tmp_path / "first.jsonl", [json.dumps({"prompt": "x" * 17, "answer": "a"})])
    with pytest.raises(DatasetError, match=f"{first}:1: prompt is 17 tokens"):  # the first row is checked at once
        build_prompt_source(DataConfig(source=str(first), max_prompt_tokens=16), CHAR)


def test_the_default_prompt_limit_is_sized_for_real_models_and_the_demo_configs_keep_theirs():
    from yatt_hpc.config import load_config

    assert DataConfig().max_prompt_tokens == 1024
    for name in ("demo_cpu", "demo_1gpu", "disjoint_cpu", "partial_cpu"):
        assert load_config(REPO / "configs" / f"{name}.yaml").data.max_prompt_tokens == 64, name
