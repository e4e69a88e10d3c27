"""`load_decoder`: the text of response ids from tokenizer.json alone equals transformers' decode (HFTokenizer's),
for the tokenizer kinds a policy ships with, and the rank that uses it imports neither transformers nor torch."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from yatt_hpc.data.tokenizer import DecodeOnlyTokenizer, HFTokenizer, load_decoder, load_tokenizer

CORPUS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
          "How many clips did Natalia sell altogether in April and May? The answer is 72.",
          "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
          "Don't stop: it's 3.5 km, isn't it? We're sure they've said I'm right ! ' quoted ' .",
          "Émile a mangé 3 crêpes — 日本語のテキスト, emoji 🙂 and tabs\tand\nnew lines."]


def _byte_level_bpe(directory, tokenizer_class: str):
    """A Qwen-like byte-level BPE: <|endoftext|> / <|im_start|> / <|im_end|> special, <tool_call> an added
    token that is not special (Qwen2.5 ships it so), saved under `tokenizer_class`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS * 4, trainer)
    core.add_tokens([AddedToken("<tool_call>", special=False)])
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"]
                            ).save_pretrained(str(directory))
    _set(directory, tokenizer_class=tokenizer_class)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [core.token_to_id("<|im_end|>"),
                                                                                   core.token_to_id("<|endoftext|>")]}))


def _word_level(directory, clean_up: bool):
    """A word-level vocabulary joined by WordPiece's decoder (B9r's real-size tokenizer is one); `clean_up`: the
    config asks for transformers' clean-up of tokenization spaces, which a non-BPE model gets. "<pad>" is an
    ordinary vocabulary entry that only tokenizer_config.json names special."""
    import re

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2}
    for text in CORPUS:
        for word in re.findall(r"\w+|[^\w\s]", text):
            vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>").save_pretrained(str(directory))
    _set(directory, pad_token="<pad>", clean_up_tokenization_spaces=clean_up)


def _set(directory, **fields):
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


KINDS = {"qwen2": lambda d: _byte_level_bpe(d, "Qwen2Tokenizer"),
         "fast-bpe": lambda d: _byte_level_bpe(d, "PreTrainedTokenizerFast"),
         "word-level": lambda d: _word_level(d, clean_up=False),
         "word-level-clean-up": lambda d: _word_level(d, clean_up=True)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_decoded_text_equals_transformers_decode(tmp_path, kind):
    KINDS[kind](tmp_path)
    light, hf = load_decoder(tmp_path), load_tokenizer(tmp_path)
    assert isinstance(light, DecodeOnlyTokenizer) and isinstance(hf, HFTokenizer)
    assert (light.eos_ids, light.pad_id) == (hf.eos_ids, hf.pad_id)
    texts = CORPUS + [" ".join(CORPUS), "<|im_start|>assistant\nThe answer is <tool_call> 72<|im_end|>tail",
                      "<pad> it ' s <eos> more"]
    rng = np.random.default_rng(0)
    cases = [hf.encode(t) for t in texts]
    cases += [rng.integers(0, hf.vocab_size, rng.integers(1, 40)).tolist() for _ in range(300)]  # specials, EOS
    for ids in cases:
        assert light.decode(ids) == hf.decode(ids), (kind, ids)
    if kind == "word-level-clean-up":
        assert hf.decode(hf.encode("it ' s 48 .")) == "it's 48.", "the clean-up is what this kind exercises"


def test_a_tokenizer_class_with_its_own_decode_gets_transformers(tmp_path):
    _word_level(tmp_path, clean_up=False)
    _set(tmp_path, tokenizer_class="BertTokenizer")  # its own class: its decode is not taken on trust
    assert isinstance(load_decoder(tmp_path), HFTokenizer)


def test_decoding_imports_neither_transformers_nor_torch(tmp_path):
    _byte_level_bpe(tmp_path, "Qwen2Tokenizer")
    code = ("import sys; from yatt_hpc.data.tokenizer import load_decoder; "
            f"print(load_decoder({str(tmp_path)!r}).decode([1, 2, 3, 200]) is not None, "
            "sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True []"
