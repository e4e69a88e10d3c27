"""The sharded optimizer's pure parts, by hand: the row split, the optimizer files put back together, the
data positions dealt to another number of replicas, and AdamW's restored step count."""
import json

import pytest
import torch

from yatt_hpc.ckpt.optim import assemble_state
from yatt_hpc.optim.adamw import AdamW
from yatt_hpc.optim.sharded import Piece, shard_pieces
from yatt_hpc.sched.overdispatch import PromptQueue, relayout_positions


def test_the_split_cuts_the_flat_layout_at_the_nearest_rows():
    # 20 elements, cut at 10: a's rows are 3 wide, 10/3 rounds to row 3; b and c fall after the cut
    shapes = [("a", (4, 3)), ("b", (2,)), ("c", (6, 1))]
    assert shard_pieces(shapes, 2) == [[Piece("a", 0, 3)], [Piece("a", 3, 4), Piece("b", 0, 2), Piece("c", 0, 6)]]
    assert shard_pieces(shapes, 1) == [[Piece("a", 0, 4), Piece("b", 0, 2), Piece("c", 0, 6)]]


@pytest.mark.parametrize("ranks", [2, 3, 5, 8])
def test_every_row_has_one_owner_and_the_shares_are_even(ranks):
    shapes = [("emb", (1000, 64)), ("ln", (64,)), *((f"w{i}", (192, 64)) for i in range(6)), ("head", (1000, 64))]
    plan = shard_pieces(shapes, ranks)
    for name, shape in shapes:
        rows = sorted((p.lo, p.hi) for pieces in plan for p in pieces if p.name == name)
        assert rows[0][0] == 0 and rows[-1][1] == shape[0] and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    sizes = [sum((p.hi - p.lo) * (dict(shapes)[p.name][1:] or (1,))[0] for p in pieces) for pieces in plan]
    total = sum(s[0] * (s[1:] or (1,))[0] for _, s in shapes)
    assert max(abs(s - total / ranks) for s in sizes) <= 64  # within one row of an even share


def test_optimizer_files_of_the_ranks_are_put_back_together_and_a_missing_one_is_named():
    whole = torch.arange(12.0).reshape(6, 2)
    meta = {"param_groups": json.dumps([{"lr": 0.1}])}
    parts = [({"w.exp_avg": whole[:4], "w.step": torch.tensor(3.0)}, {**meta, "rows": json.dumps({"w": [0, 4, 6]})}),
             ({"w.exp_avg": whole[4:], "w.step": torch.tensor(3.0)}, {**meta, "rows": json.dumps({"w": [4, 6, 6]})})]
    full, got_meta = assemble_state(parts[::-1])  # any file order
    assert torch.equal(full["w.exp_avg"], whole) and float(full["w.step"]) == 3.0 and "rows" not in got_meta
    with pytest.raises(ValueError, match="'w' lacks rows 4..6"):
        assemble_state(parts[:1])
    unsharded = ({"w.exp_avg": whole}, meta)
    assert assemble_state([unsharded, unsharded])[0]["w.exp_avg"] is whole


def test_positions_of_equal_replicas_continue_the_global_stream():
    saved = [{"next_index": 3, "returned": [], "base": 0}, {"next_index": 3, "returned": [], "base": 0}]
    assert relayout_positions(saved, 1) == [{"next_index": 0, "returned": [], "base": 6}]
    queues = [PromptQueue(3, d, base=p["base"]) for d, p in enumerate(relayout_positions(saved, 3))]
    assert sorted(int(x) for q in queues for x in q.take(2)[0]) == list(range(6, 12))  # the next 6, as dp 2 would


def test_returned_and_unreached_positions_are_dealt_out_oldest_first():
    # replica 1 is one position behind and gave back position 1: 1 and 5 are pending below the new base 6
    saved = [{"next_index": 3, "returned": []}, {"next_index": 2, "returned": [1]}]
    assert relayout_positions(saved, 1) == [{"next_index": 0, "returned": [1, 5], "base": 6}]
    assert [p["returned"] for p in relayout_positions(saved, 2)] == [[1], [5]]


@pytest.mark.parametrize("old, new", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_every_position_is_consumed_once_across_a_relayout(old, new):
    queues = [PromptQueue(old, d) for d in range(old)]
    taken = []
    for step in range(3):
        for d, q in enumerate(queues):
            got, _ = q.take(2 + (d + step) % 2)  # uneven progress
            if step == 2:
                q.give_back(got[-1:])  # a prompt not scored: it goes back to the front
                got = got[:-1]
            taken += [int(x) for x in got]
    states = [q.state() for q in queues]
    queues = [PromptQueue(new, d) for d in range(new)]
    for q, s in zip(queues, relayout_positions(states, new)):
        q.load_state(s["next_index"], s["returned"], s["base"])
    for _ in range(6):
        for q in queues:
            taken += [int(x) for x in q.take(2)[0]]
    assert len(taken) == len(set(taken))
    assert set(range(max(taken) - 2 * new)) <= set(taken)  # no position skipped below the last wave


def test_a_restored_step_count_is_each_parameters_own():
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    opt = AdamW(params, lr=0.1)
    shared = torch.tensor(2.0)  # one tensor for every parameter, as a resharded checkpoint hands it over
    opt.load_state_dict({"state": {i: {"step": shared, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                                   for i, p in enumerate(params)},
                         "param_groups": [{"lr": 0.1, "params": [0, 1]}]})
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [3.0, 3.0] and float(shared) == 2.0
