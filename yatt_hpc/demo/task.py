"""The built-in verifiable demo task: reverse a six-letter word over the alphabet "abcd".

    from yatt_hpc.demo.task import demo_row, demo_rows
    demo_row(seed=1234, index=0)                    # {"id": 0, "prompt": "reverse bbbccd=", "answer": "dccbbb"}
    demo_rows(seed=1234, count=4, split="heldout")  # rows whose words never occur in the train split

Why reversal: a character-level policy of ~0.16 M parameters learns it in a minute of CPU training,
and judging it is a position-by-position comparison with no carries or counting. Why four letters:
the judge must learn letter equality, and that is what limits a tiny judge (measured: with 8 or 26
letters a 0.16 M-parameter judge stayed below 0.9 agreement on policy samples after 1500-2500 steps;
with 4 letters it passes 0.95 after ~1000). 4**6 = 4096 words leave ~410 for the held-out split.
Every prompt has the same length, so batched generation needs no padding of prompts.

Rows are a pure function of (seed, split, index). The split of a word is decided by a hash of the
word itself, so the train and held-out splits are disjoint for every seed and every index.
`near_miss` makes plausible wrong answers (swapped, substituted, dropped letters...) that the demo
policy and judge are trained on (see tools/make_demo_models.py).
"""
from __future__ import annotations

import random
import zlib
from collections.abc import Callable

ALPHABET = "abcd"
WORD_LENGTH = 6
SPLITS = ("train", "heldout")
HELDOUT_EVERY = 10  # one word in ten (by hash) belongs to the held-out split


def format_prompt(word: str) -> str:
    """The prompt the policy sees; the answer follows the `=` directly."""
    return f"reverse {word}="


def solve(word: str) -> str:
    return word[::-1]


def split_of(word: str) -> str:
    """The split a word belongs to, from a stable hash of the word (not of the seed or index)."""
    return "heldout" if zlib.crc32(word.encode()) % HELDOUT_EVERY == 0 else "train"


def demo_row(seed: int, index: int, split: str = "train") -> dict:
    """Row `index` of `split`: `{"id": index, "prompt": str, "answer": str}`."""
    if split not in SPLITS:
        raise ValueError(f"unknown demo split {split!r}; valid splits: {', '.join(SPLITS)}")
    if index < 0:
        raise IndexError(f"demo row index must be >= 0, got {index}")
    # A string seed is hashed with SHA-512 by `random`, so rows do not depend on PYTHONHASHSEED.
    rng = random.Random(f"yatt-demo:{seed}:{split}:{index}")
    while True:
        word = "".join(rng.choice(ALPHABET) for _ in range(WORD_LENGTH))
        if split_of(word) == split:
            return {"id": index, "prompt": format_prompt(word), "answer": solve(word)}


def demo_rows(seed: int, count: int, split: str = "train", start: int = 0) -> list[dict]:
    return [demo_row(seed, i, split) for i in range(start, start + count)]


def _swap_adjacent(s: str, rng: random.Random) -> str:
    i = rng.randrange(len(s) - 1)
    return s[:i] + s[i + 1] + s[i] + s[i + 2:]


def _swap_any(s: str, rng: random.Random) -> str:
    i, j = sorted(rng.sample(range(len(s)), 2))
    return s[:i] + s[j] + s[i + 1:j] + s[i] + s[j + 1:]


def _substitute(s: str, rng: random.Random) -> str:
    i = rng.randrange(len(s))
    return s[:i] + rng.choice(ALPHABET.replace(s[i], "")) + s[i + 1:]


def _drop(s: str, rng: random.Random) -> str:
    i = rng.randrange(len(s))
    return s[:i] + s[i + 1:]


def _insert(s: str, rng: random.Random) -> str:
    i = rng.randrange(len(s) + 1)
    return s[:i] + rng.choice(ALPHABET) + s[i:]


def _unreversed(s: str, rng: random.Random) -> str:
    return s[::-1]


def _rotate(s: str, rng: random.Random) -> str:
    k = rng.randrange(1, len(s))
    return s[k:] + s[:k]


def _truncate(s: str, rng: random.Random) -> str:
    return s[:rng.randrange(len(s))]  # includes the empty answer of a policy that stops at once


def _random_word(s: str, rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 2 * len(s))))


def _extra_tail(s: str, rng: random.Random) -> str:
    return s + "".join(rng.choice(ALPHABET + "= ") for _ in range(rng.randint(1, len(s))))


NEAR_MISSES: dict[str, Callable[[str, random.Random], str]] = {
    "swap_adjacent": _swap_adjacent, "swap_any": _swap_any, "substitute": _substitute,
    "drop": _drop, "insert": _insert, "unreversed": _unreversed, "rotate": _rotate,
    "random_word": _random_word, "extra_tail": _extra_tail, "truncate": _truncate,
}


def near_miss(answer: str, rng: random.Random, kinds: tuple[str, ...] = tuple(NEAR_MISSES)) -> str:
    """A wrong answer close to `answer`, made by one of `kinds`; never equal to `answer`."""
    unknown = sorted(set(kinds) - set(NEAR_MISSES))
    if unknown:
        raise ValueError(f"unknown near-miss kinds {unknown}; valid kinds: {', '.join(NEAR_MISSES)}")
    if len(answer) < 2:
        return answer + rng.choice(ALPHABET)
    for _ in range(100):
        wrong = NEAR_MISSES[rng.choice(kinds)](answer, rng)
        if wrong != answer:  # a swap of equal letters or a palindrome leaves the answer unchanged
            return wrong
    return answer + rng.choice(ALPHABET)
