"""The batch's contiguous wire layout (yatt_hpc/batch.py): what select/concat/packed build, and when
`wire()` may hand that buffer to the transport."""
import numpy as np
import pytest

from yatt_hpc.batch import COLUMNS, SampleBatch, from_wire
from yatt_hpc.comm.transport import pack, wire_parts


def column_built(n: int = 5, seed: int = 0) -> SampleBatch:
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(1, 6, n).astype(np.int32), rng.integers(1, 9, n).astype(np.int32)
    return SampleBatch(sample_id=np.arange(n, dtype=np.int64), prompt_id=np.arange(n) // 2, owner=np.zeros(n, np.int32),
                       prompt_len=plen, prompt_tokens=rng.integers(0, 99, plen.sum(), dtype=np.int32),
                       response_len=rlen, response_tokens=rng.integers(0, 99, rlen.sum(), dtype=np.int32),
                       logprobs=rng.standard_normal(rlen.sum()).astype(np.float32),
                       answer_len=np.full(n, 2, np.int32), answer=np.frombuffer(b"ab" * n, np.uint8).copy())


def same(a: SampleBatch, b: SampleBatch) -> None:
    for c in COLUMNS:
        assert np.array_equal(getattr(a, c), getattr(b, c)), c


def test_select_concat_and_packed_lie_in_one_buffer_laid_out_as_the_wire():
    plain = column_built()
    assert plain.wire() is None, "built column by column: the transport packs it"
    for made in (plain.select(np.arange(len(plain))), SampleBatch.concat([plain]), SampleBatch.packed(
            **{c: getattr(plain, c) for c in COLUMNS})):
        buffer = made.wire()
        assert buffer is not None
        same(made, plain)
        assert buffer.tobytes() == np.concatenate(wire_parts(plain)).tobytes(), "the same bytes as packing"
        for c in COLUMNS:
            col = getattr(made, c)
            assert col.size == 0 or np.shares_memory(col, buffer), c
        same(from_wire(buffer.copy()), plain)
        assert pack(made) is buffer, "sent as it lies: no copy"


def test_select_reorders_and_drops_samples_like_fancy_indexing():
    plain = column_built(n=6)
    picked = plain.select(np.array([4, 1, 1, 0]))
    assert picked.sample_id.tolist() == [4, 1, 1, 0]
    ragged = plain.ragged("response_tokens")
    assert np.array_equal(picked.response_tokens, np.concatenate([ragged[i] for i in (4, 1, 1, 0)]))
    assert picked.wire() is not None and len(plain.select(np.array([], np.int64))) == 0


def test_in_place_writes_keep_the_wire_and_a_replaced_column_drops_it():
    made = column_built().select(np.arange(5))
    made.reward[:] = 0.5  # what the judge does
    assert made.wire() is not None and from_wire(made.wire()).reward.tolist() == [0.5] * 5
    made.reward = np.ones(5, np.float32)
    assert made.wire() is None, "a new array is not in the buffer any more"
    same(from_wire(pack(made)), made)  # the transport then packs the batch as it is now


def test_concat_fills_per_sample_columns_a_part_lacked():
    a = column_built(n=3)
    prompts = SampleBatch(sample_id=np.arange(2, dtype=np.int64), prompt_id=np.arange(2), owner=np.zeros(2, np.int32),
                          prompt_len=np.ones(2, np.int32), prompt_tokens=np.ones(2, np.int32))
    both = SampleBatch.concat([a, prompts])
    assert len(both) == 5 and both.reward.shape == (5,) and both.response_len[3:].tolist() == [0, 0]
    assert both.wire() is not None


def test_a_receive_buffer_is_taken_again_only_once_no_batch_uses_it():
    from yatt_hpc.comm.transport import ReceiveBuffers

    pool = ReceiveBuffers(keep=2, largest=1 << 20)
    wire = column_built().select(np.arange(5)).wire()
    first = pool.take(wire.nbytes)
    first[:] = wire
    got = from_wire(first)  # columns are views of the pooled buffer
    owner = id(first.base)
    del first
    second = pool.take(wire.nbytes)
    assert id(second.base) != owner  # `got` still reads that memory: a second buffer
    assert got.sample_id.tolist() == list(range(5))
    del got, second
    again = pool.take(wire.nbytes - 8)
    assert id(again.base) in (owner, id(pool._buffers[1])) and again.nbytes == wire.nbytes - 8
    assert len(pool) == 2
    assert pool.take(2 << 20).base is None and len(pool) == 2  # past `largest`: a buffer of its own, not kept


def test_a_pooled_buffer_comes_with_typed_views_that_give_the_same_batch():
    from yatt_hpc.comm.transport import ReceiveBuffers

    pool = ReceiveBuffers(keep=1, largest=1 << 20)
    wire = column_built().select(np.arange(5)).wire()
    buffer, typed = pool.take_typed(wire.nbytes + 64)  # a bigger message first: the buffer outlives it
    del buffer
    buffer, again = pool.take_typed(wire.nbytes)
    assert again is typed and buffer.nbytes == wire.nbytes
    buffer[:] = wire
    got = from_wire(buffer, typed)
    same(got, from_wire(wire.copy()))
    assert all(getattr(got, c).size == 0 or np.shares_memory(getattr(got, c), buffer) for c in COLUMNS)
    assert pool.take_typed(wire.nbytes)[1] is None, "in use by `got`, and the pool keeps one: a buffer of its own"
    del got, buffer
    assert pool.take_typed(wire.nbytes)[1] is typed, "free again once no column refers to it"


def receive(pool, wire: np.ndarray) -> SampleBatch:
    """What `recv_batch` does with a message once MPI has it: into a pooled buffer, then views."""
    buffer, pooled = pool.take_typed(wire.nbytes)
    buffer[:] = wire
    return from_wire(buffer, pooled)


def test_a_stream_of_equal_sized_batches_reuses_the_per_sample_views_and_reads_right():
    from yatt_hpc.batch import PER_SAMPLE, RAGGED
    from yatt_hpc.comm.transport import ReceiveBuffers

    pool = ReceiveBuffers(keep=1, largest=1 << 20)
    first_src, second_src = column_built(seed=1), column_built(seed=2)  # same n, other ragged sizes
    first = receive(pool, first_src.select(np.arange(5)).wire())
    same(first, first_src)
    kept = {c: id(getattr(first, c)) for c in PER_SAMPLE}
    del first
    second = receive(pool, second_src.select(np.arange(5)).wire())
    same(second, second_src)  # the can-fail check: stale per-sample or misplaced ragged views would differ
    assert {c: id(getattr(second, c)) for c in PER_SAMPLE} == kept, "the same per-sample view objects"
    assert second.wire() is not None and all(np.shares_memory(getattr(second, c), second.wire())
                                             for c in RAGGED if getattr(second, c).size)
    del second
    odd = column_built(n=3, seed=3)  # another sample count: new views (and 8-byte padding before the ragged ones)
    got = receive(pool, odd.select(np.arange(3)).wire())
    same(got, odd)  # kept views of 5 samples would not be
    assert got.sample_id.shape == (3,) and len(pool) == 1


def test_a_kept_column_keeps_its_buffer_from_being_written_again():
    """A per-sample column someone kept after dropping its batch is a view the pool would reuse: the
    buffer must stay busy, or the next message would overwrite the kept values."""
    from yatt_hpc.comm.transport import ReceiveBuffers

    pool = ReceiveBuffers(keep=2, largest=1 << 20)
    first_src, second_src = column_built(seed=4), column_built(seed=5)
    first = receive(pool, first_src.select(np.arange(5)).wire())
    rewards = first.prompt_id  # a per-sample column, kept
    owner = id(first.wire().base)  # the pooled buffer (the pool keeps it: its id stays its own)
    del first
    second = receive(pool, second_src.select(np.arange(5)).wire())
    assert id(second.wire().base) != owner, "the kept column's buffer was not taken"
    assert rewards.tolist() == first_src.prompt_id.tolist()
    same(second, second_src)
    del rewards, second
    third = receive(pool, first_src.select(np.arange(5)).wire())
    same(third, first_src)


def test_padding_between_per_sample_and_ragged_columns_is_zero_and_packing_matches():
    for n in (1, 3, 5):
        plain = column_built(n=n, seed=n)
        made = plain.select(np.arange(n))
        assert made.wire().tobytes() == np.concatenate(wire_parts(plain)).tobytes()
        same(from_wire(made.wire().copy()), plain)


@pytest.mark.parametrize("seed", range(5))
def test_select_gathers_every_column_of_the_picked_samples_in_order(seed):
    """`select` gathers the ragged columns in one vectorised step: each picked sample keeps exactly its
    own elements (empty rows, repeats, any order), checked against a per-sample split of the source."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    pl, rl = rng.integers(0, 9, n).astype(np.int32), rng.integers(0, 5, n).astype(np.int32)
    ml = np.where(rng.random(n) < 0.5, 0, rng.integers(1, 7, n)).astype(np.int32)
    batch = SampleBatch(sample_id=rng.permutation(n).astype(np.int64), prompt_id=np.arange(n, dtype=np.int64),
                        prompt_len=pl, prompt_tokens=rng.integers(0, 99, pl.sum()).astype(np.int32),
                        response_len=rl, response_tokens=rng.integers(0, 99, rl.sum()).astype(np.int32),
                        logprobs=rng.random(rl.sum()).astype(np.float32), metadata_len=ml,
                        metadata=rng.integers(0, 255, ml.sum()).astype(np.uint8))
    for index in (rng.permutation(n), rng.integers(0, n, 2 * n), np.zeros(0, np.int64), np.argsort(batch.sample_id)):
        got = batch.select(index)
        assert len(got) == len(index)
        np.testing.assert_array_equal(got.sample_id, batch.sample_id[index])
        for name in ("prompt_tokens", "response_tokens", "logprobs", "metadata"):
            source = batch.ragged(name)
            want = [source[i] for i in index]
            assert [a.tolist() for a in got.ragged(name)] == [w.tolist() for w in want], name
        assert got.wire() is not None


def test_select_writes_given_columns_as_they_are_and_refuses_a_length_without_its_columns():
    plain = column_built(n=5, seed=7)
    rows = np.array([3, 1])
    lens = np.array([2, 3], np.int32)
    made = plain.select(rows, response_len=lens, response_tokens=np.array([7, 8, 9, 10, 11], np.int32),
                        logprobs=np.linspace(0, 1, 5, dtype=np.float32), finish=np.array([1, 0], np.int8))
    picked = plain.select(rows)
    for c in COLUMNS:
        if c not in ("response_len", "response_tokens", "logprobs", "token_version", "finish", "response_mask"):
            assert np.array_equal(getattr(made, c), getattr(picked, c)), c
    assert made.token_version.tolist() == [0] * 5, "responses given without versions: version 0"
    assert made.response_len.tolist() == [2, 3] and made.response_tokens.tolist() == [7, 8, 9, 10, 11]
    assert made.finish.tolist() == [1, 0] and made.wire() is not None, "one buffer: sent as it lies"
    same(from_wire(made.wire().copy()), made)
    with pytest.raises(ValueError, match="'response_len' is given but not response_tokens, logprobs"):
        plain.select(rows, response_len=lens)
    with pytest.raises(ValueError, match="'rewards' is not a SampleBatch column"):
        plain.select(rows, rewards=np.zeros(2, np.float32))


_HAS_ROOM = """
import numpy as np
from mpi4py import MPI
from yatt_hpc.batch import SampleBatch
from yatt_hpc.comm.transport import TAG_SAMPLES, StreamSender, recv_batch

n = 20000  # ~0.5 MB: above any eager limit, so the send completes only once received
batch = SampleBatch(sample_id=np.arange(n, dtype=np.int64), prompt_id=np.arange(n, dtype=np.int64),
                    owner=np.zeros(n, np.int32), prompt_len=np.full(n, 3, np.int32),
                    prompt_tokens=np.arange(3 * n, dtype=np.int32))
sender = StreamSender(MPI.COMM_SELF, max_inflight=1)
seen = [sender.has_room()]
sender.send(0, TAG_SAMPLES, batch)
seen += [sender.has_room(), sender.has_room()]
got, _ = recv_batch(MPI.COMM_SELF, 0, TAG_SAMPLES)
seen += [sender.has_room(), bool(np.array_equal(got.prompt_tokens, batch.prompt_tokens))]
print(seen)
"""


def test_a_stream_sender_has_room_again_once_its_oldest_send_is_received():
    """`has_room` never waits: a send not yet received (a rendezvous-size message to this same rank)
    keeps a one-send queue full, and the receive frees it. In a fresh interpreter (a singleton MPI
    process): the unit tests keep MPI out of pytest's own process."""
    import subprocess
    import sys

    from tests.conftest import REPO, mpi_env

    proc = subprocess.run([sys.executable, "-c", _HAS_ROOM], cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "[True, False, False, True, True]", proc.stdout
