"""The one tokenizer interface the trainer, the rollout engines and the judge use.

    tok = load_tokenizer("models/demo/policy")     # the demo's character tokenizer there, else transformers'
    ids = tok.encode_prompt("What is 2+2?")        # a plain-text prompt, with the BOS the model expects
    ids = tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])   # the chat template + generation prompt
    text = tok.decode(response_ids)                # never special tokens; cut at the first EOS
    tok.eos_ids, tok.pad_id                        # from the model's generation config / tokenizer

A directory that holds `yatt_tokenizer.json` has the demo's character tokenizer
(`yatt_hpc/demo/char_tokenizer.py`); any other gets `transformers.AutoTokenizer`. Both sit behind
`Tokenizer`, so nothing else needs to know which one a model has. Lengths are always counted in
tokens of this interface.

    text = load_decoder("models/qwen").decode(response_ids)   # the same text, from tokenizer.json alone

A rank that only turns ids into text (a GenRM rank scoring by rule) takes `load_decoder`: for a
tokenizer whose transformers class decodes with its backend as is (`DECODES_AS_BACKEND`), it reads
tokenizer.json with the `tokenizers` library and marks the tokens transformers marks special, so
its text equals `HFTokenizer.decode` without importing transformers or torch (~0.06 GB a rank
against ~0.3 GB); any other tokenizer gets `load_tokenizer`'s.

The pitfalls it exists for: an HF `decode` keeps special tokens by default (`<|im_end|>` in the
text a verifier compares: reward 0 on correct answers), and `encode` adds special tokens by default
(a second BOS after a chat template that already holds one).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from yatt_hpc.demo.char_tokenizer import TOKENIZER_FILE, CharTokenizer


class TokenizerError(ValueError):
    """A model directory whose tokenizer cannot serve the run; the message names the fix."""


class Tokenizer:
    """What every component asks of a tokenizer (see the module docstring)."""

    eos_ids: tuple[int, ...]
    pad_id: int
    vocab_size: int
    has_chat_template: bool

    def encode(self, text: str) -> list[int]:
        """Ids of `text` with no special tokens added (templates, judge prompts, length counts)."""
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        """A plain-text prompt as the model's first tokens (with its BOS if the tokenizer adds one)."""
        raise NotImplementedError

    def encode_chat(self, messages: Sequence[dict], template: str | None = None, tools: list | None = None) -> list[int]:
        """`messages` through the chat template (`template` overrides the tokenizer's), ending with the
        generation prompt, as ids; `tools`: function schemas the template lists (its `tools=`)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids up to the first EOS, special tokens dropped."""
        raise NotImplementedError

    def _until_eos(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        stops = [k for k, i in enumerate(ids) if i in self.eos_ids]
        return ids[: stops[0]] if stops else ids


class CharTokenizerAdapter(Tokenizer):
    """The demo's character tokenizer (one id per character, no chat template)."""

    has_chat_template = False

    def __init__(self, tok: CharTokenizer, name: str = "the demo's character tokenizer") -> None:
        self.tok, self.name = tok, name
        self.eos_ids = (tok.eos_id,)
        self.pad_id = tok.pad_id
        self.vocab_size = tok.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tok.encode(text)  # the demo models were trained on prompts without BOS

    def encode_chat(self, messages: Sequence[dict], template: str | None = None, tools: list | None = None) -> list[int]:
        if template is None:
            raise TokenizerError(f"chat prompts need a chat template, and {self.name} has none; use data.format=text, "
                             "or give data.chat_template (a Jinja template file)")
        return self.tok.encode(render_template(template, messages, tools))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(self._until_eos(ids))


class HFTokenizer(Tokenizer):
    """A transformers tokenizer, with EOS ids from the model's generation config when it has one."""

    def __init__(self, tok, model_dir: str | Path) -> None:
        self.tok = tok
        self.eos_ids = tuple(sorted(model_eos_ids(model_dir) or
                                    ({tok.eos_token_id} if tok.eos_token_id is not None else set())))
        if not self.eos_ids:
            raise TokenizerError(f"{model_dir}: neither generation_config.json, config.json nor the tokenizer names an "
                             "EOS token, so no response could ever end; set eos_token_id in generation_config.json")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_ids[0]
        self.vocab_size = len(tok)
        self.has_chat_template = bool(getattr(tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(self, text: str) -> list[int]:
        ids = list(self.tok(text, add_special_tokens=True)["input_ids"])
        while ids and ids[-1] in self.eos_ids:  # some tokenizers append EOS: a prompt must not end the response
            ids.pop()
        return ids

    def encode_chat(self, messages: Sequence[dict], template: str | None = None, tools: list | None = None) -> list[int]:
        if template is None and not self.has_chat_template:
            raise TokenizerError(f"chat prompts need a chat template, and the tokenizer of {self.tok.name_or_path} has "
                             "none; use data.format=text, or give data.chat_template (a Jinja template file)")
        text = self.tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                            chat_template=template, tools=tools)
        return self.encode(text)  # the template already holds whatever BOS the model wants

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(self._until_eos(ids), skip_special_tokens=True)


def render_template(template: str, messages: Sequence[dict], tools: list | None = None) -> str:
    """A Jinja chat template rendered the way transformers does (messages, add_generation_prompt)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=list(messages), add_generation_prompt=True, tools=tools)


def model_eos_ids(model_dir: str | Path) -> set[int]:
    """EOS ids a model declares: generation_config.json first, then config.json (int or list)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return {int(v) for v in (value if isinstance(value, list) else [value])}
    return set()


# transformers classes whose decode is the backend's (tokenizer.json's), special tokens skipped, plus the
# clean-up of tokenization spaces when the config asks for it; a class not here may override `_decode`
DECODES_AS_BACKEND = {"PreTrainedTokenizerFast": None, "TokenizersBackend": None,
                      # transformers 5 rebuilds Qwen2's byte-level BPE with a ByteLevel decoder, whatever the file says
                      "Qwen2Tokenizer": "ByteLevel", "Qwen2TokenizerFast": "ByteLevel"}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class DecodeOnlyTokenizer(Tokenizer):
    """`HFTokenizer.decode` from tokenizer.json and tokenizer_config.json with the `tokenizers` library alone
    (see the module docstring); it encodes nothing."""

    has_chat_template = False

    def __init__(self, model_dir: str | Path, config: dict, decoder: str | None) -> None:
        from tokenizers import AddedToken, decoders
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_file(str(Path(model_dir) / "tokenizer.json"))
        if decoder == "ByteLevel":
            self.backend.decoder = decoders.ByteLevel()
        specials = [_token_text(config.get(k)) for k in SPECIAL_KEYS]
        specials += [_token_text(t) for k in ("additional_special_tokens", "extra_special_tokens")
                     for t in (config.get(k) or [])]
        specials += [t.get("content") for t in (config.get("added_tokens_decoder") or {}).values() if t.get("special")]
        self.backend.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(filter(None, specials))])
        self.clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            type(self.backend.model).__name__ != "BPE" or
            bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        eos = _token_text(config.get("eos_token"))
        eos_id = None if eos is None else self.backend.token_to_id(eos)
        self.eos_ids = tuple(sorted(model_eos_ids(model_dir) or ({eos_id} if eos_id is not None else set())))
        if not self.eos_ids:
            raise TokenizerError(f"{model_dir}: neither generation_config.json, config.json nor the tokenizer names an "
                                 "EOS token, so no response could ever end; set eos_token_id in generation_config.json")
        pad = _token_text(config.get("pad_token"))
        pad_id = None if pad is None else self.backend.token_to_id(pad)
        self.pad_id = pad_id if pad_id is not None else self.eos_ids[0]
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        text = self.backend.decode(self._until_eos(ids), skip_special_tokens=True)
        if self.clean_up:  # transformers' clean_up_tokenization, in its order
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    return token.get("content") if isinstance(token, dict) else token


def load_decoder(model_dir: str | Path) -> Tokenizer:
    """What a rank that only decodes needs (see the module docstring): `DecodeOnlyTokenizer` where its text is
    transformers' own, else `load_tokenizer`'s tokenizer."""
    directory = Path(model_dir)
    config_file = directory / "tokenizer_config.json"
    if (directory / "tokenizer.json").is_file() and config_file.is_file():
        config = json.loads(config_file.read_text())
        if config.get("tokenizer_class") in DECODES_AS_BACKEND:
            return DecodeOnlyTokenizer(directory, config, DECODES_AS_BACKEND[config["tokenizer_class"]])
    return load_tokenizer(model_dir)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer saved with a model: our character tokenizer if present, else transformers'."""
    if (Path(model_dir) / TOKENIZER_FILE).is_file():
        return CharTokenizerAdapter(CharTokenizer.load(model_dir))
    from transformers import AutoTokenizer  # real models (Qwen, Llama) ship their own

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as err:
        raise TokenizerError(f"{model_dir}: no tokenizer could be loaded ({err.__class__.__name__}: "
                         f"{str(err).splitlines()[0]}); a model directory needs its tokenizer files "
                         "(tokenizer.json / tokenizer_config.json) next to config.json") from None
    if len(tok) < 2:  # transformers builds an empty tokenizer from config.json alone
        raise TokenizerError(f"{model_dir}: the tokenizer loaded from it has {len(tok)} tokens; a model directory "
                             "needs its tokenizer files (tokenizer.json / tokenizer_config.json) next to config.json")
    return HFTokenizer(tok, model_dir)
