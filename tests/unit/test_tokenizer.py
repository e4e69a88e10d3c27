"""The one tokenizer interface: the demo's character tokenizer and a real transformers tokenizer behave
the same behind it (no special tokens in decoded text, EOS from the model, chat templates)."""
import shutil
from pathlib import Path

import pytest

from yatt_hpc.data.tokenizer import CharTokenizerAdapter, HFTokenizer, TokenizerError, load_tokenizer
from yatt_hpc.demo.char_tokenizer import TOKENIZER_FILE, CharTokenizer, save_hf_twin

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


@pytest.fixture(scope="module")
def hf_policy(tmp_path_factory) -> Path:
    """The demo policy's weights behind a transformers tokenizer with the very same ids."""
    out = tmp_path_factory.mktemp("hf_policy")
    for f in (DEMO / "policy").iterdir():
        if f.name != TOKENIZER_FILE:
            shutil.copy(f, out / f.name)
    save_hf_twin(CharTokenizer.load(DEMO / "policy"), out)
    return out


def test_both_tokenizers_give_the_same_ids_and_text(hf_policy):
    char, hf = load_tokenizer(DEMO / "policy"), load_tokenizer(hf_policy)
    assert isinstance(char, CharTokenizerAdapter) and isinstance(hf, HFTokenizer)
    text = "reverse abcdab="
    assert hf.encode(text) == char.encode(text) == hf.encode_prompt(text) == char.encode_prompt(text)
    assert hf.eos_ids == char.eos_ids == (2,) and hf.pad_id == char.pad_id == 0


def test_decoded_responses_hold_no_special_tokens_and_stop_at_eos(hf_policy):
    hf = load_tokenizer(hf_policy)
    ids = hf.encode("badcba") + [hf.eos_ids[0], 0, 0] + hf.encode("junk")
    raw = hf.tok.decode(ids)  # transformers' default keeps them: what gave reward 0.000
    assert "<eos>" in raw
    assert hf.decode(ids) == load_tokenizer(DEMO / "policy").decode(ids) == "badcba"


def test_chat_template_with_generation_prompt(hf_policy):
    hf = load_tokenizer(hf_policy)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse ab="}]
    assert hf.decode(hf.encode_chat(messages)) == "system: be brief\nuser: reverse ab=\nassistant: "
    custom = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert hf.decode(hf.encode_chat(messages, template=custom)) == "<be brief><reverse ab=>"
    char = load_tokenizer(DEMO / "policy")
    assert char.decode(char.encode_chat(messages, template=custom)) == "<be brief><reverse ab=>"
    with pytest.raises(TokenizerError, match="has none; use data.format=text, or give data.chat_template"):
        char.encode_chat(messages)


def test_eos_comes_from_the_generation_config(hf_policy, tmp_path):
    other = tmp_path / "m"
    shutil.copytree(hf_policy, other)
    (other / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    assert load_tokenizer(other).eos_ids == (2, 7)


def test_a_directory_without_tokenizer_files_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(TokenizerError, match="needs its tokenizer files"):
        load_tokenizer(tmp_path)
