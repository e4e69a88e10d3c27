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

from pydantic import Field

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
    """Pipeline-parallel size. Trainer: stages of an equal share of the layers each (Megatron's 1F1B schedule,
    docs/scale.md); rollout and GenRM: must stay 1."""
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
