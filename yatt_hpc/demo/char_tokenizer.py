"""A character-level tokenizer built in code, so the demo models need no downloaded vocabulary.

    from yatt_hpc.demo.char_tokenizer import CharTokenizer
    tok = CharTokenizer()
    ids = tok.encode("reverse abcdab=")         # one id per character, no special tokens added
    tok.decode(ids + [tok.eos_id])              # -> "reverse abcdab=" (special tokens dropped)
    tok.save("models/demo/policy")              # writes yatt_tokenizer.json next to the weights

Ids 0..3 are the special tokens (pad, bos, eos, unk), then one id per character of the charset
(newline + printable ASCII by default). The vocabulary is padded with unused ids to a multiple of 8
because the Megatron embedding table of the trainer is split and aligned in multiples of 8.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_CHARSET = "\n" + "".join(c for c in string.printable if 32 <= ord(c) < 127)
TOKENIZER_FILE = "yatt_tokenizer.json"
VOCAB_MULTIPLE = 8


class CharTokenizer:
    """One token per character; unknown characters map to `<unk>` instead of failing."""

    def __init__(self, charset: str = DEFAULT_CHARSET) -> None:
        if len(set(charset)) != len(charset):
            raise ValueError(f"tokenizer charset has repeated characters: {charset!r}")
        self.charset = charset
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(SPECIAL_TOKENS))
        self._char_to_id = {c: len(SPECIAL_TOKENS) + i for i, c in enumerate(charset)}
        used = len(SPECIAL_TOKENS) + len(charset)
        self.vocab_size = -(-used // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, one per character; adds no bos/eos (the caller decides the framing)."""
        return [self._char_to_id.get(c, self.unk_id) for c in text]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of `ids`; special and padding-slot ids are dropped unless `skip_special` is False."""
        out = []
        first_char = len(SPECIAL_TOKENS)
        for i in ids:
            i = int(i)
            if first_char <= i < first_char + len(self.charset):
                out.append(self.charset[i - first_char])
            elif not skip_special:
                out.append(SPECIAL_TOKENS[i] if 0 <= i < first_char else f"<extra_{i}>")
        return "".join(out)

    def decode_generated(self, ids: list[int]) -> str:
        """Text of generated ids up to the first eos: generation pads finished rows after it."""
        ids = list(ids)
        return self.decode(ids[:ids.index(self.eos_id)] if self.eos_id in ids else ids)

    def to_dict(self) -> dict:
        return {"type": "char", "charset": self.charset, "special_tokens": list(SPECIAL_TOKENS),
                "vocab_size": self.vocab_size}

    @classmethod
    def from_dict(cls, data: dict) -> CharTokenizer:
        if data.get("type") != "char" or list(data.get("special_tokens", [])) != list(SPECIAL_TOKENS):
            raise ValueError(f"not a yatt-hpc character tokenizer: type={data.get('type')!r}")
        tok = cls(data["charset"])
        if tok.vocab_size != data.get("vocab_size", tok.vocab_size):
            raise ValueError(f"tokenizer vocab_size {data['vocab_size']} does not match its charset "
                             f"({tok.vocab_size}); the file was edited by hand?")
        return tok

    def save(self, directory: str | Path) -> Path:
        """Write `yatt_tokenizer.json` into `directory` (created if missing); returns its path."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """Read the tokenizer saved next to a model by `save`."""
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the model directory has no yatt-hpc tokenizer "
                                    f"(regenerate the demo models with `python tools/make_demo_models.py`)")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


# A simple chat template for the demo's HF twin: role tags, the generation prompt opens the assistant turn.
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_hf_twin(tok: CharTokenizer, directory: str | Path, chat_template: str | None = DEMO_CHAT_TEMPLATE):
    """Save a Hugging Face fast tokenizer with exactly `tok`'s ids (one token per character, the same
    special tokens) into `directory`: the demo models then load through `transformers.AutoTokenizer`,
    the path every real model takes. Returns the `PreTrainedTokenizerFast`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: i for c, i in tok._char_to_id.items()})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return fast
