"""The batch data model: the samples one trainer replica owns, columnar (no MPI, no torch here).

    batch = SampleBatch(sample_id=..., prompt_id=..., owner=..., ...)     # numpy columns
    batch.select(index); SampleBatch.concat([a, b]); batch.sorted_by_id(); batch.ragged("response_tokens")

Per-sample columns hold one value per sample; the RAGGED token columns are stored flat, with a per-sample
length column (`prompt_len`, `response_len`, `answer_len`, `question_len`, `metadata_len`, and `response_len`
again for `logprobs` and `token_version`: the weight version, i.e. the step whose weights sampled each
response token; a batch built without it has version 0 on every token; `routed_experts_len` for
`routed_experts`, a MoE engine's routing of each response token, docs/moe.md). `question` is the user's text (not the
templated prompt), `metadata` the row's other columns as JSON; both reach the reward terms. A row's images
travel as their ENCODED bytes (`images`, `image_sizes` the byte length of each), once per prompt group: only
the group's first sample (`sample_id % n == 0`) carries them, the others have `image_count` 0, and
`group_images()` gives every group's images from whichever of its samples carries them. Decoded pixels never
enter a batch: each consumer builds its own model inputs (`vision/processor.py`). `comm.transport` moves a
batch between ranks as raw buffers; the trainer, the engines and the judge read it. Nothing else about a
sample exists outside these columns.

The wire layout lives here too: `SampleBatch.packed(...)`, `select` and `concat` build a batch whose
columns are views into ONE contiguous byte buffer (an int64 header: sample count, then the element
count of every column in `WIRE_ORDER`; then the per-sample columns, zero padding to 8 bytes, and the
ragged columns, each group widest dtype first so every column starts aligned). A reused receive
buffer keeps its per-sample views for the next message of the same sample count (`WireViews`).
`batch.wire()` hands that buffer to the transport while no column has been replaced since, so a
batch goes out as one contiguous message with no packing copy (B5, bench/wire_throughput.py).
Columns may be written in place (the judge fills `reward`); assigning a new array to a column
just makes `wire()` return None, and the transport packs that batch.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from operator import is_

import numpy as np

LENGTH_OF = {"prompt_tokens": "prompt_len", "response_tokens": "response_len", "logprobs": "response_len",
             "token_version": "response_len", "answer": "answer_len", "question": "question_len",
             "metadata": "metadata_len", "images": "images_len", "image_sizes": "image_count",
             "response_mask": "response_len", "routed_experts": "routed_experts_len"}
"""Each ragged (flat) column and the per-sample column holding its length in elements."""
RAGGED = tuple(LENGTH_OF)


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
    token_version: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # per response token
    answer_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    answer: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # utf-8 bytes
    question_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    question: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # utf-8 bytes
    metadata_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    metadata: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # utf-8 JSON object
    finish: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))  # 0 stop, 1 length, 2 abort, 3 paused
    reward: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    rule_score: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    genrm_score: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    parse_fail: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    image_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # 0 but on a group's first
    image_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # bytes of each image
    images_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    images: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # encoded images (PNG, JPEG..)
    # per response token: 1 sampled by the model, 0 not (an agent's tool results and the template around them:
    # no loss, ratio, KL or entropy there; docs/agentic.md); all ones when a batch is built without it
    response_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    env_reward: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # agent.environment's, summed
    code_reward: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # the code term's, rollout-side
    # the experts the engine's routers chose for each token it fed (train.moe_routing_replay): [prompt_len +
    # response_len, MoE layers, top k] flat, -1 where it routed nothing (the last response token); length 0 unrecorded
    routed_experts_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    routed_experts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))

    def __post_init__(self) -> None:
        self._wire: tuple[np.ndarray, tuple] | None = None  # (buffer, the column objects it backs)
        # per-sample columns not given yet (e.g. rewards of a prompt batch) start as zeros
        n = len(self)
        if self.response_tokens.size and not self.response_mask.size:
            self.response_mask = np.ones(self.response_tokens.size, np.uint8)
        if not n:
            return
        for name in PER_SAMPLE:
            col = getattr(self, name)
            if col.size == 0:
                setattr(self, name, np.zeros(n, dtype=col.dtype))
        if self.token_version.size == 0 and self.response_tokens.size:  # built without versions: version 0
            self.token_version = np.zeros(self.response_tokens.size, np.int32)

    def __len__(self) -> int:
        return int(self.sample_id.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(col.nbytes for col in map(self.__dict__.__getitem__, COLUMNS))

    def ragged(self, name: str) -> list[np.ndarray]:
        """Split a flat ragged column (`prompt_tokens`, `response_tokens`, `logprobs`, `answer`) per sample."""
        return np.split(getattr(self, name), np.cumsum(getattr(self, LENGTH_OF[name]))[:-1]) if len(self) else []

    def group_images(self) -> dict[int, list[np.ndarray]]:
        """{prompt_id: its images' encoded bytes (uint8 views)} for every group whose carrier sample
        is in this batch (none for text-only rows)."""
        out: dict[int, list[np.ndarray]] = {}
        if not len(self) or not self.image_count.any():
            return out
        images, sizes = self.ragged("images"), self.ragged("image_sizes")
        for i in np.flatnonzero(self.image_count):
            out[int(self.prompt_id[i])] = np.split(images[i], np.cumsum(sizes[i])[:-1])
        return out

    def final_turns(self) -> list[np.ndarray]:
        """Each response's last run of model-sampled tokens (its answer after an agent's tool turns; the whole
        response of a single-turn sample): what a rule verifier or a judge reads."""
        out = []
        for tokens, mask in zip(self.ragged("response_tokens"), self.ragged("response_mask")):
            outside = np.flatnonzero(mask == 0)
            out.append(tokens[outside[-1] + 1:] if outside.size else tokens)
        return out

    def answers(self) -> list[str]:
        return [a.tobytes().decode("utf-8") for a in self.ragged("answer")]

    def questions(self) -> list[str]:
        return [q.tobytes().decode("utf-8") for q in self.ragged("question")]

    def metadatas(self) -> list[dict]:
        return [json.loads(m.tobytes().decode("utf-8")) if m.size else {} for m in self.ragged("metadata")]

    def wire(self) -> np.ndarray | None:
        """The contiguous buffer (header + columns) this batch's columns are views of, or None when it
        was built column by column or a column has been replaced since."""
        if self._wire is None:
            return None
        buffer, backed = self._wire
        # identity, not equality: runs once per message sent (B5), so no getattr per column
        return buffer if all(map(is_, map(self.__dict__.__getitem__, WIRE_ORDER), backed)) else None

    @staticmethod
    def packed(**columns: np.ndarray) -> SampleBatch:
        """A batch of these columns (as for the constructor), copied into one contiguous buffer."""
        return _packed(SampleBatch(**columns))

    def select(self, index: np.ndarray, **given: np.ndarray) -> SampleBatch:
        """A new batch with the samples at `index`, in that order (contiguous: see `wire`). `given`:
        columns of the picked samples (in `index` order) written as they are instead of gathered from
        this batch, e.g. a rollout's responses: one buffer, ready to send, no packing copy after."""
        index = np.asarray(index, dtype=np.int64)
        n = len(index)
        if "response_tokens" in given and "response_mask" not in given:  # single-turn: every token sampled
            given["response_mask"] = np.ones(given["response_tokens"].size, np.uint8)
        if "response_tokens" in given and "token_version" not in given:  # responses without versions: version 0
            given["token_version"] = np.zeros(given["response_tokens"].size, np.int32)
        if "response_tokens" in given and "routed_experts" not in given:  # responses without recorded routing
            given["routed_experts_len"], given["routed_experts"] = np.zeros(n, np.int32), np.zeros(0, np.int16)
        _check_given(given)
        gathers: dict[str, np.ndarray] = {}  # per length column: where the picked samples' elements are
        sizes = {}
        for name in COLUMNS:
            if name in given:
                sizes[name] = given[name].size
            elif name in RAGGED:
                by = LENGTH_OF[name]
                if by not in gathers:
                    gathers[by] = _ragged_positions(getattr(self, by), index)
                sizes[name] = len(gathers[by])
            else:
                sizes[name] = n
        buffer, views = _layout(n, sizes)
        for name in COLUMNS:
            if not sizes[name]:
                continue
            if name in given:
                views[name][:] = given[name]
            else:
                getattr(self, name).take(gathers[LENGTH_OF[name]] if name in RAGGED else index, out=views[name])
        return _adopt(buffer, views.values())

    def by_owner(self) -> list[tuple[int, SampleBatch]]:
        """(owner, its samples) for each trainer replica with samples here, in owner order; the batch
        itself when it holds one replica's samples."""
        owners = np.unique(self.owner)
        if len(owners) == 1:
            return [(int(owners[0]), self)]
        return [(int(o), self.select(np.flatnonzero(self.owner == o))) for o in owners]

    def sorted_by_id(self) -> SampleBatch:
        """Samples in sample-id order: downstream math must not depend on message arrival order."""
        return self.select(np.argsort(self.sample_id, kind="stable"))

    @staticmethod
    def concat(batches: list[SampleBatch]) -> SampleBatch:
        """One batch of these batches' samples, in order (contiguous: see `wire`)."""
        if not batches:
            return SampleBatch()
        batches = [_filled(b) for b in batches]
        n = sum(len(b) for b in batches)
        buffer, views = _layout(n, {c: sum(getattr(b, c).size for b in batches) for c in COLUMNS})
        for name in COLUMNS:
            if views[name].size:
                np.concatenate([getattr(b, name) for b in batches], out=views[name])
        return _adopt(buffer, views.values())


def _check_given(given: dict[str, np.ndarray]) -> None:
    """`select`'s given columns: known names, and a length column only with every ragged column it measures."""
    for name in given:
        if name not in DTYPES:
            raise ValueError(f"select: {name!r} is not a SampleBatch column (columns: {', '.join(COLUMNS)})")
        missing = [c for c, by in LENGTH_OF.items() if by == name and c not in given]
        if missing:
            raise ValueError(f"select: {name!r} is given but not {', '.join(missing)}, which it measures; give them too")


def _ragged_positions(lengths: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Flat positions, in a ragged column laid out by `lengths`, of the elements of the samples at
    `index`, in that order: one vectorised gather instead of a split and a concatenate per sample."""
    picked = lengths.take(index).astype(np.int64)  # (methods, not np.* wrappers: a stream selects per message)
    total = int(picked.sum())
    if not total:
        return _NO_POSITIONS
    starts = lengths.cumsum(dtype=np.int64) - lengths  # where each sample's elements begin
    # position k of the output belongs to the j-th picked sample: starts[index[j]] + (k - its output start)
    return np.arange(total, dtype=np.int64) + (starts.take(index) - (picked.cumsum() - picked)).repeat(picked)


_NO_POSITIONS = np.zeros(0, np.int64)
_NO_POSITIONS.flags.writeable = False


def batch_columns(batch: SampleBatch) -> dict[str, np.ndarray]:
    """Every column of `batch` as a plain array (a checkpoint stores them; `batch_from_columns` is the inverse)."""
    return {name: np.ascontiguousarray(getattr(batch, name)) for name in COLUMNS}


def batch_from_columns(columns: dict[str, np.ndarray]) -> SampleBatch:
    """A batch from `batch_columns`' arrays (each column's dtype as the batch defines it). A checkpoint written
    before the routing columns or `code_reward` existed has none: its samples carry no recorded routing, and
    code rewards of 0 (no code term scored them)."""
    return SampleBatch(**{name: np.asarray(columns[name]) for name in COLUMNS
                          if name in columns or name not in ("routed_experts", "routed_experts_len", "code_reward")})


def image_columns(images: list[list[bytes]], n: int) -> dict[str, np.ndarray]:
    """The batch's image columns for `n` samples of each row: the encoded bytes ride on each group's
    first sample only (once per group; see batch.py)."""
    count = np.zeros(len(images) * n, np.int32)
    count[::n] = [len(row) for row in images]
    sizes = [len(b) for row in images for b in row]
    flat = [np.frombuffer(b, np.uint8) for row in images for b in row]
    per_sample = np.zeros(len(images) * n, np.int32)
    per_sample[::n] = [sum(len(b) for b in row) for row in images]
    return {"image_count": count, "image_sizes": np.asarray(sizes, np.int32), "images_len": per_sample,
            "images": np.concatenate(flat) if flat else np.zeros(0, np.uint8)}


COLUMNS = [f.name for f in fields(SampleBatch)]
PER_SAMPLE = [c for c in COLUMNS if c not in RAGGED]
DTYPES = {name: SampleBatch().__getattribute__(name).dtype for name in COLUMNS}


def _widest_first(names: list[str]) -> list[str]:
    return sorted(names, key=lambda c: -DTYPES[c].itemsize)  # stable: schema order within a width


WIRE_ORDER = _widest_first(PER_SAMPLE) + _widest_first(list(RAGGED))
"""The columns on the wire: the per-sample ones, then the ragged ones (8-byte aligned), each group
widest dtype first so that every column starts aligned for its dtype. The per-sample columns lie
where the sample count alone puts them, so a reused receive buffer keeps their views (`WireViews`)."""
HEADER_WORDS = 1 + len(WIRE_ORDER)
HEADER_BYTES = 8 * HEADER_WORDS
_HEAD = len(PER_SAMPLE)  # WIRE_ORDER[:_HEAD] are the per-sample columns
_HEAD_NAMES, _TAIL_NAMES = WIRE_ORDER[:_HEAD], WIRE_ORDER[_HEAD:]


def _align8(offset: int) -> int:
    return (offset + 7) & ~7


def wire_parts(batch: SampleBatch) -> list[np.ndarray]:
    """The batch's message as byte views, in order: the int64 header (sample count, element count per
    column in WIRE_ORDER), the per-sample columns, zero padding to 8 bytes, the ragged columns."""
    header = np.array([len(batch)] + [getattr(batch, c).size for c in WIRE_ORDER], dtype=np.int64)
    cols = [np.ascontiguousarray(getattr(batch, c), dtype=DTYPES[c]).view(np.uint8) for c in WIRE_ORDER]
    head = HEADER_BYTES + sum(c.nbytes for c in cols[:_HEAD])
    return [header.view(np.uint8), *cols[:_HEAD], np.zeros(_align8(head) - head, np.uint8), *cols[_HEAD:]]


def _layout(n: int, sizes: dict[str, int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A fresh buffer laid out for `n` samples and these column sizes, with the header (and the zero
    padding) written, and the column views into it, by name in WIRE_ORDER (to be filled)."""
    counts = [sizes[c] for c in WIRE_ORDER]
    head = HEADER_BYTES + sum(k * DTYPES[c].itemsize for c, k in zip(_HEAD_NAMES, counts))
    nbytes = _align8(head) + sum(k * DTYPES[c].itemsize for c, k in zip(_TAIL_NAMES, counts[_HEAD:]))
    buffer = np.empty(nbytes, dtype=np.uint8)
    buffer[:HEADER_BYTES].view(np.int64)[:] = [n, *counts]
    buffer[head:_align8(head)] = 0  # no stale process memory on the wire
    return buffer, dict(zip(WIRE_ORDER, _views(buffer, counts)))


_TYPES = sorted({DTYPES[c] for c in WIRE_ORDER}, key=str)
_SLOTS = [(_TYPES.index(DTYPES[c]), DTYPES[c].itemsize) for c in WIRE_ORDER]
"""Per column in WIRE_ORDER: its dtype's place in _TYPES and its item size."""
_HEAD_SLOTS, _TAIL_SLOTS = _SLOTS[:_HEAD], _SLOTS[_HEAD:]  # per-sample, ragged: not sliced per message (B5)


def typed_views(buffer: np.ndarray) -> list[np.ndarray]:
    """`buffer` (uint8) seen as every wire dtype, as far as whole items fit: `from_wire` slices the
    columns out of these. A receiver that reuses its buffer keeps them with it (`WireViews`)."""
    n = buffer.nbytes
    return [buffer[:n - n % t.itemsize].view(t) for t in _TYPES]


def _slices(typed: list[np.ndarray], slots, counts, offset: int) -> tuple[list[np.ndarray], int]:
    """One slice of a typed view per column (`slots` and `counts` from byte `offset` on), and the byte
    offset after them. Runs for every received message (B5): no other Python object per column."""
    views = []
    for (t, itemsize), count in zip(slots, counts):
        first = offset // itemsize
        views.append(typed[t][first:first + count])
        offset += count * itemsize
    return views, offset


def _views(buffer: np.ndarray, counts: list[int], typed: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Every column, in WIRE_ORDER, as a view into `buffer` laid out for these element counts."""
    typed = typed_views(buffer) if typed is None else typed
    head, end = _slices(typed, _HEAD_SLOTS, counts[:_HEAD], HEADER_BYTES)
    return head + _slices(typed, _TAIL_SLOTS, counts[_HEAD:], _align8(end))[0]


class WireViews:
    """What a reused receive buffer (`comm.transport.ReceiveBuffers`) keeps between messages: its
    typed views, and the per-sample column views of the last message (they depend on the per-sample
    counts alone: a stream of equal-sized batches reuses them, and a message makes views only for its
    ragged columns). `refs` is how many references those views hold on the buffer (measured), so the
    pool can tell a free buffer from one a batch still reads; a kept view that anything else still
    holds keeps the buffer busy (`in_use`)."""

    __slots__ = ("typed", "key", "head", "named", "tail_at", "refs", "held")

    def __init__(self, buffer: np.ndarray) -> None:
        self.typed = typed_views(buffer)
        self.key: list[int] | None = None  # the per-sample counts the kept views are for
        self.head: tuple[np.ndarray, ...] = ()  # the kept views in WIRE_ORDER
        self.named: dict[str, np.ndarray] = {}  # the same, by column name
        self.tail_at = self.refs = self.held = 0  # held: the kept views' reference counts, summed, when kept alone

    def batch(self, buffer: np.ndarray, counts: list[int]) -> SampleBatch:
        """The batch of a message with these counts in `buffer` (a view of the pooled buffer)."""
        key = counts[:_HEAD]
        if key != self.key:
            root = buffer if buffer.base is None else buffer.base
            self.head, self.named, self.refs = (), {}, 0  # the old views go first: `refs` is measured without them
            before = sys.getrefcount(root)
            head, end = _slices(self.typed, _HEAD_SLOTS, key, HEADER_BYTES)
            self.head, self.named, self.key, self.tail_at = tuple(head), dict(zip(_HEAD_NAMES, head)), key, _align8(end)
            del head
            self.refs = sys.getrefcount(root) - before
            self.held = sum(map(sys.getrefcount, self.head))
        tail = _slices(self.typed, _TAIL_SLOTS, counts[_HEAD:], self.tail_at)[0]
        batch = object.__new__(SampleBatch)  # as `_adopt`, with the kept views merged in one go
        columns = batch.__dict__
        columns.update(self.named)
        columns.update(zip(_TAIL_NAMES, tail))
        batch._wire = (buffer, self.head + tuple(tail))
        return batch

    def in_use(self) -> bool:
        """Whether a kept view is held outside this object (a batch, or a column someone kept): a
        count can only be above its own when alone, so the sum says it (one pass in C)."""
        return sum(map(sys.getrefcount, self.head)) != self.held


def _adopt(buffer: np.ndarray, views) -> SampleBatch:
    """The batch whose columns are `views` (in WIRE_ORDER) into `buffer`, remembered as its wire form.
    Every column is at full length already (the layout was sized so), so the dataclass init is
    skipped: this runs once per received message."""
    batch = object.__new__(SampleBatch)
    views = tuple(views)
    batch.__dict__.update(zip(WIRE_ORDER, views))
    batch._wire = (buffer, views)
    return batch


def from_wire(buffer: np.ndarray, pooled: WireViews | None = None) -> SampleBatch:
    """The batch a wire buffer holds (what `wire()` returned on the sender); columns are views, no copy.
    `pooled`: the `WireViews` of the pooled receive buffer `buffer` starts (`ReceiveBuffers.take_typed`)."""
    counts = memoryview(buffer)[8:HEADER_BYTES].cast("q").tolist()  # the header less the sample count
    if pooled is None:
        return _adopt(buffer, _views(buffer, counts))
    return pooled.batch(buffer, counts)


def _filled(batch: SampleBatch) -> SampleBatch:
    """`batch` with every per-sample column at full length (zeros where it had none)."""
    if not len(batch) or all(getattr(batch, c).size == len(batch) for c in PER_SAMPLE):
        return batch
    return SampleBatch(**{c: getattr(batch, c) for c in COLUMNS})


def _packed(batch: SampleBatch) -> SampleBatch:
    sizes = {c: getattr(batch, c).size for c in COLUMNS}
    buffer, views = _layout(len(batch), sizes)
    for name in COLUMNS:
        if sizes[name]:
            views[name][:] = getattr(batch, name)
    return _adopt(buffer, views.values())
