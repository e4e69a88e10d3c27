"""The demo task, the character tokenizer and the rule verifier.

    .venv/bin/python -m pytest tests/unit/test_demo_task.py -q
"""
from __future__ import annotations

import random

import pytest

from yatt_hpc.data.tokenizer import load_tokenizer
from yatt_hpc.demo.char_tokenizer import TOKENIZER_FILE, CharTokenizer
from yatt_hpc.demo.task import ALPHABET, NEAR_MISSES, WORD_LENGTH, demo_row, demo_rows, near_miss, split_of
from yatt_hpc.reward.verifier import rule_score


def _word(row: dict) -> str:
    return row["prompt"].removeprefix("reverse ").removesuffix("=")


def test_rows_are_a_pure_function_of_seed_split_and_index():
    assert demo_rows(7, 20) == demo_rows(7, 20)
    assert demo_row(7, 13, "heldout") == demo_rows(7, 20, "heldout")[13]
    assert demo_rows(7, 20) != demo_rows(8, 20)


def test_rows_reverse_a_fixed_length_word_over_the_alphabet():
    for row in demo_rows(3, 200) + demo_rows(3, 50, "heldout"):
        word = _word(row)
        assert row["prompt"] == f"reverse {word}="
        assert len(word) == WORD_LENGTH and set(word) <= set(ALPHABET)
        assert row["answer"] == word[::-1]


def test_train_and_heldout_splits_never_share_a_word_for_any_seed():
    train = {_word(r) for seed in (0, 1234) for r in demo_rows(seed, 1500, "train")}
    heldout = {_word(r) for seed in (0, 1234) for r in demo_rows(seed, 300, "heldout")}
    assert train and heldout and not train & heldout
    assert {split_of(w) for w in train} == {"train"} and {split_of(w) for w in heldout} == {"heldout"}


def test_unknown_split_is_rejected_with_the_valid_ones():
    with pytest.raises(ValueError, match="train, heldout"):
        demo_row(0, 0, "test")


@pytest.mark.parametrize("kind", sorted(NEAR_MISSES))
def test_near_miss_of_each_kind_is_never_the_answer(kind):
    rng = random.Random(0)
    for row in demo_rows(5, 200):
        assert near_miss(row["answer"], rng, (kind,)) != row["answer"]


def test_near_miss_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="valid kinds"):
        near_miss("abcd", random.Random(0), ("typo",))


def test_tokenizer_roundtrips_text_and_drops_special_tokens():
    tok = CharTokenizer()
    text = "reverse abcdab=badcba\nCorrect? yes {}[]~"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id, tok.pad_id]) == text
    assert tok.decode([tok.eos_id], skip_special=False) == "<eos>"


def test_tokenizer_maps_unknown_characters_to_unk_and_pads_the_vocabulary():
    tok = CharTokenizer()
    assert tok.encode("é") == [tok.unk_id]
    assert tok.vocab_size % 8 == 0 and tok.vocab_size >= 4 + len(tok.charset)
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4 and tok.pad_id == 0


def test_tokenizer_saves_and_loads_next_to_a_model(tmp_path):
    tok = CharTokenizer("xyz\n")
    assert tok.save(tmp_path).name == TOKENIZER_FILE
    loaded = load_tokenizer(tmp_path)
    assert loaded.tok.charset == "xyz\n" and loaded.vocab_size == tok.vocab_size == 8
    assert loaded.encode("zy") == loaded.encode_prompt("zy") == tok.encode("zy")
    assert loaded.decode(tok.encode("zy") + [tok.eos_id] + tok.encode("x")) == "zy"  # cut at EOS


def test_loading_a_directory_without_tokenizer_says_how_to_fix_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="make_demo_models"):
        CharTokenizer.load(tmp_path)


@pytest.mark.parametrize("response,answer,score", [
    pytest.param("badcba", "badcba", 1.0, id="exact"),
    pytest.param(" badcba\n", "badcba", 1.0, id="surrounding-whitespace"),
    pytest.param("badcab", "badcba", 0.0, id="swapped"),
    pytest.param("badcb", "badcba", 0.0, id="too-short"),
    pytest.param("badcbaa", "badcba", 0.0, id="too-long"),
    pytest.param("", "badcba", 0.0, id="empty"),
    pytest.param("BADCBA", "badcba", 0.0, id="case-matters"),
])
def test_rule_score_is_exact_match(response, answer, score):
    assert rule_score(response, answer) == score


def test_generated_text_stops_at_the_first_eos():
    tok = CharTokenizer()
    ids = tok.encode("dcba") + [tok.eos_id] + tok.encode("junk") + [tok.pad_id]
    assert tok.decode_generated(ids) == "dcba"
    assert tok.decode_generated(tok.encode("abc")) == "abc"
