"""The batch data model: the samples one trainer replica owns, columnar (no MPI, no torch here).

    batch = SampleBatch(sample_id=..., prompt_id=..., owner=..., ...)     # numpy columns
    batch.select(index); SampleBatch.concat([a, b]); batch.sorted_by_id(); batch.ragged("response_tokens")

Per-sample columns hold one value per sample; the RAGGED token columns are stored flat, with a
per-sample length column (`prompt_len`, `response_len`, `answer_len`, `question_len`, `metadata_len`,
and `response_len` again for `logprobs`). `question` is the user's text (not the templated prompt),
`metadata` the row's other columns as JSON; both reach the reward terms. `comm.transport` moves a
batch between ranks as raw buffers; the trainer, the engines and the judge read it. Nothing else
about a sample exists outside these columns.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import numpy as np

RAGGED = ("prompt_tokens", "response_tokens", "logprobs", "answer", "question", "metadata")


@dataclass
class SampleBatch:
    """Samples owned by one trainer data-parallel rank, in flight or at rest (columnar)."""

    sample_id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # prompt_id * n + k
    prompt_id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    owner: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # world rank of the owning trainer
    prompt_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    response_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    response_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # per response token
    answer_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    answer: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # utf-8 bytes
    question_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    question: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # utf-8 bytes
    metadata_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    metadata: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # utf-8 JSON object
    finish: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))  # 0 stop, 1 length, 2 abort
    reward: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    rule_score: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    genrm_score: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    parse_fail: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))

    def __post_init__(self) -> None:
        # per-sample columns not given yet (e.g. rewards of a prompt batch) start as zeros
        n = len(self)
        if not n:
            return
        for name in PER_SAMPLE:
            col = getattr(self, name)
            if col.size == 0:
                setattr(self, name, np.zeros(n, dtype=col.dtype))

    def __len__(self) -> int:
        return int(self.sample_id.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))

    def ragged(self, name: str) -> list[np.ndarray]:
        """Split a flat ragged column (`prompt_tokens`, `response_tokens`, `logprobs`, `answer`) per sample."""
        lengths = self.response_len if name == "logprobs" else getattr(self, name.split("_")[0] + "_len")
        return np.split(getattr(self, name), np.cumsum(lengths)[:-1]) if len(self) else []

    def answers(self) -> list[str]:
        return [a.tobytes().decode("utf-8") for a in self.ragged("answer")]

    def questions(self) -> list[str]:
        return [q.tobytes().decode("utf-8") for q in self.ragged("question")]

    def metadatas(self) -> list[dict]:
        return [json.loads(m.tobytes().decode("utf-8")) if m.size else {} for m in self.ragged("metadata")]

    def select(self, index: np.ndarray) -> SampleBatch:
        """A new batch with the samples at `index`, in that order."""
        index = np.asarray(index, dtype=np.int64)
        out = {}
        for f in fields(self):
            col = getattr(self, f.name)
            if f.name in RAGGED:
                parts = self.ragged(f.name)
                out[f.name] = np.concatenate([parts[i] for i in index]) if len(index) else col[:0]
            else:
                out[f.name] = col[index]
        return SampleBatch(**out)

    def sorted_by_id(self) -> SampleBatch:
        """Samples in sample-id order: downstream math must not depend on message arrival order."""
        return self.select(np.argsort(self.sample_id, kind="stable"))

    @staticmethod
    def concat(batches: list[SampleBatch]) -> SampleBatch:
        if not batches:
            return SampleBatch()
        return SampleBatch(**{f.name: np.concatenate([getattr(b, f.name) for b in batches]) for f in fields(SampleBatch)})


COLUMNS = [f.name for f in fields(SampleBatch)]
PER_SAMPLE = [c for c in COLUMNS if c not in RAGGED]
DTYPES = {name: SampleBatch().__getattribute__(name).dtype for name in COLUMNS}
