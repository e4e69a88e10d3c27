"""The Megatron groups the trainer builds are the plan's layout, for every shipped trainer shape
that runs here (one process per trainer rank, gloo, as in a run)."""
import multiprocessing as mp
import socket
from pathlib import Path

import pytest

from yatt_hpc.config import load_config
from yatt_hpc.placement import plan

REPO = Path(__file__).resolve().parents[2]
CPU_SHAPES = ["demo_cpu.yaml", "disjoint_cpu.yaml", "partial_cpu.yaml", "demo_1gpu.yaml"]


def _rank(rank: int, shapes: list, ports: list, out) -> None:
    """One process per rank of the largest shape; it joins each shape's world it is part of in turn."""
    from yatt_hpc.train import megatron_model

    for (tasks, tp), port in zip(shapes, ports):
        if rank < tasks:
            megatron_model.initialize_model_parallel(rank, tasks, "127.0.0.1", port, tp_size=tp, timeout_s=120)
            out.put(((tasks, tp), rank, megatron_model.built_group_sizes()))
            megatron_model.destroy_model_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_built_megatron_groups_match_the_plan():
    trainers = {name: plan(load_config(REPO / "configs" / name)).group("trainer") for name in CPU_SHAPES}
    shapes = sorted({(t.tasks, t.size("tp")) for t in trainers.values()})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [_free_port() for _ in shapes]
    procs = [ctx.Process(target=_rank, args=(r, shapes, ports, out)) for r in range(max(t for t, _ in shapes))]
    for p in procs:
        p.start()
    built: dict = {}
    for _ in range(sum(t for t, _ in shapes)):
        shape, rank, sizes = out.get(timeout=300)
        built.setdefault(shape, {})[rank] = sizes
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for name, t in trainers.items():
        assert built[(t.tasks, t.size("tp"))] == {r: dict(t.layout) for r in range(t.tasks)}, name


def test_a_mismatch_between_built_groups_and_plan_is_named(monkeypatch):
    from yatt_hpc.train import megatron_model

    trainer = plan(load_config(REPO / "configs" / "demo_cpu.yaml")).group("trainer")
    monkeypatch.setattr(megatron_model, "built_group_sizes", lambda: {"tp": 1, "cp": 1, "dp": 8, "pp": 1})
    with pytest.raises(RuntimeError, match=r"built groups .*'dp': 8.* plan's trainer layout is .*'dp': 2"):
        megatron_model.check_groups(trainer)
