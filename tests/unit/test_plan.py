"""The pure placement planner: named layouts and the impossible ones."""
from pathlib import Path

import pytest

from yatt_hpc.config import load_config
from yatt_hpc.launch.commands import local_launch, render, srun_launch
from yatt_hpc.placement import PlanError, plan

REPO = Path(__file__).resolve().parents[2]


def cfg(name="demo_cpu.yaml", *overrides):
    return load_config(REPO / "configs" / name, overrides)


def test_demo_colocate_is_four_ranks_trainer_first():
    p = plan(cfg())
    assert p.mode == "colocate" and p.world_size == 4 and p.total_nodes == 1
    assert [(g.name, g.rank_start, g.rank_stop) for g in p.groups] == [("trainer", 0, 2), ("rollout", 2, 3), ("genrm", 3, 4)]
    assert p.group("trainer").layout == (("tp", 1), ("cp", 1), ("dp", 2), ("pp", 1))
    assert [p.group_of(r) for r in range(4)] == ["trainer", "trainer", "rollout", "genrm"]
    assert all(g.slurm.kind == "shared_allocation" for g in p.groups)


def test_1024_gpu_disjoint_layout():
    p = plan(cfg("qwen2_7b_disjoint_1024gpu.yaml"))
    assert p.total_devices == 1024 and p.total_nodes == 128
    t, r, g = (p.group(n) for n in ("trainer", "rollout", "genrm"))
    assert (t.tasks, t.devices, t.layout) == (512, 512, (("tp", 4), ("cp", 1), ("dp", 128), ("pp", 1)))
    assert (r.tasks, r.devices, r.layout) == (192, 384, (("tp", 2), ("pp", 1), ("dp", 192)))
    assert (g.tasks, g.devices, g.layout) == (32, 128, (("tp", 4), ("pp", 1), ("dp", 32)))
    assert (t.rank_start, r.rank_start, g.rank_start, p.world_size) == (0, 512, 704, 736)
    assert [x.slurm.component for x in p.groups] == [0, 1, 2]
    assert all(x.slurm.kind == "het_component" for x in p.groups)
    # Megatron order tp-cp-dp-pp, tp fastest: rank 4 is tp0 of dp1
    assert t.coords(4) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0}
    assert t.coords(511) == {"tp": 3, "cp": 0, "dp": 127, "pp": 0}
    assert r.coords(191) == {"dp": 191}


def test_colocate_gpu_shares_nodes_and_devices():
    p = plan(cfg("colocate_gpu.yaml"))
    assert p.total_nodes == 4 and p.total_devices == 32
    assert {g.devices for g in p.groups} == {32}
    assert p.group("genrm").layout == (("tp", 2), ("pp", 1), ("dp", 16))


def test_partial_splits_the_trainers_devices():
    p = plan(cfg("partial_gpu.yaml"))
    assert p.group("rollout").devices + p.group("genrm").devices == p.group("trainer").devices == 16


def test_dp_is_derived_when_null():
    p = plan(cfg("demo_cpu.yaml", "placement.trainer.dp=null", "placement.trainer.tasks_per_node=4",
                 "placement.trainer.tp=2", "placement.mode=disjoint"))
    assert p.group("trainer").layout == (("tp", 2), ("cp", 1), ("dp", 2), ("pp", 1))


def test_pipeline_stages_are_the_slowest_axis():
    """Megatron's rank order: tp fastest, then dp, then pp; a replica's stage owners are tp*dp ranks apart."""
    from yatt_hpc.sched.routing import Routes

    p = plan(cfg("demo_cpu.yaml", "placement.trainer.dp=null", "placement.trainer.tasks_per_node=8",
                 "placement.trainer.tp=2", "placement.trainer.pp=2", "placement.mode=disjoint"))
    trainer = p.group("trainer")
    assert trainer.layout == (("tp", 2), ("cp", 1), ("dp", 2), ("pp", 2))
    routes = Routes(p)
    assert routes.stage_owners(0) == [trainer.rank_start, trainer.rank_start + 4]
    assert routes.stage_owners(1) == [trainer.rank_start + 2, trainer.rank_start + 6]
    assert routes.trainer_coords(trainer.rank_start + 6) == {"tp": 0, "cp": 0, "dp": 1, "pp": 1}


IMPOSSIBLE = [
    pytest.param(("placement.trainer.tp=3",), "tp*cp*pp = 3*1*1 = 3 does not divide the group's 2 ranks",
        id="tp-not-dividing-ranks"),
    pytest.param(("placement.trainer.dp=4",), "placement.trainer.dp=4 but 2 ranks", id="dp-mismatch"),
    pytest.param(("placement.trainer.devices_per_task=2",), "drives exactly one device", id="trainer-two-devices"),
    # (an hf engine with tp > 1, e.g. a CPU one, is refused by the config already: tests/unit/test_config.py)
    pytest.param(("rollout.engine=sglang", "placement.rollout.tp=2", "placement.rollout.devices_per_task=3",
                  "placement.genrm.devices_per_task=1"), "does not divide devices_per_task=3",
        id="engine-tp-not-dividing-devices"),
    pytest.param(("placement.genrm.cp=2",), "context parallelism is a trainer feature", id="engine-cp"),
    pytest.param(("placement.trainer.cp=2", "placement.trainer.dp=null"), "placement.trainer.cp=2: Megatron-Core's "
        "context parallelism needs Transformer Engine's attention", id="trainer-cp"),
    pytest.param(("placement.trainer.ep=3",), "placement.trainer.ep=3 does not divide dp=2", id="trainer-ep-not-dividing-dp"),
    pytest.param(("placement.trainer.ep=2", "rollout.weight_transport=collective"),
                 "each pipeline stage's owner (and each expert-parallel rank) sends its own", id="trainer-ep-collective"),
    pytest.param(("placement.rollout.pp=2", "placement.rollout.devices_per_task=2"), "placement.rollout.pp=2: "
        "pipeline-parallel engine replicas are not implemented", id="engine-pp"),
    pytest.param(("placement.rollout.nodes=2",), "puts all groups on the same nodes", id="colocate-node-mismatch"),
    pytest.param(("placement.rollout.dp=3",), "placement.rollout.dp=3 but the group has 1 ranks", id="engine-dp-mismatch"),
    pytest.param(("train.prompts_per_step=7",), "set train.prompts_per_step=8", id="batch-not-divisible"),
]


@pytest.mark.parametrize("overrides, needle", IMPOSSIBLE)
def test_impossible_layouts_name_field_and_fix(overrides, needle):
    with pytest.raises(PlanError) as err:
        plan(cfg("demo_cpu.yaml", *overrides))
    assert needle in str(err.value)


def test_gpu_trainer_tp_must_stay_inside_a_node():
    with pytest.raises(PlanError, match="tensor parallelism must stay inside a node"):
        plan(cfg("colocate_gpu.yaml", "placement.trainer.tp=16", "placement.trainer.dp=null"))


def test_colocate_gpu_device_mismatch():
    with pytest.raises(PlanError, match="every group takes all devices of a node"):
        plan(cfg("colocate_gpu.yaml", "placement.rollout.tasks_per_node=4"))


def test_partial_device_split_must_add_up():
    with pytest.raises(PlanError, match="rollout 8 \\+ genrm 2 != trainer 8"):
        plan(cfg("partial_gpu.yaml", "placement.rollout.tasks_per_node=8"))


def test_group_of_outside_world_names_the_fix():
    with pytest.raises(PlanError, match="launch exactly 4 ranks"):
        plan(cfg()).group_of(4)


def test_launch_lines_are_one_mpmd_world():
    p = plan(cfg("disjoint_cpu.yaml"))
    local = render(local_launch(p, "runs/x y", python="py"))
    assert local.count(" : ") == 2 and "-np 4 py -m yatt_hpc.runtime.worker --group trainer --run-dir 'runs/x y'" in local
    srun = srun_launch(p, "r", python="py")
    assert srun[:3] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1"]
    # one step over all het components; rank_group maps each world rank to its group's --group
    assert [w for w in srun if w.startswith("--het-group")] == ["--het-group=0-2"]
    assert "trainer=0-3,rollout=4-4,genrm=5-5" in srun and ":" not in srun
    # shared nodes: Slurm gives each component of a het step its own nodes, so one plain step placed rank by rank
    shared = srun_launch(plan(cfg("colocate_gpu.yaml")), "r", python="py")
    assert "--distribution=arbitrary" in shared and "--ntasks=80" in shared and ":" not in shared


# ---------------------------------------------------------------- which GPUs each rank drives


def _devices(p, group):
    g = p.group(group)
    return [p.device_ids(r) for r in range(g.rank_start, g.rank_stop)]


def test_cpu_ranks_have_no_devices():
    p = plan(cfg())
    assert all(p.device_ids(r) == () for r in range(p.world_size))


def test_colocate_gpu_every_group_counts_from_the_first_device_of_its_node():
    p = plan(cfg("colocate_gpu.yaml"))  # 4 nodes x 8 GPUs; rollout tp1 x 8, GenRM tp2 x 4 per node
    assert _devices(p, "trainer")[:9] == [(i,) for i in range(8)] + [(0,)]
    assert _devices(p, "rollout")[:9] == [(i,) for i in range(8)] + [(0,)]
    assert _devices(p, "genrm")[:5] == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1)]


def test_partial_gpu_genrm_takes_the_devices_after_rollout():
    p = plan(cfg("partial_gpu.yaml"))  # 2 nodes x 8 GPUs: rollout 6 x 1, GenRM 1 x tp2
    assert _devices(p, "rollout") == [(i,) for i in range(6)] * 2
    assert _devices(p, "genrm") == [(6, 7), (6, 7)]
    per_node = {}  # on each node the engine ranks cover the trainer's 8 devices exactly once
    for group in ("rollout", "genrm"):
        g = p.group(group)
        for r in range(g.rank_start, g.rank_stop):
            per_node.setdefault((r - g.rank_start) // g.tasks_per_node, []).extend(p.device_ids(r))
    assert all(sorted(ids) == list(range(8)) for ids in per_node.values())


def test_disjoint_1024_gpu_replicas_own_consecutive_devices_of_their_node():
    p = plan(cfg("qwen2_7b_disjoint_1024gpu.yaml"))
    assert _devices(p, "rollout")[:5] == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1)]
    assert _devices(p, "genrm")[:3] == [(0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 2, 3)]
    assert _devices(p, "trainer")[7:9] == [(7,), (0,)]


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_no_two_ranks_of_a_group_share_a_device_on_a_node(name):
    p = plan(cfg(name))
    for g in p.groups:
        seen = {}
        for r in range(g.rank_start, g.rank_stop):
            node = (r - g.rank_start) // g.tasks_per_node
            for d in p.device_ids(r):
                assert (node, d) not in seen, (name, g.name, r, seen[(node, d)], d)
                seen[(node, d)] = r
                assert d < p.group("trainer").tasks_per_node * max(1, p.group("trainer").devices_per_task) \
                    or p.mode == "disjoint", (name, g.name, r, d)


@pytest.mark.parametrize(("name", "refused"), [
    pytest.param("demo_cpu.yaml", False, id="cpu-one-node"),
    pytest.param("disjoint_cpu.yaml", False, id="cpu-disjoint-runs-on-one-host"),
    pytest.param("demo_1gpu.yaml", False, id="gpu-one-node"),
    pytest.param("partial_gpu.yaml", True, id="gpu-two-nodes"),
    pytest.param("qwen2_7b_disjoint_1024gpu.yaml", True, id="gpu-disjoint"),
])
def test_a_local_run_refuses_gpu_plans_that_span_nodes(name, refused):
    from yatt_hpc.launch.local import LaunchError, check_one_host

    p = plan(cfg(name))
    if not refused:
        check_one_host(p)
        return
    with pytest.raises(LaunchError, match=rf"spans {p.total_nodes} nodes .*same GPU indices.*yatt-hpc submit"):
        check_one_host(p)
