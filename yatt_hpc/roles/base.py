"""What the step loop asks of every group's controller, with the defaults a stateless group needs.

    class RolloutController(BaseController): ...   # override step(), identity, and what differs

A controller runs its group's part of a step and says what of it survives a restart. Rollout and
GenRM ranks only keep their RNG; the trainer overrides the checkpoint hooks with its weights,
optimizer and data position.

`light_state` is the part of a checkpoint that changes early in a step (RNG, data position): the
loop copies it at every step start, so that the stop watchdog can still save the step that just
ended while the next one runs (`stop_watchdog.py`). Whatever changes later (the trainer's
parameters and optimizer state) must be announced with `guard.enter_mutation()` (`watch_mutations`).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

from yatt_hpc.ckpt import RngOnlyState
from yatt_hpc.errors import InputError


def prompt_tools(cfg) -> list[dict] | None:
    """The agent's tool schemas for the prompts' chat template (`tools=`); None without agent tools. Imports the
    functions `agent.tools` names (only then)."""
    if not cfg.agent.tools:
        return None
    from yatt_hpc.agent.tools import tool_schemas

    return tool_schemas(cfg.agent)


def group_rendezvous(world) -> tuple[str, int]:
    """Rank 0 of the group picks a torch.distributed address (this host, a free port); every rank learns it."""
    found = None
    if world.group_rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = "127.0.0.1"
        found = (addr, port)
    return world.group_comm.bcast(found, root=0)


def rank_device(world) -> str:
    """The torch device this rank's model lives on: `cpu`, or `cuda:<first of plan.device_ids>` (an engine
    replica of tp devices takes the consecutive ones after it: SGLang's base GPU id)."""
    ids = world.plan.device_ids(world.rank)
    if not ids:
        return "cpu"
    import torch

    visible = torch.cuda.device_count()
    if ids[-1] >= visible:
        raise InputError(f"{world.group} rank (world rank {world.rank}) is planned on GPUs {list(ids)} of its node, "
                         f"but this process sees {visible}; give the job all GPUs of each node "
                         f"(--gpus-per-node), or lower placement.{world.group}.tasks_per_node/devices_per_task")
    return f"cuda:{ids[0]}"


def engine_options(world, cfg) -> dict:
    """Constructor options of this rank's engines beyond model, device, tp and seed.

    SGLang reserves `mem_fraction_static` of the device when it starts. In colocate mode (and in a
    dynamic split, whose pool ranks hold a policy engine and a judge) two engines start on the same
    devices at once, so each takes half of the default 0.8; the trainer has released its memory by then.
    """
    opts: dict = {"dtype": cfg.model.dtype}
    if cfg.rollout.engine == "sglang":
        shared = (world.plan.mode == "colocate" or world.plan.dynamic_split) and cfg.reward.mode != "rule_only"
        opts["mem_fraction_static"] = 0.4 if shared else 0.8
    return opts


def rollout_engine_options(world, cfg) -> dict:
    """`engine_options` of a rollout engine, plus `rollout.max_batch_size` in the engine's own terms and the
    recording of its routing (`train.moe_routing_replay`)."""
    opts = engine_options(world, cfg)
    if cfg.train.moe_routing_replay:  # the policy's engine records its routing (hf: its hooks, sglang: its capturer)
        opts["record_routing"] = True
    size = cfg.rollout.max_batch_size
    if size is not None:
        opts["max_batch_size" if cfg.rollout.engine == "hf" else "max_running_requests"] = size
    return opts


@dataclass(frozen=True)
class Round:
    """What the waves being run generate: the training step's groups or validation's."""

    n: int
    """Samples per prompt."""
    temperature: float
    """The engines' sampling temperature (0: greedy)."""
    evaluation: bool = False


def training_round(cfg) -> Round:
    return Round(cfg.rollout.samples_per_prompt, cfg.rollout.temperature)


def eval_round(cfg) -> Round:
    temperature = cfg.eval.temperature if cfg.eval.temperature is not None else cfg.rollout.temperature
    return Round(cfg.eval.samples_per_prompt, temperature, evaluation=True)


def eval_due(cfg, after_step: int) -> bool:
    """Whether validation runs once `after_step` steps are done (0: before the first step): before training
    with `eval.before_train`, after every `eval.every`-th step and after the last one."""
    ec = cfg.eval
    if not ec.sources:
        return False
    if after_step == 0:
        return ec.before_train
    return ec.every > 0 and (after_step % ec.every == 0 or after_step == cfg.train.steps)


class BaseController(RngOnlyState):
    shard: dict[str, int] = {}
    routes = None  # this step's Routes; every controller sets its own in __init__

    def set_routes(self, routes) -> None:
        """Take the routes of the coming step (a dynamic split changes them between steps)."""
        self.routes = routes

    @property
    def identity(self) -> str:
        raise NotImplementedError

    def step(self, step: int) -> None:
        raise NotImplementedError

    def evaluate(self, step: int) -> dict | None:
        """This rank's part of a validation round after `step` steps; the leader returns its metrics."""
        raise NotImplementedError

    def load_weights(self, loaded) -> None:
        """`checkpoint.load_from` weights; only the trainer has any."""

    def after_resume(self, step: int) -> None:
        """Re-establish cross-group state after a restore (e.g. rollout weights)."""

    def rewind_logs(self, step: int) -> None:
        """Forget per-step logs past `step`."""

    def close(self) -> None:
        """Free engines and their child processes at the end of the run (the worker calls it once)."""
