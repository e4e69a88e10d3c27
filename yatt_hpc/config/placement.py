"""The `placement:` section of a run's config: where the trainer, rollout, GenRM and tools groups run, in what shape.

    from yatt_hpc.config import load_config
    cfg = load_config("configs/demo_cpu.yaml", overrides=["placement.mode=partial", "placement.rollout.tasks_per_node=2"])
    cfg.placement.mode, cfg.placement.rollout.tasks_per_node

Part of the typed configuration (`yatt_hpc.config.schema` imports it into `RunConfig`). The fields say
what was asked for; the ranks, layouts and device lists that follow from them are derived by the
placement plan (`yatt_hpc.placement.plan`), which also refuses a shape it cannot lay out.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from yatt_hpc.config.section import Section


class GroupPlacement(Section):
    """Shape of one group (trainer, rollout or genrm) on the cluster."""

    nodes: int = Field(1, ge=1)
    """Nodes the group spans. In colocate/partial modes every group must use the same nodes."""
    tasks_per_node: int = Field(1, ge=1)
    """MPI ranks of this group per node. Trainer: one per device; rollout/GenRM: one per engine replica."""
    devices_per_task: int = Field(0, ge=0)
    """GPUs per rank; 0 runs on CPU. Trainer ranks use 1; an engine replica uses tp*pp."""
    cpus_per_task: int = Field(1, ge=1)
    """CPU cores Slurm reserves for each rank."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel size."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size. Trainer: stages of an equal share of the layers each, or as
    `placement.trainer.pp_layers` says (Megatron's 1F1B schedule, docs/scale.md); rollout and GenRM: must stay 1."""
    cp: int = Field(1, ge=1)
    """Context-parallel size (trainer only; must stay 1 for rollout and GenRM)."""
    dp: int | None = Field(None, ge=1)
    """Data-parallel size; null derives it from the rank count. If set it must match the rank count."""
    mem: str | None = None
    """Memory per node for Slurm (e.g. `64G`); null leaves Slurm's default."""


class TrainerPlacement(GroupPlacement):
    """Trainer group: Megatron ranks laid out tp-cp-dp-pp."""

    ep: int = Field(1, ge=1)
    """Expert-parallel size for a mixture-of-experts policy: each rank holds 1/ep of every layer's experts
    (each expert split over tp as a dense MLP is). Megatron-Core requires ep to divide dp (its expert tensor
    parallelism stays tp). Only 1 runs today: the planner checks a larger ep against the layout, then refuses it
    (docs/moe.md)."""
    pp_layers: tuple[int, int] | None = None
    """Uneven pipeline stages: the transformer layers of the first and of the last stage, `[first, last]`; the
    stages between split the rest evenly (Megatron's ``num_layers_in_first_pipeline_stage`` and
    ``num_layers_in_last_pipeline_stage``). E.g. `[10, 8]` for 28 layers on pp=3 (10 + 10 + 8), or a last stage
    with fewer layers beside a large vocabulary head. null: every stage holds layers/pp. Needs pp > 1; the
    policy's layer count is checked against it when the run starts."""

    @model_validator(mode="after")
    def _stage_split(self) -> TrainerPlacement:
        if self.pp_layers is None:
            return self
        if self.pp == 1:
            raise ValueError(f"placement.trainer.pp_layers={list(self.pp_layers)} splits pipeline stages, but "
                             "placement.trainer.pp=1 has one stage; set placement.trainer.pp > 1, or drop "
                             "placement.trainer.pp_layers")
        if min(self.pp_layers) < 1:
            raise ValueError(f"placement.trainer.pp_layers={list(self.pp_layers)}: every pipeline stage holds at "
                             "least one transformer layer; give the first and last stage 1 or more each")
        return self


def stage_layers(index: int, count: int, num_layers: int, split: tuple[int, int] | None = None) -> range:
    """The global transformer layers pipeline stage `index` of `count` holds: layers/count each, or with `split`
    (`placement.trainer.pp_layers`) split[0] on the first stage, split[1] on the last and the rest evenly between
    (Megatron-Core's ``get_num_layers_to_build`` and ``get_transformer_layer_offset``). ValueError naming the
    field and the fix when the layers do not split so (`split_problem`)."""
    problem = split_problem(num_layers, count, split)
    if problem:
        raise ValueError(problem)
    if split is None or count == 1:
        per = num_layers // count
        return range(index * per, (index + 1) * per)
    first, last = split
    middle = (num_layers - first - last) // (count - 2) if count > 2 else 0
    if index == count - 1:
        return range(num_layers - last, num_layers)
    start = 0 if index == 0 else first + (index - 1) * middle
    return range(start, first if index == 0 else start + middle)


def split_problem(num_layers: int, count: int, split: tuple[int, int] | None = None) -> str | None:
    """Why `num_layers` layers do not split into `count` pipeline stages as `split` asks (None: they do)."""
    if split is None or count == 1:
        if num_layers % count == 0:
            return None
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        return (f"placement.trainer.pp={count} does not divide the policy's {num_layers} transformer layers: each "
                f"pipeline stage holds the same number; set placement.trainer.pp to one of {divisors}, or give the "
                "first and last stage their own counts with placement.trainer.pp_layers")
    first, last = split
    rest, middle = num_layers - first - last, count - 2
    named = f"placement.trainer.pp_layers={list(split)} with placement.trainer.pp={count} and {num_layers} layers"
    if middle == 0 and rest != 0:
        return (f"{named}: two stages hold {first} + {last} = {first + last} layers, not {num_layers}; give them "
                f"counts that add up to {num_layers}")
    if middle and (rest < middle or rest % middle):
        return (f"{named}: the {middle} middle stage(s) get the other {rest} layers, which do not split evenly into "
                f"{middle} stage(s) of at least one; choose first and last so that {num_layers} - first - last is a "
                f"positive multiple of {middle}")
    return None


class EnginePlacement(GroupPlacement):
    """Rollout or GenRM group: engine replicas laid out tp-pp-dp (one controller rank per replica)."""


class ToolsPlacement(Section):
    """The tools group: CPU ranks that run the agent's tool calls for the rollout ranks (docs/agentic.md)."""

    nodes: int = Field(1, ge=1)
    """Nodes the group spans: its own nodes in `disjoint` (a heterogeneous component without GPUs), the other
    groups' nodes in colocate/partial (then it must equal their `nodes`)."""
    tasks_per_node: int = Field(0, ge=0)
    """Tool ranks per node; 0 (the default) makes no tools group: the calls run in a thread pool on each rollout
    rank. With ranks, every rollout rank sends its tool calls to them over MPI and runs none itself. Needs
    `agent.tools`."""
    cpus_per_task: int = Field(1, ge=1)
    """CPU cores Slurm reserves for each tool rank (its `agent.tool_workers` threads and their sandboxes)."""
    mem: str | None = None
    """Memory per node for Slurm (e.g. `16G`); null leaves Slurm's default."""

    @property
    def enabled(self) -> bool:
        return self.tasks_per_node > 0


class DynamicSplitConfig(Section):
    """`partial` placement: rollout and GenRM ranks form one pool of engine replicas, re-split every step."""

    enabled: bool = False
    """Each pool rank holds a policy engine and a judge and serves the role the step's split gives it
    (the other stays released). The leader picks the split from the busy seconds each role measured;
    the configured rollout/GenRM task counts are the first step's split, and both groups need the same
    replica shape. The split depends on timing, and engine batch composition with it (logprobs agree
    to ~1e-6), so a resumed run is not bitwise identical to an uninterrupted one; the split itself is
    checkpointed and restored exactly."""
    min_replicas: int = Field(1, ge=1)
    """Engine replicas each role keeps at least."""
    hysteresis: float = Field(0.1, ge=0.0, lt=1.0)
    """A new split is taken only if it predicts the busiest replica at least this fraction less busy."""


class PlacementConfig(Section):
    """Where the groups run."""

    mode: Literal["colocate", "partial", "disjoint"] = "colocate"
    """`colocate`: rollout, GenRM and train take the same devices in turn. `partial`: rollout and GenRM
    share the devices and stream to each other, training takes them otherwise. `disjoint`: each group on
    its own nodes (a heterogeneous Slurm job)."""
    trainer: TrainerPlacement = TrainerPlacement(dp=2, tasks_per_node=2)
    """Trainer group shape."""
    rollout: EnginePlacement = EnginePlacement()
    """Rollout group shape."""
    genrm: EnginePlacement = EnginePlacement()
    """GenRM group shape."""
    tools: ToolsPlacement = ToolsPlacement()
    """Tools group shape (`tasks_per_node: 0`, the default: no tools group)."""
    dynamic_split: DynamicSplitConfig = DynamicSplitConfig()
    """Dynamic rollout/GenRM split of the engine pool (`partial` only; off by default)."""
    node_cpus: int | None = Field(None, ge=1)
    """`colocate` only: the CPU cores of a node that its ranks take in turn. While a group's phase holds
    the devices its ranks on the node run node_cpus / tasks_per_node torch threads each (at least their
    cpus_per_task), and go back to cpus_per_task when the phase ends: on CPU the cores are the devices.
    null: the most any one group asks for on the node (tasks_per_node x cpus_per_task), which the phases
    use in turn; the demo's 2 trainer ranks make it 2, so generation and judging take both cores. A
    config value, never read from the machine, because the thread count changes the order of float sums:
    the same config gives the same numbers under mpirun and under Slurm."""
    host_memory: Literal["in_turns", "kept"] = "in_turns"
    """Where phases take the devices in turn (`colocate`, or `partial` with a dynamic split), what a rank does
    with the host memory its phase freed. `in_turns`: it goes back to the kernel when the phase ends (a heap
    holding 256 MiB or more free is trimmed; a CPU `hf` engine frees its weights before each sync), so the
    node's peak is about the largest phase's, and the next phase faults those pages in again. `kept`: every
    rank keeps what it allocated, so the node's peak is the sum of the ranks' working sets and no step faults
    memory in again; faster where the node has the memory (docs/placement.md: at Qwen2.5-0.5B's shape in fp32 on
    2 cores, the step 9% shorter and the peak 2.4 GiB higher). Other placements keep it anyway and refuse
    `kept`."""
