"""The real-size workload of B9r: a Qwen2.5-0.5B-shaped policy with random weights, a tokenizer of its
151,936-token vocabulary, and GSM8K-like word problems. Built here, offline (no model hub).

    from real_size import build_policy, write_problems
    directory = build_policy(root / "policy", layers=24)      # config.json + model.safetensors + tokenizer
    rows = write_problems(root / "problems.jsonl", 512)      # [{"prompt", "answer"}], also as JSONL

The tokenizer is a real Hugging Face fast tokenizer (`tokenizers` WordLevel): the problems' words, digits one
by one and punctuation, then filler entries `t<N>` up to the model's 151,936 rows, so every id the random
policy can sample decodes, and the last layer and the sampling run over the full vocabulary as in the real
model. `<|endoftext|>` is the end of sequence and the padding, as in Qwen2.5's tokenizer. Not a benchmark
itself.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

from common import qwen05b_config

VOCAB = 151936
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark", "Rose", "Carla"]
ITEMS = ["clips", "apples", "books", "pages", "eggs", "marbles", "cookies", "stamps", "pencils", "shells"]
INSTRUCTION = "Solve the problem step by step, then give the final number after the word Answer."
# Each template: the problem text and the answer from its numbers (a, b, c); two-step arithmetic like GSM8K's.
TEMPLATES = [
    ("{n} sold {a} {i} to her friends in April, and then she sold {b} more {i} in May than in April. "
     "How many {i} did {n} sell altogether in April and May?", lambda a, b, c: 2 * a + b),
    ("{n} has {a} {i}. She buys {b} boxes with {c} {i} in each box. How many {i} does {n} have now?",
     lambda a, b, c: a + b * c),
    ("{n} reads {a} {i} every day for {b} days and then {c} {i} on the last day. How many {i} did {n} read?",
     lambda a, b, c: a * b + c),
    ("A shop had {a} {i}. It sold {b} {i} in the morning and {c} {i} in the afternoon. How many {i} are left "
     "at the shop at the end of the day?", lambda a, b, c: a - b - c),
    ("{n} earns {a} dollars an hour for {b} hours, and spends {c} dollars on {i}. How many dollars does {n} "
     "have left after buying the {i}?", lambda a, b, c: a * b - c),
    ("There are {b} bags with {a} {i} in each bag. {n} gives away {c} {i} to a friend. How many {i} does "
     "{n} keep for the rest of the week?", lambda a, b, c: a * b - c),
]


def problem(rng: random.Random) -> dict:
    text, answer = rng.choice(TEMPLATES)
    a, b = rng.randint(20, 90), rng.randint(2, 9)
    c = rng.randint(1, min(a - b, 19)) if "left at the shop" in text else rng.randint(1, 19)
    prompt = text.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b, c=c)
    return {"prompt": f"{INSTRUCTION}\nQuestion: {prompt}\nAnswer:", "answer": str(answer(a, b, c))}


def write_problems(path: Path, count: int, seed: int = 0) -> list[dict]:
    """`count` word problems (seeded) as JSONL at `path`; returns the rows."""
    rng = random.Random(seed)
    rows = [problem(rng) for _ in range(count)]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def words() -> list[str]:
    """Every word the problems use, sorted: templates, names, items."""
    found = set(NAMES) | set(ITEMS) | set(INSTRUCTION.split()) | {"Question", "Answer"}
    for text, _ in TEMPLATES:
        found |= {w for w in text.replace("{", " {").split() if not w.startswith("{")}
    return sorted({w.strip(string.punctuation) for w in found} - {""})


def build_tokenizer(directory: Path):
    """The 151,936-entry WordLevel fast tokenizer, saved to `directory`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    entries = SPECIALS + list(string.digits) + list(string.punctuation) + words()
    entries += [f"t{i}" for i in range(VOCAB - len(entries))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(entries)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                                  pre_tokenizers.Digits(individual_digits=True)])
    core.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(directory))
    return fast


def build_policy(directory: Path, layers: int = 24, seed: int = 0) -> str:
    """Qwen2.5-0.5B's shape with `layers` layers, random weights (seeded), fp32 safetensors and the tokenizer."""
    import torch
    from transformers import Qwen2ForCausalLM

    tok = build_tokenizer(directory)
    torch.manual_seed(seed)
    config = qwen05b_config(layers, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.eos_token_id)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(directory), safe_serialization=True)
    return str(directory)
