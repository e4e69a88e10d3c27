"""How weights travel to each engine (`rollout.weight_transport`): the pure per-destination decision for every
shipped config, the refusals, the pairs' owners, and the manifest and bucket formats.

    .venv/bin/python -m pytest tests/unit/test_weight_transport.py -q
"""
from pathlib import Path

import pytest
import torch

from yatt_hpc.comm.weight_sync import iter_buckets
from yatt_hpc.config import load_config
from yatt_hpc.device.weight_group import BucketManifest, Rendezvous
from yatt_hpc.placement import PlanError, plan
from yatt_hpc.placement.weight_transport import shared_gpus, weight_owner, weight_pairs
from yatt_hpc.sched.routing import RoleSplit, Routes

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIGS = ["demo_cpu", "demo_moe_cpu", "demo_tools_cpu", "demo_vlm_cpu", "disjoint_cpu", "partial_cpu",
               "tools_disjoint_cpu"]


def cfg(name: str, *overrides: str):
    return load_config(REPO / "configs" / f"{name}.yaml", overrides)


def transports(name: str, *overrides: str) -> dict[int, str]:
    c = cfg(name, *overrides)
    return {d: p.transport for d, p in weight_pairs(plan(c), c.rollout.weight_transport, c.rollout.engine).items()}


def test_every_shipped_config_is_decided():
    shipped = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert shipped == sorted([*CPU_CONFIGS, "demo_1gpu", "colocate_gpu", "partial_gpu", "qwen2_7b_disjoint_1024gpu",
                              "qwen2_72b_disjoint_h200", "qwen3_30b_a3b_disjoint_h200"])


@pytest.mark.parametrize("name", CPU_CONFIGS + ["demo_1gpu"])
def test_auto_takes_mpi_on_cpu_and_with_the_hf_engine(name):
    assert set(transports(name).values()) == {"mpi"}  # demo_1gpu: hf on one GPU shared by all three groups


def test_auto_on_a_disjoint_gpu_job_broadcasts_to_every_engine():
    got = transports("qwen2_7b_disjoint_1024gpu")
    assert len(got) == 192 and set(got.values()) == {"collective"}  # engines have nodes of their own
    # the MoE policy's 16 engines, every expert to each: at ep 1 by broadcast; its ep 8 has 8 senders an engine (mpi)
    got = transports("qwen3_30b_a3b_disjoint_h200", "placement.trainer.ep=1")
    assert len(got) == 16 and set(got.values()) == {"collective"}
    assert set(transports("qwen3_30b_a3b_disjoint_h200").values()) == {"mpi"}


def test_auto_on_colocated_gpus_takes_ipc_only_where_an_engine_shares_its_owners_gpu():
    # 4 nodes x 8 GPUs; trainer tp2 -> dp16, owner of replica d is world rank 2d (node 2d//8, GPU 2d%8);
    # rollout rank i (world 32+i, node i//8, GPU i%8) takes replica i%16: only i=0 lands on its owner's GPU
    got = transports("colocate_gpu")
    assert got == {32 + i: "ipc" if i == 0 else "collective" for i in range(32)}


def test_auto_on_partial_gpus_takes_ipc_only_for_the_engine_on_its_owners_gpu():
    # 2 nodes; owner of replica d (dp 8) is world rank 2d; rollout rank i (world 16+i) is node i//6, GPU i%6
    got = transports("partial_gpu")
    assert got == {16 + i: "ipc" if i == 0 else "collective" for i in range(12)}


def test_a_dynamic_splits_genrm_side_ranks_are_destinations_with_fixed_owners():
    c = cfg("partial_gpu", "placement.genrm.tasks_per_node=2", "placement.genrm.devices_per_task=1",
            "placement.genrm.tp=1", "placement.dynamic_split.enabled=true")
    p = plan(c)
    pairs = weight_pairs(p, "auto", "sglang")
    assert sorted(pairs) == list(p.pool_ranks) == list(range(16, 32))
    # GenRM's GPUs follow rollout's (6, 7): pool ranks 28-31 serve replicas 4-7, owners on other GPUs/nodes
    assert {d: pairs[d].transport for d in range(28, 32)} == dict.fromkeys(range(28, 32), "collective")
    assert pairs[16].transport == "ipc" and pairs[16].shared_gpus == (0,)
    # whatever the split, the routes send each pool rank its weights from the pair's owner
    for first in range(1, 16):
        routes = Routes(p, RoleSplit(rollout=8, next_rollout=first))
        for dest in routes.next_rollout_ranks():
            assert routes.trainer_owner(routes.weight_source_for(dest)) == pairs[dest].owner == weight_owner(p, dest)


def test_a_pair_brings_the_engines_tensor_parallel_ranks():
    c = cfg("qwen2_7b_disjoint_1024gpu")
    pairs = weight_pairs(plan(c), "collective", "sglang")
    assert {p.engine_ranks for p in pairs.values()} == {2}  # rollout replicas are tp2
    assert pairs[512].owner == 0 and pairs[512 + 128].owner == 0  # 192 engines over 128 replicas


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_collective_on_cpu_is_gloo_for_every_engine(name):
    # the MoE demo's ep 2 has two senders per engine (refused with collective): its experts at ep 1 here
    ep1 = ("placement.trainer.ep=1",) if name == "demo_moe_cpu" else ()
    assert set(transports(name, "rollout.weight_transport=collective", *ep1).values()) == {"collective"}


def test_an_expert_parallel_trainer_sends_over_mpi_and_refuses_collective():
    """Each expert-parallel rank sends its own experts (`Routes.weight_senders`): one sender per pair's group cannot."""
    assert set(transports("demo_moe_cpu").values()) == {"mpi"}  # ep 2: auto takes mpi
    with pytest.raises(PlanError, match=r"placement.trainer.pp=1 ep=2: each pipeline stage's owner \(and each "
                                        r"expert-parallel rank\) sends its own"):
        transports("demo_moe_cpu", "rollout.weight_transport=collective")


@pytest.mark.parametrize("name", CPU_CONFIGS + ["demo_1gpu", "colocate_gpu", "partial_gpu", "qwen2_7b_disjoint_1024gpu",
                              "qwen2_72b_disjoint_h200", "qwen3_30b_a3b_disjoint_h200"])
def test_mpi_is_mpi_everywhere(name):
    assert set(transports(name, "rollout.weight_transport=mpi").values()) == {"mpi"}


REFUSED = [
    pytest.param("demo_1gpu", (), "rollout rank 1 shares GPU(s) [0] of node 0 with its trainer owner (world rank 0)",
                 id="one-gpu-colocate"),
    pytest.param("colocate_gpu", (), "rollout rank 32 shares GPU(s) [0] of node 0", id="colocate-gpu"),
    pytest.param("partial_gpu", (), "rollout rank 16 shares GPU(s) [0] of node 0", id="partial-gpu"),
    pytest.param("disjoint_cpu", ("placement.rollout.devices_per_task=1",),
                 "rollout rank 4 runs on GPU but its trainer owner (world rank 0) on CPU", id="gpu-engine-cpu-trainer"),
]


@pytest.mark.parametrize("name, overrides, needle", REFUSED)
def test_collective_is_refused_before_launch_where_it_cannot_work(name, overrides, needle):
    with pytest.raises(PlanError) as err:
        plan(cfg(name, "rollout.weight_transport=collective", *overrides))
    text = str(err.value)
    assert text.startswith("rollout.weight_transport=collective: ") and needle in text, text
    assert "set rollout.weight_transport=" in text  # the fix


def test_an_unknown_transport_is_refused_by_the_config_listing_the_choices():
    with pytest.raises(Exception, match="auto.*mpi.*collective"):
        cfg("demo_cpu", "rollout.weight_transport=nccl")


def test_shared_gpus_needs_the_same_node_and_device():
    p = plan(cfg("partial_gpu"))
    assert shared_gpus(p, 0, 16) == (0,)  # trainer rank 0 and rollout rank 0 of node 0: GPU 0
    assert shared_gpus(p, 8, 16) == ()  # trainer rank 8 is node 1's GPU 0
    assert shared_gpus(p, 0, 1) == ()  # GPUs 0 and 1 of one node
    assert shared_gpus(plan(cfg("demo_cpu")), 0, 2) == ()  # CPU ranks share no GPU


def test_the_bucket_manifest_is_what_sglang_takes_and_round_trips():
    bucket = [("a.weight", torch.zeros(2, 3)), ("b.bias", torch.zeros(4, dtype=torch.bfloat16))]
    manifest = BucketManifest.of("yatt-weights-0-2", bucket, final=True)
    assert manifest.as_dict() == {"group_name": "yatt-weights-0-2", "names": ["a.weight", "b.bias"],
                                  "dtypes": ["float32", "bfloat16"], "shapes": [[2, 3], [4]], "final": True}
    assert BucketManifest.from_dict(manifest.as_dict()) == manifest
    assert manifest.nbytes == 2 * 3 * 4 + 4 * 2
    assert [(t.dtype, tuple(t.shape)) for t in manifest.empty("cpu")] == [(torch.float32, (2, 3)), (torch.bfloat16, (4,))]
    with pytest.raises(ValueError, match="unknown"):
        BucketManifest.from_dict({**manifest.as_dict(), "dtypes": ["float32", "complex64"]})


def test_the_rendezvous_carries_sglangs_init_weights_update_group_arguments():
    r = Rendezvous("10.0.0.1", 29500, 3, 1, "yatt-weights-0-4", "nccl")
    assert r.as_dict() == {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3, "rank_offset": 1,
                           "group_name": "yatt-weights-0-4", "backend": "nccl"}
    assert Rendezvous.from_dict(r.as_dict()) == r


def test_buckets_are_bounded_the_last_is_final_and_a_big_tensor_goes_alone():
    weights = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("big", torch.zeros(100)), ("c", torch.zeros(5))]
    got = [([n for n, _ in bucket], final) for bucket, final in iter_buckets(iter(weights), limit=100)]
    assert got == [(["a", "b"], False), (["big"], False), (["c"], True)]
    assert list(iter_buckets(iter([]), limit=100)) == [([], True)]


def test_an_mpi_bucket_is_sent_from_each_tensors_own_bytes():
    """No bucket is packed: each contiguous CPU tensor goes from its own bytes (every dtype and shape, a 0-d and
    an empty one included), and a non-contiguous one from a contiguous copy; the manifest says how to rebuild it."""
    from yatt_hpc.comm.weight_sync import _mpi_bucket

    bucket = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
              ("t", torch.arange(6, dtype=torch.float32).reshape(2, 3).t()), ("s", torch.tensor(2.5)),
              ("e", torch.zeros(0, 4))]
    body, pieces = _mpi_bucket(bucket, final=True)
    assert body == {"final": True, "tensors": [
        {"name": "a", "dtype": "bfloat16", "shape": [3]}, {"name": "b", "dtype": "float32", "shape": [2, 3]},
        {"name": "t", "dtype": "float32", "shape": [3, 2]}, {"name": "s", "dtype": "float32", "shape": []},
        {"name": "e", "dtype": "float32", "shape": [0, 4]}]}
    assert [p.size for p in pieces] == [6, 24, 24, 4, 0]
    own_bytes = [bool(t.numel()) and p.ctypes.data == t.data_ptr() for p, (_, t) in zip(pieces, bucket)]
    assert own_bytes == [True, True, False, True, False]
    for piece, (_, tensor) in zip(pieces, bucket):
        rebuilt = torch.empty(tensor.shape, dtype=tensor.dtype)  # what the receiver does (`_recv_mpi_bucket`)
        rebuilt.reshape(-1).view(torch.uint8).numpy()[:] = piece
        assert torch.equal(rebuilt, tensor)


def test_a_pipelined_trainer_sends_over_mpi_and_refuses_collective():
    """Every stage's owner sends its own layers (`Routes.stage_owners`): one sender per pair's group cannot."""
    assert set(transports("qwen2_72b_disjoint_h200").values()) == {"mpi"}  # tp8 pp4: auto takes mpi
    with pytest.raises(PlanError, match=r"rollout.weight_transport=collective with placement.trainer.pp=4 ep=1: each "
                                        r"pipeline stage's owner \(and each expert-parallel rank\) sends its own"):
        transports("qwen2_72b_disjoint_h200", "rollout.weight_transport=collective")
