"""Chat prompts (data.format=chat): rows of messages or prompt strings (with data.system_prompt) through a
real transformers tokenizer's chat template, or data.chat_template; the question the verifier and judge
see is the user's, never the templated text.

    .venv/bin/python -m pytest tests/unit/test_chat_prompts.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.config.schema import DataConfig
from yatt_hpc.data.prompts import build_prompt_source
from yatt_hpc.data.rows import DatasetError
from yatt_hpc.data.tokenizer import CharTokenizerAdapter, TokenizerError, load_tokenizer
from yatt_hpc.demo.char_tokenizer import CharTokenizer, save_hf_twin

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse ab="}], "answer": "ba"},
    {"prompt": "reverse abc=", "answer": "cba", "level": 2},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "reverse xy="}], "answer": "yx"},
]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    """A real transformers tokenizer with the demo's ids and chat template (`role: content` lines)."""
    out = tmp_path_factory.mktemp("hf_tok")
    save_hf_twin(CharTokenizer(), out)
    return load_tokenizer(out)


def _chat(tmp_path, tok, rows=ROWS, **data):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_prompt_source(DataConfig(source=str(path), format="chat", **data), tok)


def test_messages_and_prompt_strings_go_through_the_tokenizers_chat_template(tmp_path, hf_tok):
    stream = _chat(tmp_path, hf_tok, system_prompt="answer only")
    texts = [hf_tok.decode(stream.encode(stream.source.row(i))) for i in range(3)]
    assert texts == [
        "system: be brief\nuser: reverse ab=\nassistant: ",  # the row's own system message stays
        "system: answer only\nuser: reverse abc=\nassistant: ",  # a prompt string, after data.system_prompt
        "system: answer only\nuser: hi\nassistant: hello\nuser: reverse xy=\nassistant: ",
    ]


def test_the_question_is_the_users_not_the_templated_text(tmp_path, hf_tok):
    source = _chat(tmp_path, hf_tok, system_prompt="answer only").source
    assert [source.row(i)["question"] for i in range(3)] == ["reverse ab=", "reverse abc=", "reverse xy="]
    row = source.row(1)
    assert row["prompt"] == "reverse abc=" and row["metadata"] == {"level": 2}
    assert row["messages"] == [{"role": "system", "content": "answer only"}, {"role": "user", "content": "reverse abc="}]
    assert source.row(0)["prompt"] is None


def test_a_chat_template_file_overrides_the_tokenizers(tmp_path, hf_tok):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'][0] }}:{{ m['content'] }}>{% endfor %}"
                        "{% if add_generation_prompt %}<a:{% endif %}")
    stream = _chat(tmp_path, hf_tok, chat_template=str(template))
    assert hf_tok.decode(stream.encode(stream.source.row(0))) == "<s:be brief><u:reverse ab=><a:"
    char = CharTokenizerAdapter(CharTokenizer())  # no template of its own: the file serves it too
    stream = _chat(tmp_path, char, chat_template=str(template))
    assert char.decode(stream.encode(stream.source.row(1))) == "<u:reverse abc=><a:"


def test_chat_without_any_template_is_refused_when_the_source_is_built(tmp_path):
    with pytest.raises(TokenizerError, match="data.format=chat needs a chat template.*give data.chat_template"):
        _chat(tmp_path, CharTokenizerAdapter(CharTokenizer()))
    with pytest.raises(DatasetError, match="data.chat_template='nope.jinja' cannot be read"):
        _chat(tmp_path, CharTokenizerAdapter(CharTokenizer()), chat_template="nope.jinja")


def test_a_template_that_refuses_a_row_names_the_row(tmp_path, hf_tok):
    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}")
    path = tmp_path / "chat.jsonl"
    stream = _chat(tmp_path, hf_tok, rows=ROWS[1:], chat_template=str(template))
    assert hf_tok.decode(stream.encode(stream.source.row(0))) == "reverse abc="
    stream = _chat(tmp_path, hf_tok, rows=[ROWS[1], ROWS[0]], chat_template=str(template))
    with pytest.raises(DatasetError, match=f"^{path}:2: the chat template refused the row's messages "
                                           ".*no system messages"):
        stream.encode(stream.source.row(1))


def test_the_token_limit_counts_the_templated_prompt(tmp_path, hf_tok):
    stream = _chat(tmp_path, hf_tok, rows=[ROWS[1]], max_prompt_tokens=40)
    assert len(stream.encode(stream.row_at(0))) == len("user: reverse abc=\nassistant: ")
    with pytest.raises(DatasetError, match=r":1: prompt is 30 tokens after the chat template, over "
                                           "data.max_prompt_tokens=29"):
        _chat(tmp_path, hf_tok, rows=[ROWS[1]], max_prompt_tokens=29)


@pytest.mark.parametrize("messages,needle", [
    pytest.param([], "column 'messages' must be a non-empty list .*got an empty list", id="empty"),
    pytest.param("hi", "column 'messages' must be a non-empty list .*got str 'hi'", id="not-a-list"),
    pytest.param([{"role": "robot", "content": "x"}], "message 0 has role str 'robot'; a role is one of system, user",
                 id="bad-role"),
    pytest.param([{"role": "user"}], r"message 0 \(user\) must have a string 'content', got null", id="no-content"),
    pytest.param([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "multimodal content lists",
                 id="content-list"),
    pytest.param(["hi"], "message 0 must be an object", id="not-an-object"),
    pytest.param([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                 "ends with an assistant message.*belongs in the 'answer' column", id="ends-with-assistant"),
    pytest.param([{"role": "system", "content": "s"}], "has no user message", id="no-user"),
])
def test_bad_messages_name_the_file_the_row_and_the_column(tmp_path, hf_tok, messages, needle):
    stream = _chat(tmp_path, hf_tok, rows=[ROWS[1], {"messages": messages, "answer": "a"}])
    with pytest.raises(DatasetError, match=needle) as err:
        stream.source.row(1)
    assert str(err.value).startswith(f"{tmp_path / 'chat.jsonl'}:2: column 'messages'")


def test_a_chat_row_with_neither_messages_nor_prompt_says_which_columns_it_needs(tmp_path, hf_tok):
    with pytest.raises(DatasetError, match=":1: row has no 'prompt' column .*give the row a 'messages' list"):
        _chat(tmp_path, hf_tok, rows=[{"text": "x", "answer": "a"}])


def test_parquet_chat_rows_read_like_jsonl_ones(tmp_path, hf_tok):
    records = [{"messages": r.get("messages"), "prompt": r.get("prompt"), "answer": r["answer"]} for r in ROWS]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=2)
    par = build_prompt_source(DataConfig(source=str(path), format="chat", system_prompt="s"), hf_tok)
    jsonl = _chat(tmp_path, hf_tok, system_prompt="s")
    for i in range(3):
        a, b = par.source.row(i), jsonl.source.row(i)
        assert (a["messages"], a["question"], a["answer"]) == (b["messages"], b["question"], b["answer"])
        assert par.encode(a) == jsonl.encode(b)


def test_chat_fields_are_refused_in_text_format():
    for override in ("data.system_prompt=hi", "data.chat_template=t.jinja"):
        field = override.split("=")[0]
        with pytest.raises(ConfigError, match=f"{field} is set but data.format=text.*set data.format=chat"):
            load_config(REPO / "configs/demo_cpu.yaml", overrides=[override])
    cfg = load_config(REPO / "configs/demo_cpu.yaml", overrides=["data.format=chat", "data.system_prompt=hi"])
    assert cfg.data.system_prompt == "hi"


def test_messages_key_names_the_column_of_the_messages(tmp_path, hf_tok):
    rows = [{"conversation": ROWS[0]["messages"], "messages": "not these", "answer": "ba"}]
    stream = _chat(tmp_path, hf_tok, rows=rows, messages_key="conversation")
    row = stream.row_at(0)
    assert row["question"] == "reverse ab=" and row["metadata"] == {"messages": "not these"}


def test_format_text_keeps_the_prompt_string_as_the_models_input(tmp_path, hf_tok):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[1]) + "\n")
    text = build_prompt_source(DataConfig(source=str(path)), hf_tok)
    chat = build_prompt_source(DataConfig(source=str(path), format="chat"), hf_tok)
    assert hf_tok.decode(text.encode(text.row_at(0))) == "reverse abc="
    assert hf_tok.decode(chat.encode(chat.row_at(0))) == "user: reverse abc=\nassistant: "
    assert text.row_at(0)["messages"] is None and text.row_at(0)["question"] == chat.row_at(0)["question"]
