"""How trainer -> engine weight sync travels, per destination: a pure decision from the plan.

    pairs = weight_pairs(plan(cfg), cfg.rollout.weight_transport, cfg.rollout.engine)
    pairs[world_rank].transport      # "mpi" | "collective" | "ipc"; .owner: the trainer rank sending to it

Test it: tests/unit/test_weight_transport.py (every shipped config, the refusals).

A destination is every rank that can ever receive weights: the rollout group, or with a dynamic split
the whole engine pool (any pool rank may generate next step). Its owner never changes: pool position
p takes its weights from trainer replica p mod dp (`sched.routing.Routes.weight_source_for`, whatever
the split), so each (owner, destination) pair is fixed for the run and can hold a process group.

    mpi         GPU -> host -> MPI bytes -> host -> GPU (works everywhere)
    collective  the pair's own process group: broadcast from the owner's device tensors (NCCL on GPU,
                Gloo on CPU); MPI carries only the rendezvous and each bucket's manifest
    ipc         owner and engine share a GPU: the owner sends CUDA IPC handles of its tensors over MPI
                and the engine hands the tensors to SGLang's update_weights_from_tensor

`auto` picks, on GPU with the sglang engine, collective for a destination whose (node, GPUs) do not
overlap its owner's and ipc for one that does; on CPU, with the hf engine, or with a pipelined trainer
(`placement.trainer.pp > 1`: every stage's owner sends its own layers, `Routes.stage_owners`), mpi.
"""
from __future__ import annotations

from dataclasses import dataclass

from yatt_hpc.placement.plan import Plan, PlanError

TRANSPORTS = ("mpi", "collective", "ipc")
FIELD = "rollout.weight_transport"


@dataclass(frozen=True)
class WeightPair:
    dest: int  # world rank of the engine
    owner: int  # world rank of the trainer replica's owner (tp rank 0) that sends to it
    engine_ranks: int  # ranks the engine brings into the pair's group: its tensor-parallel workers
    shared_gpus: tuple[int, ...]  # node-local GPUs both use (empty: apart, or on CPU)
    transport: str


def weight_destinations(plan: Plan) -> list[int]:
    """World ranks that can receive weights: the rollout group, or the engine pool of a dynamic split."""
    if plan.dynamic_split:
        return list(plan.pool_ranks)
    rollout = plan.group("rollout")
    return list(range(rollout.rank_start, rollout.rank_stop))


def weight_owner(plan: Plan, dest: int) -> int:
    """World rank of the trainer owner that sends weights to `dest` (replica (pool position) mod dp)."""
    trainer = plan.group("trainer")
    replica = (dest - plan.group("rollout").rank_start) % trainer.size("dp")
    return trainer.rank_start + replica * trainer.size("tp") * trainer.size("cp")


def rank_node(plan: Plan, rank: int) -> tuple[str, int]:
    """(which nodes, node index) of a world rank: disjoint groups have nodes of their own; in shared
    modes every group spreads over the same nodes, tasks_per_node ranks each (`launch.commands.rank_hosts`)."""
    group = plan.group(plan.group_of(rank))
    index = (rank - group.rank_start) // group.tasks_per_node
    return (group.name if plan.mode == "disjoint" else "shared", index)


def shared_gpus(plan: Plan, a: int, b: int) -> tuple[int, ...]:
    """Node-local GPU indices world ranks `a` and `b` both drive (empty when on other nodes or on CPU)."""
    if rank_node(plan, a) != rank_node(plan, b):
        return ()
    return tuple(sorted(set(plan.device_ids(a)) & set(plan.device_ids(b))))


def weight_pairs(plan: Plan, setting: str, engine: str) -> dict[int, WeightPair]:
    """Every destination's pair and transport; raises PlanError where `setting` cannot work."""
    pairs = {}
    for dest in weight_destinations(plan):
        owner = weight_owner(plan, dest)
        shared = shared_gpus(plan, owner, dest)
        pairs[dest] = WeightPair(dest, owner, plan.group(plan.group_of(dest)).size("tp"), shared,
                                 _transport(plan, setting, engine, owner, dest, shared))
    return pairs


def _transport(plan: Plan, setting: str, engine: str, owner: int, dest: int, shared: tuple[int, ...]) -> str:
    owner_gpu, dest_gpu = bool(plan.device_ids(owner)), bool(plan.device_ids(dest))
    trainer = plan.group("trainer")
    pipelined = trainer.size("pp") > 1 or trainer.ep > 1  # several senders per engine: mpi only
    if setting == "mpi":
        return "mpi"
    if setting == "auto":
        if pipelined or not (owner_gpu and dest_gpu and engine == "sglang"):
            return "mpi"
        return "ipc" if shared else "collective"
    if setting != "collective":
        raise PlanError(f"{FIELD}={setting!r} is not one of auto, mpi, collective; pick one of them")
    where = f"{plan.group_of(dest)} rank {dest}"
    if pipelined:
        raise PlanError(f"{FIELD}=collective with placement.trainer.pp={trainer.size('pp')} ep={trainer.ep}: each "
                        "pipeline stage's owner (and each expert-parallel rank) sends its own layers (experts), and "
                        f"a pair's group has one sender; set {FIELD}=mpi (or auto, which takes mpi then)")
    if owner_gpu != dest_gpu:
        raise PlanError(f"{FIELD}=collective: {where} runs on {'GPU' if dest_gpu else 'CPU'} but its trainer owner "
                        f"(world rank {owner}) on {'GPU' if owner_gpu else 'CPU'}, and one pair's group has one "
                        f"backend (NCCL for GPU tensors, Gloo for CPU ones); set {FIELD}=mpi (or auto), or give "
                        "both groups GPUs (placement.<group>.devices_per_task)")
    if shared:
        node = rank_node(plan, dest)[1]
        raise PlanError(f"{FIELD}=collective: {where} shares GPU(s) {list(shared)} of node {node} with its trainer "
                        f"owner (world rank {owner}), and NCCL cannot hold two ranks of one group on one device; "
                        f"set {FIELD}=auto (CUDA IPC for a pair on one GPU with rollout.engine=sglang, MPI with "
                        f"hf) or {FIELD}=mpi, or give the engines GPUs of their own (placement.mode=disjoint)")
    return "collective"
