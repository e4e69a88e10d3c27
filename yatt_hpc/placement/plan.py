"""The pure placement planner: config in, where every rank runs out.

    from yatt_hpc.placement import plan
    p = plan(cfg)                      # raises PlanError for impossible layouts
    p.group_of(world_rank)             # -> "trainer" | "rollout" | "genrm" | "tools"

No environment reads, no files: `yatt-hpc plan` prints exactly what `run`/`submit` will use.

World-rank order is trainer, rollout, genrm, then tools (only with `placement.tools.tasks_per_node` > 0),
so world rank 0 (the leader, decisions only) is trainer rank 0. Layouts follow WeChat-YATT: the trainer is
Megatron tp-cp-dp-pp (tp fastest), rollout and GenRM are tp-pp-dp where one MPI rank controls one engine
replica of tp*pp devices. Tool ranks are CPU-only, one rank per `dp` index; in `disjoint` they are a
heterogeneous component of their own.
"""
from __future__ import annotations

from dataclasses import dataclass

from yatt_hpc.config.placement import GroupPlacement, TrainerPlacement
from yatt_hpc.config.schema import RunConfig

GROUPS = ("trainer", "rollout", "genrm", "tools")
ENGINE_GROUPS = ("rollout", "genrm")


class PlanError(ValueError):
    """An impossible layout; the message names the field, the value and the fix."""


@dataclass(frozen=True)
class SlurmShape:
    """How Slurm provides a group: its own het-job component, or a step component in one allocation."""

    kind: str  # "het_component" | "shared_allocation"
    component: int  # het-group index (disjoint) or MPMD component index (shared)

    def describe(self) -> str:
        if self.kind == "het_component":
            return f"het group {self.component}"
        return f"shared nodes, step comp. {self.component}"


@dataclass(frozen=True)
class GroupPlan:
    name: str
    nodes: int
    tasks_per_node: int
    devices_per_task: int
    cpus_per_task: int
    mem: str | None
    layout: tuple[tuple[str, int], ...]  # ordered fastest-varying first, e.g. (("tp",2),("cp",1),("dp",4),("pp",1))
    rank_start: int  # first world rank (inclusive)
    slurm: SlurmShape
    ep: int = 1  # the trainer's expert parallelism: a MoE model's experts split over ep consecutive dp ranks

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def rank_stop(self) -> int:
        return self.rank_start + self.tasks

    @property
    def devices(self) -> int:
        return self.tasks * self.devices_per_task

    def size(self, dim: str) -> int:
        return dict(self.layout)[dim]

    def coords(self, group_rank: int) -> dict[str, int]:
        """Layout coordinates of a rank inside this group (first layout dim varies fastest)."""
        assert 0 <= group_rank < self.tasks, (group_rank, self.tasks)
        out, rest = {}, group_rank
        for dim, size in self._rank_dims():
            out[dim] = rest % size
            rest //= size
        return out

    def _rank_dims(self) -> tuple[tuple[str, int], ...]:
        # engine replicas own their tp*pp devices inside one rank (tool ranks own none): only dp spans ranks
        return self.layout if self.name == "trainer" else (("dp", self.size("dp")),)


@dataclass(frozen=True)
class Plan:
    mode: str
    groups: tuple[GroupPlan, ...]
    dynamic_split: bool = False  # rollout + genrm ranks are one engine pool, re-split every step
    node_cpus: int | None = None  # colocate: the cores of a node its ranks take in turn (else None)
    host_memory_in_turns: bool = True  # placement.host_memory: a phase's freed host memory goes back when it ends

    def phase_threads(self, group: str) -> tuple[int, int]:
        """(idle, active) torch threads of a rank of `group`: active while its phase holds the devices.

        Full colocation gives the phase the node's cores (`placement.node_cpus`), split over the group's
        ranks on the node; every other placement keeps `cpus_per_task` throughout.
        """
        g = self.group(group)
        if self.node_cpus is None:
            return g.cpus_per_task, g.cpus_per_task
        return g.cpus_per_task, max(g.cpus_per_task, self.node_cpus // g.tasks_per_node)

    @property
    def pool_ranks(self) -> range:
        """World ranks of the engine pool of a dynamic split: the rollout group, then the GenRM group."""
        return range(self.group("rollout").rank_start, self.group("genrm").rank_stop)

    @property
    def world_size(self) -> int:
        return sum(g.tasks for g in self.groups)

    @property
    def total_nodes(self) -> int:
        if self.mode == "disjoint":
            return sum(g.nodes for g in self.groups)
        return max(g.nodes for g in self.groups)

    @property
    def total_devices(self) -> int:
        if self.mode == "disjoint":
            return sum(g.devices for g in self.groups)
        return max(g.devices for g in self.groups) if self.mode == "colocate" else self.group("trainer").devices

    def device_ids(self, world_rank: int) -> tuple[int, ...]:
        """The node-local GPU indices world rank `world_rank` drives (empty on CPU).

        Ranks of a group sit `tasks_per_node` per node in rank order (see `launch.commands.rank_hosts`);
        local rank l takes devices [l*d, (l+1)*d) of its node, d = devices_per_task, counted from the
        group's first device on the node: 0 for the trainer, for colocate (every group takes all the
        devices in turn) and for disjoint (own nodes); in partial mode GenRM's devices follow rollout's.
        The indices are into the node's visible devices (Slurm's `--gpus-per-node` lists all of them
        for every task), so an engine's base GPU id or the trainer's `torch.cuda.set_device` takes them.
        """
        g = self.group(self.group_of(world_rank))
        if not g.devices_per_task:
            return ()
        local = (world_rank - g.rank_start) % g.tasks_per_node
        first = 0
        if self.mode == "partial" and g.name == "genrm":
            rollout = self.group("rollout")
            first = rollout.tasks_per_node * rollout.devices_per_task
        start = first + local * g.devices_per_task
        return tuple(range(start, start + g.devices_per_task))

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def has_group(self, name: str) -> bool:
        return any(g.name == name for g in self.groups)

    @property
    def tool_ranks(self) -> range:
        """World ranks of the tools group (empty without one: the rollout ranks run their tool calls)."""
        if not self.has_group("tools"):
            return range(0)
        g = self.group("tools")
        return range(g.rank_start, g.rank_stop)

    def group_of(self, world_rank: int) -> str:
        for g in self.groups:
            if g.rank_start <= world_rank < g.rank_stop:
                return g.name
        raise PlanError(f"world rank {world_rank} is outside the plan's {self.world_size} ranks; "
                        f"launch exactly {self.world_size} ranks")


def plan(cfg: RunConfig) -> Plan:
    """Lay out trainer, rollout, GenRM (and tool) ranks for `cfg.placement`; raise PlanError if impossible."""
    pc = cfg.placement
    sections = {"trainer": pc.trainer, "rollout": pc.rollout, "genrm": pc.genrm}
    layouts = {"trainer": _trainer_layout(pc.trainer)}
    for name in ENGINE_GROUPS:
        layouts[name] = _engine_layout(name, sections[name])
    _check_shared_nodes(pc.mode, sections)
    _check_tools(cfg)
    _check_dynamic_split(cfg)
    _check_batch(cfg, layouts["trainer"])
    kind = "het_component" if pc.mode == "disjoint" else "shared_allocation"
    groups, start = [], 0
    for index, name in enumerate(GROUPS[:3]):
        gp = sections[name]
        groups.append(GroupPlan(name, gp.nodes, gp.tasks_per_node, gp.devices_per_task, gp.cpus_per_task,
                                gp.mem, layouts[name], start, SlurmShape(kind, index),
                                ep=gp.ep if name == "trainer" else 1))
        start += gp.nodes * gp.tasks_per_node
    node_cpus = _node_cpus(pc, groups)  # the groups that take the devices in turn: tool ranks run no torch
    if pc.host_memory == "kept" and pc.mode != "colocate" and not pc.dynamic_split.enabled:
        raise PlanError(f"placement.host_memory=kept is set but placement.mode={pc.mode} without a dynamic split: "
                        "its ranks never hand memory to one another, so every rank keeps its memory already; remove "
                        "placement.host_memory or set placement.mode=colocate")
    tools = pc.tools
    if tools.enabled:  # after GenRM: no rank of the three groups moves, whatever the tools group's size
        groups.append(GroupPlan("tools", tools.nodes, tools.tasks_per_node, 0, tools.cpus_per_task, tools.mem,
                                (("dp", tools.nodes * tools.tasks_per_node),), start, SlurmShape(kind, len(groups))))
    out = Plan(pc.mode, tuple(groups), dynamic_split=pc.dynamic_split.enabled, node_cpus=node_cpus,
               host_memory_in_turns=pc.host_memory == "in_turns")
    from yatt_hpc.placement.weight_transport import weight_pairs  # it builds on this module

    weight_pairs(out, cfg.rollout.weight_transport, cfg.rollout.engine)  # refuses a transport that cannot work
    return out


def _node_cpus(pc, groups: list[GroupPlan]) -> int | None:
    if pc.mode != "colocate":
        if pc.node_cpus is not None:
            raise PlanError(f"placement.node_cpus={pc.node_cpus} is set but placement.mode={pc.mode}: only full "
                            "colocation hands a node's cores from phase to phase (partial and disjoint give each "
                            "group its own cpus_per_task); remove placement.node_cpus or set placement.mode=colocate")
        return None
    return pc.node_cpus or max(g.tasks_per_node * g.cpus_per_task for g in groups)


def _trainer_layout(gp: TrainerPlacement) -> tuple[tuple[str, int], ...]:
    f = "placement.trainer"
    ranks = gp.nodes * gp.tasks_per_node
    if gp.devices_per_task > 1:
        raise PlanError(f"{f}.devices_per_task={gp.devices_per_task}: a Megatron rank drives exactly one device; "
                        f"set {f}.devices_per_task=1 and {f}.tasks_per_node to the GPUs per node")
    if gp.cp != 1:
        raise PlanError(f"{f}.cp={gp.cp}: Megatron-Core's context parallelism needs Transformer Engine's attention, "
                        "and the trainer builds Megatron's local (Transformer-Engine-free) layers; set "
                        f"{f}.cp=1 (docs/scale.md)")
    model_par = gp.tp * gp.cp * gp.pp
    if ranks % model_par:
        raise PlanError(f"{f}: tp*cp*pp = {gp.tp}*{gp.cp}*{gp.pp} = {model_par} does not divide the group's "
                        f"{ranks} ranks (nodes={gp.nodes} x tasks_per_node={gp.tasks_per_node}); "
                        f"make {f}.tasks_per_node*nodes a multiple of {model_par} or lower tp/cp/pp")
    if gp.devices_per_task and gp.tasks_per_node % gp.tp:
        raise PlanError(f"{f}.tp={gp.tp} does not divide {f}.tasks_per_node={gp.tasks_per_node} (devices per node); "
                        "tensor parallelism must stay inside a node: pick tp from the divisors of tasks_per_node")
    dp = ranks // model_par
    if gp.dp is not None and gp.dp != dp:
        raise PlanError(f"{f}.dp={gp.dp} but {ranks} ranks / (tp*cp*pp={model_par}) gives dp={dp}; "
                        f"set {f}.dp={dp} (or null to derive it) or change nodes/tasks_per_node")
    _check_expert_parallel(gp, dp)
    return (("tp", gp.tp), ("cp", gp.cp), ("dp", dp), ("pp", gp.pp))


def _check_expert_parallel(gp: TrainerPlacement, dp: int) -> None:
    """Megatron-Core 0.16 builds expert groups of (expert tp = tp) x ep x pp ranks and needs the world to divide
    into them (parallel_state.initialize_model_parallel): with cp = 1, ep must divide dp."""
    f = "placement.trainer.ep"
    if gp.ep == 1:
        return
    if dp % gp.ep:
        raise PlanError(f"{f}={gp.ep} does not divide dp={dp}: Megatron-Core's expert groups need world = tp*ep*pp x "
                        f"(expert data parallel); pick ep from the divisors of {dp}")


def _engine_layout(name: str, gp: GroupPlacement) -> tuple[tuple[str, int], ...]:
    f = f"placement.{name}"
    if gp.cp != 1:
        raise PlanError(f"{f}.cp={gp.cp}: context parallelism is a trainer feature; set {f}.cp=1")
    if gp.pp != 1:
        raise PlanError(f"{f}.pp={gp.pp}: pipeline-parallel engine replicas are not implemented (the engines are "
                        f"built with tp only); set {f}.pp=1 and give a replica tp devices")
    per_replica = gp.tp * gp.pp
    if gp.devices_per_task == 0 and per_replica != 1:
        raise PlanError(f"{f}: tp*pp={per_replica} needs GPUs but devices_per_task=0 (CPU engines are tp=pp=1); "
                        f"set {f}.devices_per_task={per_replica} or {f}.tp=1 and {f}.pp=1")
    if gp.devices_per_task and gp.devices_per_task % per_replica:
        raise PlanError(f"{f}: tp*pp = {gp.tp}*{gp.pp} = {per_replica} does not divide devices_per_task="
                        f"{gp.devices_per_task} (the devices of one engine replica); set {f}.devices_per_task "
                        f"to a multiple of {per_replica}")
    replicas = gp.nodes * gp.tasks_per_node
    if gp.dp is not None and gp.dp != replicas:
        raise PlanError(f"{f}.dp={gp.dp} but the group has {replicas} ranks (one per engine replica); "
                        f"set {f}.dp={replicas} (or null) or change nodes/tasks_per_node")
    return (("tp", gp.tp), ("pp", gp.pp), ("dp", replicas))


def _check_shared_nodes(mode: str, sections: dict[str, GroupPlacement]) -> None:
    if mode == "disjoint":
        return
    nodes = {name: gp.nodes for name, gp in sections.items()}
    if len(set(nodes.values())) != 1:
        raise PlanError(f"placement.mode={mode} puts all groups on the same nodes, but nodes differ "
                        f"({', '.join(f'{k}={v}' for k, v in nodes.items())}); give every group the same "
                        "placement.<group>.nodes, or use placement.mode=disjoint")
    dev = {name: gp.tasks_per_node * gp.devices_per_task for name, gp in sections.items()}
    if mode == "colocate" and len(set(dev.values())) != 1:
        raise PlanError("placement.mode=colocate: every group takes all devices of a node in turn, but devices "
                        f"per node differ ({', '.join(f'{k}={v}' for k, v in dev.items())}); make "
                        "tasks_per_node*devices_per_task equal for trainer, rollout and genrm")
    if mode == "partial" and dev["rollout"] + dev["genrm"] != dev["trainer"]:
        raise PlanError("placement.mode=partial: rollout and GenRM split the trainer's devices, but "
                        f"rollout {dev['rollout']} + genrm {dev['genrm']} != trainer {dev['trainer']} devices per "
                        "node; adjust placement.rollout/genrm tasks_per_node or devices_per_task")


def _check_tools(cfg: RunConfig) -> None:
    """A tools group shares the other groups' nodes unless placement is disjoint (that it has tools to run and
    no dynamic split is the config's check: `config/agent.py`)."""
    pc, f = cfg.placement, "placement.tools"
    if not pc.tools.enabled:
        return
    if pc.mode != "disjoint" and pc.tools.nodes != pc.trainer.nodes:
        raise PlanError(f"placement.mode={pc.mode} puts every group on the same nodes, but {f}.nodes={pc.tools.nodes} "
                        f"and placement.trainer.nodes={pc.trainer.nodes}; set {f}.nodes={pc.trainer.nodes}, or use "
                        "placement.mode=disjoint to give the tools group nodes of its own")


def _check_dynamic_split(cfg: RunConfig) -> None:
    pc, f = cfg.placement, "placement.dynamic_split"
    if not pc.dynamic_split.enabled:
        return
    if pc.mode != "partial":
        raise PlanError(f"{f}.enabled=true needs placement.mode=partial (rollout and GenRM sharing the devices), "
                        f"got placement.mode={pc.mode}; set placement.mode=partial or {f}.enabled=false")
    # any pool rank may serve either role: both must be the same kind of engine replica
    for key in ("devices_per_task", "tp", "pp", "cpus_per_task"):
        r, g = getattr(pc.rollout, key), getattr(pc.genrm, key)
        if r != g:
            raise PlanError(f"{f}: a pool rank serves rollout or GenRM, so both need the same replica shape, but "
                            f"placement.rollout.{key}={r} != placement.genrm.{key}={g}; set both to the same value "
                            f"or {f}.enabled=false")
    low = pc.dynamic_split.min_replicas
    for name in ("rollout", "genrm"):
        tasks = getattr(pc, name).nodes * getattr(pc, name).tasks_per_node
        if tasks < low:
            raise PlanError(f"{f}.min_replicas={low} but placement.{name} starts with {tasks} replicas (the first "
                            f"step's split); set placement.{name}.tasks_per_node to at least {low} or lower "
                            f"{f}.min_replicas")


def _check_batch(cfg: RunConfig, trainer_layout: tuple[tuple[str, int], ...]) -> None:
    dp = dict(trainer_layout)["dp"]
    if cfg.train.prompts_per_step % dp:
        fixed = max(dp, round(cfg.train.prompts_per_step / dp) * dp)
        raise PlanError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the trainer's "
                        f"dp={dp} (each data-parallel rank owns an equal share of prompts); "
                        f"set train.prompts_per_step={fixed}")
