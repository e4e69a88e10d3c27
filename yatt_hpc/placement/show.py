"""Print a plan as a rich table plus the exact launch lines (`yatt-hpc plan`)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from yatt_hpc.config.placement import split_problem, stage_layers
from yatt_hpc.config.schema import RunConfig
from yatt_hpc.launch.commands import local_launch, render, srun_launch
from yatt_hpc.placement.plan import Plan
from yatt_hpc.placement.weight_transport import weight_pairs


def layout_text(layout: tuple[tuple[str, int], ...]) -> str:
    return " ".join(f"{dim}{size}" for dim, size in layout)


def node_gpus_text(p: Plan, group: str) -> str:
    """The GPUs of one node each local rank of `group` drives (`Plan.device_ids`), e.g. `0-1 2-3`."""
    g = p.group(group)
    if not g.devices_per_task:
        return "-"
    ids = [p.device_ids(r) for r in range(g.rank_start, g.rank_start + g.tasks_per_node)]
    return " ".join(str(d[0]) if len(d) == 1 else f"{d[0]}-{d[-1]}" for d in ids)


def plan_table(p: Plan) -> Table:
    table = Table(title=f"placement: {p.mode}  ({p.world_size} ranks, {p.total_nodes} nodes, "
                        f"{p.total_devices} devices)")
    for col in ("group", "ranks", "nodes", "tasks/node", "gpus/task", "cpus/task", "layout", "node gpus", "slurm"):
        table.add_column(col, justify="left" if col in ("group", "layout", "node gpus", "slurm") else "right")
    for g in p.groups:
        table.add_row(g.name, f"{g.rank_start}-{g.rank_stop - 1}", str(g.nodes), str(g.tasks_per_node),
                      str(g.devices_per_task) if g.devices_per_task else "cpu", str(g.cpus_per_task),
                      layout_text(g.layout) + (f" ep{g.ep}" if g.ep > 1 else ""), node_gpus_text(p, g.name), g.slurm.describe())
    return table


def what_runs(cfg: RunConfig) -> list[str]:
    """The model, precision, engines and sampling the ranks will build, in words."""
    m, r = cfg.model, cfg.rollout
    precision = "bfloat16 parameters, fp32 master weights and AdamW state" if m.dtype == "bfloat16" else m.dtype
    judge = "off (reward.mode=rule_only)" if cfg.reward.mode == "rule_only" else \
        f"{r.engine} engine, {cfg.reward.judge_dtype or m.dtype}"
    lines = [f"trainer: Megatron-Core from {m.path} (arch {m.arch}), {precision}",
             f"rollout: {r.engine} engine, {m.dtype}, weights synced in {m.dtype}; sampling temperature "
             f"{r.temperature:g} (the trainer scores at the same temperature), top_p {r.top_p:g}",
             f"genrm: {judge}"]
    a = cfg.agent
    if a.enabled:
        names = ", ".join(t.name or t.function for t in a.tools) or "none"
        env = f", environment {a.environment}" if a.environment else ""
        pt = cfg.placement.tools
        where = (f"calls run on the tools group's {pt.nodes * pt.tasks_per_node} rank(s), {a.tool_workers} threads each "
                 "(the rollout ranks run none)" if pt.enabled else
                 f"calls run in {a.tool_workers} threads on each rollout rank (no tools group)")
        lines.append(f"agent: up to {a.max_turns} model turns in {a.max_response_tokens} response tokens; tools {names}{env}; "
                     + where)
    if r.max_staleness:
        s = r.max_staleness
        old = "the trainer's recomputed log-probs" if cfg.train.off_policy.proximal == "recompute" else \
            "the engine's log-probs (train.off_policy.proximal=recompute takes the trainer's)"
        lines.append(f"asynchronous (rollout.max_staleness={s}): step t's wave generates step t+{s}'s batch while "
                     f"the trainer trains on step t's, generated {s} update(s) earlier; the ratio against {old}")
    return lines


def trainer_state_text(p: Plan, cfg: RunConfig) -> str:
    """What each trainer rank holds per parameter P of the model, with the layout and train.shard_optimizer:
    its tensor shard of its pipeline stage, 1/(tp*pp) of the model."""
    g = p.group("trainer")
    tp, dp, pp = g.size("tp"), g.size("dp"), g.size("pp")
    mp = tp * pp
    bf16 = cfg.model.dtype == "bfloat16"
    weights, optim = (2, 12) if bf16 else (4, 8)  # bf16: 2-byte weights and grads; fp32 masters + 2 moments
    what = "fp32 masters and AdamW moments" if bf16 else "AdamW moments"
    if cfg.train.shard_optimizer and dp > 1:
        held = f"{what} {optim}P/{mp * dp} (sharded over dp={dp}: train.shard_optimizer)"
    else:
        held = f"{what} {optim}P/{mp}" + (f" (the same on each of dp={dp}; train.shard_optimizer=true splits them)"
                                           if dp > 1 else "")
    ref = f", reference {weights}P/{mp}" if cfg.train.kl_coef > 0 else ""
    grads = f"gradients {weights}P/{mp}" + (f" (fp32 for the update: 4P/{mp})" if bf16 else "")
    experts = (f"; a MoE model's routed experts 1/{g.ep} of each (placement.trainer.ep={g.ep}: each rank holds its "
               "share)") if g.ep > 1 else ""
    return f"trainer rank state (bytes, P = parameters): weights {weights}P/{mp}, {grads}{ref}, {held}{experts}"


def critic_text(p: Plan, cfg: RunConfig) -> str | None:
    """The value model each trainer rank holds with `train.adv_estimator: gae` (None without a critic): Pc its
    parameters (the policy's P when it starts from model.path), in the policy's layout and dtype."""
    if cfg.train.adv_estimator != "gae":
        return None
    g = p.group("trainer")
    mp, dp = g.size("tp") * g.size("pp"), g.size("dp")
    bf16 = cfg.model.dtype == "bfloat16"
    weights, optim = (2, 12) if bf16 else (4, 8)
    shard = cfg.train.shard_optimizer and dp > 1
    source = f"train.critic.path={cfg.train.critic.path}" if cfg.train.critic.path else "model.path (Pc = P)"
    turns = ("; it takes the devices in turn with the policy (resumed for the values before the policy's update, "
             "again for its own update after it, released in between)" if p.mode == "colocate" else "")
    return (f"critic (train.adv_estimator=gae) on every trainer rank, from {source}: weights {weights}Pc/{mp}, "
            f"gradients {weights}Pc/{mp}, AdamW {optim}Pc/{mp * dp if shard else mp}"
            f"{' (sharded over dp)' if shard else ''}; one scalar head of hidden + 1 parameters{turns}")


def pipeline_text(p: Plan, split: tuple[int, int] | None = None, num_layers: int | None = None) -> str | None:
    """The trainer's pipeline stages and what each holds (None without pipeline parallelism): its ranks, and with
    the policy's `num_layers` known its layers (`stage_layers`, split as `placement.trainer.pp_layers` says)."""
    g = p.group("trainer")
    pp, stride = g.size("pp"), g.size("tp") * g.size("cp") * g.size("dp")
    if pp == 1:
        return None
    problem = None if num_layers is None else split_problem(num_layers, pp, split)
    known = num_layers is not None and problem is None

    def held(s: int) -> str:
        layers = stage_layers(s, pp, num_layers, split) if known else None
        return "" if layers is None else f" with layers {layers.start}-{layers.stop - 1}"

    ranks = ", ".join(f"{s}: trainer ranks {s * stride}-{(s + 1) * stride - 1}{held(s)}" for s in range(pp))
    shares = f"of 1/{pp} of the layers each" if split is None else \
        f"of uneven layers (placement.trainer.pp_layers: {split[0]} on the first, {split[1]} on the last, the rest " \
        "evenly between)"
    refused = f"; refused at start: {problem}" if problem else ""
    return (f"pipeline: pp={pp} stages {shares} ({ranks}{refused}); stage 0 also holds the embeddings, "
            f"stage {pp - 1} the final norm and the head; Megatron's 1F1B schedule keeps up to pp-s micro-batches' "
            f"activations on stage s; each stage's tp-rank-0 of a replica sends its own layers to the engines")


def weight_sync_text(p: Plan, cfg: RunConfig) -> str:
    """How many engines take their weights by which transport (`placement/weight_transport.py`)."""
    by: dict[str, list[int]] = {}
    for pair in weight_pairs(p, cfg.rollout.weight_transport, cfg.rollout.engine).values():
        by.setdefault(pair.transport, []).append(pair.dest)
    parts = [f"{t} to {len(ranks)} engine{'s' if len(ranks) > 1 else ''}"
             + (f" (ranks {', '.join(map(str, ranks))})" if len(by) > 1 and len(ranks) <= 4 else "")
             for t, ranks in sorted(by.items())]
    return f"weight sync (rollout.weight_transport={cfg.rollout.weight_transport}): {'; '.join(parts)}"


def print_plan(p: Plan, run_dir: str, console: Console, python: str = "python3", cfg: RunConfig | None = None,
               num_layers: int | None = None) -> None:
    """`num_layers`: the policy's transformer layers, when its config.json could be read (each stage's share shown)."""
    console.print(plan_table(p))
    console.print("leader (decisions only): world rank 0 = trainer rank 0")
    lines = [*what_runs(cfg), trainer_state_text(p, cfg), critic_text(p, cfg),
             pipeline_text(p, cfg.placement.trainer.pp_layers, num_layers), weight_sync_text(p, cfg)] \
        if cfg is not None else []
    for line in filter(None, lines):
        console.print(line, markup=False, highlight=False)
    if p.node_cpus is not None:
        threads = ", ".join(f"{g.name} {p.phase_threads(g.name)[1]}" for g in p.groups if g.name != "tools")
        console.print(f"colocated phases take turns on {p.node_cpus} CPU cores per node (placement.node_cpus): "
                      f"threads per rank in its phase {threads}", markup=False, highlight=False)
    if p.mode == "colocate" or p.dynamic_split:
        held = "in turns: what a phase frees goes back to the kernel when it ends" if p.host_memory_in_turns else \
            "kept: every rank keeps its working set, the node holds them all at once"
        console.print(f"host memory {held} (placement.host_memory)", markup=False, highlight=False)
    if p.dynamic_split:
        pool, first = p.pool_ranks, p.group("rollout").tasks
        console.print(f"dynamic split: ranks {pool.start}-{pool.stop - 1} are one engine pool, re-split by load every "
                      f"step (step 1: {first} rollout, {len(pool) - first} GenRM)")
    console.print("\nlocal launch (yatt-hpc run, no Slurm):")
    console.print(render(local_launch(p, run_dir, python=python)), markup=False, highlight=False, soft_wrap=True)
    console.print("\nSlurm launch (inside the allocation):")
    console.print(render(srun_launch(p, run_dir, python=python)), markup=False, highlight=False, soft_wrap=True)
