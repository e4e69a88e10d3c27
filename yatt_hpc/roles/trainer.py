"""The trainer group's controller: one per trainer rank, each the owner of its data shard.

    ctl = TrainerController(world, cfg, run_dir, stats, protocol)
    ctl.step(step)         # the GRPO step, as seen from one trainer rank

Data flow of one step (no driver; every arrow is point-to-point MPI between the ranks involved):

    trainer replica d (tp rank 0 owns the shard)
      | its next ceil(k x ratio) prompts: returned ones first, then positions j*dp + d,
      | n copies each, to rollout rank d mod R (or least-loaded, per group)       TAG_PROMPTS
      | (and to its GenRM rank: groups to keep, samples per rollout rank)         TAG_COUNT
      v
    rollout ranks --- generate whole groups, logprobs --->  GenRM rank (d mod G)   TAG_SAMPLES
         ^                                                  | judge verdict + rule score
         '-- ratio > 1: once k groups are scored: STOP -----|  (each answers END)  TAG_STOP/END
      .-----------------------------------------------------'  the k kept groups   TAG_SCORED
      v
    trainer replica d: dispatched but not kept -> front of its queue (overdispatch.py)
      -> sort by sample id -> broadcast to its TP peers -> advantages (train.adv_estimator)
      -> per mini-batch: Megatron forward/backward, DP all-reduce of grads -> AdamW
      -> gather TP shards -> HF names -> buckets ---------> its rollout ranks    TAG_WEIGHTS
         (by MPI bytes, or by broadcast over the pair's own process group, or as CUDA IPC handles:
          rollout.weight_transport, decided per engine in placement/weight_transport.py)

With dynamic sampling the replica repeats the dispatch/collect round in refill waves until it has
k groups with reward variance (all ranks agree on each extra wave with one polled allreduce).
A replica holds at most its own samples; the leader (world rank 0) is replica 0's owner and holds
exactly that share, nothing more.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from yatt_hpc.batch import SampleBatch, image_columns
from yatt_hpc.ckpt import RankState, capture_rng, restore_rng
from yatt_hpc.ckpt.loader import Shards, pipeline_record, reshard_optimizer, reshard_weights
from yatt_hpc.comm.doorbell import DOORBELL
from yatt_hpc.comm.prompt_routing import build_router
from yatt_hpc.comm.rebalance import Rebalancer
from yatt_hpc.comm.transport import TAG_COUNT, TAG_PROMPTS, TAG_SCORED, bcast_batch, recv_batch, send_batch, wait_all
from yatt_hpc.comm.weight_sync import WeightSender
from yatt_hpc.config.schema import RunConfig
from yatt_hpc.data.consumed import ConsumedLog
from yatt_hpc.data.prompts import build_prompt_source
from yatt_hpc.data.tokenizer import load_tokenizer
from yatt_hpc.errors import InputError
from yatt_hpc.lora.identity import lora_record, resume_problem
from yatt_hpc.placement.weight_transport import weight_pairs
from yatt_hpc.roles.async_steps import AsyncSteps
from yatt_hpc.roles.base import BaseController, group_rendezvous, prompt_tools, rank_device
from yatt_hpc.roles.colocation import give_back_phase_memory, holding_devices
from yatt_hpc.roles.protocol import GENERATED, SCORED, StepProtocol
from yatt_hpc.roles.samples import TermLabels, sample_rows, samples_due
from yatt_hpc.roles.update_steps import UpdateSteps
from yatt_hpc.roles.validation import HeldOut
from yatt_hpc.runtime.rank_stats import RankStats
from yatt_hpc.sched.balance import balance_coeff
from yatt_hpc.sched.dynamic_sampling import DynamicSampler, has_signal
from yatt_hpc.sched.overdispatch import PromptQueue, dispatch_count, relayout_positions
from yatt_hpc.sched.routing import Routes
from yatt_hpc.train.step_plan import kl_controller, plan_update, reward_kl, step_lr
from yatt_hpc.vision.processor import ImageProcessor, is_vision_model

log = logging.getLogger(__name__)


class TrainerController(UpdateSteps, AsyncSteps, BaseController):
    def __init__(self, world, cfg: RunConfig, run_dir: Path, stats: RankStats, protocol: StepProtocol):
        from yatt_hpc.train import megatron_model
        from yatt_hpc.train.policy import MegatronPolicy

        self.world, self.cfg, self.stats = world, cfg, stats
        self.routes = Routes(world.plan)
        coords = self.routes.trainer_coords(world.rank)
        self.dp_rank, self.tp_rank, self.pp_rank = coords["dp"], coords["tp"], coords["pp"]
        self.is_stage_owner = coords["tp"] == 0 and coords["cp"] == 0  # sends its pipeline stage's weights
        self.is_owner = self.is_stage_owner and coords["pp"] == 0
        self.replica_comm = world.group_comm.Split(self.dp_rank, world.group_rank)
        self.n = cfg.rollout.samples_per_prompt
        self.per_replica = cfg.train.prompts_per_step // self.routes.dp
        self.owners_comm = world.group_comm.Split(0 if self.is_owner else MPI.UNDEFINED, world.group_rank)
        ds = cfg.rollout.dynamic_sampling
        self.dynamic = ds.enabled
        self.sampler = DynamicSampler(self.per_replica, ds.oversampling, ds.ema_decay, ds.ema_cap, ds.max_refill_waves)
        self.queue = PromptQueue(stride=self.routes.dp, offset=self.dp_rank)  # this replica's data position
        self.ratio = cfg.rollout.over_dispatch_ratio
        # rollout.max_staleness: scored batches waiting for their step, each with the step that generated it (the
        # replica's owner holds them; every trainer rank of the replica counts them)
        self.staleness = cfg.rollout.max_staleness
        self.pending: list[tuple[int, SampleBatch]] = []
        self.pending_count = 0
        self.router = build_router(cfg.rollout.routing, self.owners_comm, self.dp_rank)
        self.expected_response = cfg.rollout.max_new_tokens / 2  # routing's load estimate, updated per wave
        self._count_send: tuple[list, np.ndarray | None] = ([], None)  # the TAG_COUNT in flight, its buffer
        self.protocol = protocol
        self.consumed = ConsumedLog(run_dir / "data" / f"consumed-dp{self.dp_rank}.jsonl", enabled=self.is_owner)
        self.tokenizer = load_tokenizer(cfg.model.path)
        images = ImageProcessor.from_model_dir(cfg.model.path) if is_vision_model(cfg.model.path) else None
        self.source = build_prompt_source(cfg.data, self.tokenizer, require_answer=cfg.reward.needs_answer,
                                          images=images, tools=prompt_tools(cfg))
        addr, port = group_rendezvous(world)
        tp, self.pp = world.plan.group("trainer").size("tp"), world.plan.group("trainer").size("pp")
        device = rank_device(world)
        self.ep = world.plan.group("trainer").ep
        megatron_model.initialize_model_parallel(world.group_rank, world.group_comm.Get_size(), addr, port,
                                                 tp_size=tp, pp_size=self.pp, seed=cfg.train.seed,
                                                 cuda_device=torch.device(device).index, ep_size=self.ep,
                                                 pp_layers=cfg.placement.trainer.pp_layers)
        megatron_model.check_groups(world.plan.group("trainer"), self.dp_rank)
        torch.manual_seed(cfg.train.seed)
        # LoRA: the adapters' settings and their base's identity, saved with every checkpoint and checked at resume
        self.lora = lora_record(cfg.train.lora, cfg.model.path) if cfg.train.lora.enabled else None
        self.policy = MegatronPolicy.from_hf(cfg.model.path, self.tp_rank, tp, cfg.train,
                                             dtype=getattr(torch, cfg.model.dtype),
                                             temperature=cfg.rollout.temperature)
        # the KL weight: fixed, or Ziegler et al.'s controller toward train.kl_target (its value is checkpointed)
        self.kl = kl_controller(cfg.train)
        self.balancer = self._build_balancer()  # its cost model reads the policy's config
        self.held_out = HeldOut.build(cfg, self.tokenizer, images, self.dp_rank, self.routes.dp)
        self.term_labels = TermLabels.of(cfg.reward)
        pairs = weight_pairs(world.plan, cfg.rollout.weight_transport, cfg.rollout.engine)
        self.weights_out = WeightSender(world.comm, pairs, cfg.rollout.weight_sync_bucket_mb, device=device)
        self.colocate = world.plan.mode == "colocate"
        if self.colocate:
            self.policy.release_memory()  # rollout and GenRM take the devices first each step
        self.build_critic(tp)  # train.adv_estimator=gae: the value model, on these ranks (roles/update_steps.py)
        log.info("trainer dp=%d tp=%d pp=%d owner=%s ready; update forward: %s", self.dp_rank, self.tp_rank,
                 self.pp_rank, self.is_owner, self.policy.layout_note)

    # ------------------------------------------------------------------ the step, as one screen

    def step(self, step: int) -> None:
        if self.staleness:
            self.async_step(step)
            return
        batch = self.sample(step) if self.is_owner else self.follow_waves()   # generate + score
        if self.is_owner:
            batch = self.balance(batch)                     # even out work across DP replicas
        batch = bcast_batch(self.replica_comm, batch, root=0)
        if not self.is_owner:
            self.stats.hold(len(batch))
        values = self.critic_values(batch)                  # a critic's turn on the devices (gae)
        with holding_devices(self.stats, self.policy, self.colocate):   # rollout and GenRM had them
            with self.stats.phase("train"):
                update = self.train_on(batch, step, values)
            if self.colocate:  # the engines' weights arrive next: the update's gradients and activations go first
                self.policy.drop_gradients()
                give_back_phase_memory(self.stats)
            with self.stats.phase("weight_sync"):
                self.sync_weights()
        self.critic_update(batch, step)                     # and its second: the value loss
        self.report(batch, update)
        if self.is_owner and samples_due(self.cfg, step + 1):
            self.add_samples(batch, step + 1, "train", lambda pid: self.source.row_at(pid)["image_names"])
        self.stats.hold(-len(batch))

    def add_samples(self, batch: SampleBatch, step: int, table: str, image_names) -> None:
        """This replica's rows of a sample table, sent to the leader with the step report."""
        self.stats.samples += sample_rows(batch, self.tokenizer, self.term_labels, step=step, table=table,
                                          replica=self.dp_rank, count=self.cfg.logging.samples_per_replica,
                                          image_names=image_names)

    def train_on(self, batch: SampleBatch, step: int, critic_values=None):
        """Advantages (GAE on `critic_values` with a critic), the mini-batch plan, this step's learning rate, the
        update (none in the critic's warm-up); then the KL controller."""
        tc = self.cfg.train
        penalties, kl_seen = None, np.zeros(2)
        if tc.kl_in_reward:  # r_t -= beta kl_t, kl of the sampling policy (the rollout's logprobs) to the reference
            penalties, kl_sum = reward_kl(batch, self.policy.reference_logprobs(batch), tc, self.kl.coef)
            kl_seen = np.array([kl_sum, float(batch.response_mask.sum())])
        adv = self.advantages(batch, penalties, critic_values)
        plan = plan_update(batch, tc, self.cfg.rollout.max_new_tokens, gather=self.gather_over_replicas,
                           reduce=self.sum_over_replicas, kl_coef=0.0 if tc.kl_in_reward else self.kl.coef)
        lr = step_lr(step, tc)
        self.policy.set_lr(lr)
        values, gap = adv.values, None
        if tc.off_policy.proximal == "recompute":  # decoupled PPO: the ratio against the trainer's own weights
            batch, values, gap = self.off_policy(batch, values)
        update = self.policy.update(batch, values, plan) if self.policy_trains(step) else self.warmup_stats()
        if gap is not None:  # the engine/trainer gap is the behavior/proximal one (the update's own is ~0)
            update.logp_diff_max = gap
        if not tc.kl_in_reward:
            kl_seen = np.array([update.kl, update.tokens])
        self.stats.values.update({"lr": lr, "kl_coef": self.kl.coef})
        if self.is_owner:
            self.stats.add("no_signal", adv.no_signal)
            self.stats.add("truncated_masked", plan.truncated_masked)
            self.stats.add("kl_sum", float(kl_seen[0]))
            self.stats.add("kl_tokens", float(kl_seen[1]))
            self.stats.values["optimizer_steps"] = float(update.optimizer_steps)
        if tc.kl_target is not None and self.policy_trains(step):  # no KL seen in the critic's warm-up
            kl_sum, tokens, samples = self.sum_over_replicas(np.array([*kl_seen, len(batch)], np.float64))
            self.kl.update(kl_sum / max(tokens, 1.0), int(samples))
        return update

    def sum_over_replicas(self, values: np.ndarray) -> np.ndarray:
        """`values` summed over the data-parallel replicas (each replica's owner contributes; every trainer
        rank gets the sum): the global-batch statistics of `yatt_hpc/algos/`."""
        values = np.ascontiguousarray(values, np.float64)
        out = np.empty_like(values)
        self.world.group_comm.Allreduce(values if self.is_owner else np.zeros_like(values), out, op=MPI.SUM)
        return out

    def gather_over_replicas(self, items: list) -> list:
        """`items` of every data-parallel replica's owner, concatenated, on every trainer rank."""
        return [x for part in self.world.group_comm.allgather(items if self.is_owner else []) for x in part]

    def evaluate(self, step: int) -> dict | None:
        """A validation round: each owner sends its held-out prompts (eval's n and temperature), takes them
        back scored and sums its share; the owners add their sums; the leader returns val/... metrics."""
        sums = np.zeros((len(self.held_out.names), self.held_out.width()))
        routing = self.expected_response  # validation's lengths must not steer training's routing
        with self.stats.aside("eval"):
            if self.is_owner:
                def wave() -> bool:
                    ids, rows, prompts = self.held_out.share()
                    self.send_prompts(ids, rows, prompts, self.held_out.n, keep=len(ids))
                    self.protocol.gate(GENERATED)
                    self.protocol.gate(SCORED)
                    scored = self.collect_scored()
                    sums[:] = self.held_out.sums(scored)
                    if self.cfg.logging.samples_every > 0:
                        for name, part in self.held_out.by_source(scored):
                            self.add_samples(part, step, f"val/{name}",
                                             lambda pid: self.held_out.row_of(pid)["image_names"])
                    self.stats.hold(-len(scored))
                    return False

                self.protocol.waves(wave)
            else:
                self.follow_waves()
        self.expected_response = routing
        if not self.is_owner:
            return None
        total = np.empty_like(sums)
        self.owners_comm.Allreduce(sums, total, op=MPI.SUM)
        return self.held_out.scalars(total) if self.world.is_leader else None

    # ------------------------------------------------------------------ pieces

    def sample(self, step: int) -> SampleBatch:
        """Waves of prompts until this replica has its groups (one wave without dynamic sampling)."""
        asks, scored = [self.sampler.first_wave()], []

        def wave() -> bool:
            dispatched = self.dispatch_prompts(asks[-1])
            self.protocol.gate(GENERATED)
            self.protocol.gate(SCORED)
            got = self.collect_scored()
            self.settle(step, dispatched, got)
            scored.append(got)
            groups = np.unique(got.prompt_id)
            valid = [g for g in groups if has_signal(got.reward[got.prompt_id == g])]
            self.sampler.observe(len(groups), len(valid))
            asks.append(self.sampler.next_wave() if self.dynamic else 0)
            return asks[-1] > 0

        self.protocol.waves(wave)
        return self.keep_groups(SampleBatch.concat(scored).sorted_by_id())

    def follow_waves(self) -> None:
        """Tensor-parallel peers of an owner take part in the waves' gates and agreements, nothing else."""
        def wave() -> bool:
            self.protocol.gate(GENERATED)
            self.protocol.gate(SCORED)
            return False

        self.protocol.waves(wave)

    def keep_groups(self, batch: SampleBatch) -> SampleBatch:
        """Without dynamic sampling: everything. With it: the first `target` groups with reward
        variance, padded (zero advantage) with zero-variance groups when the waves ran out."""
        self.end_sampling_step()
        if not self.dynamic:
            return batch
        groups = np.unique(batch.prompt_id)
        valid = [g for g in groups if has_signal(batch.reward[batch.prompt_id == g])]
        invalid = [g for g in groups if g not in set(valid)]
        keep = valid[: self.per_replica]
        padded = invalid[: self.per_replica - len(keep)]
        self.stats.values["padded_groups"] = float(len(padded))
        out = batch.select(np.flatnonzero(np.isin(batch.prompt_id, keep + padded)))
        self.stats.hold(len(out) - len(batch))
        return out

    def end_sampling_step(self) -> None:
        ds = self.sampler
        self.stats.add("groups_total", ds.total_groups)
        self.stats.add("groups_valid", ds.valid_groups)
        self.stats.values["waves"] = float(ds.waves + 1)
        mean = self.owners_comm.allreduce(ds.step_expansion()) / self.owners_comm.Get_size()
        ds.end_step(mean)
        self.stats.values["ema_expansion"] = ds.ema_expansion

    def dispatch_prompts(self, keep: int, carried: SampleBatch | None = None) -> dict[int, int]:
        """Send ceil(keep x ratio) prompt groups to the rollout ranks, `carried` (partial rollouts' paused groups,
        roles/partial.py) first; returns {position: row id} sent."""
        going = np.unique(carried.prompt_id) if carried is not None else np.zeros(0, np.int64)
        positions, reused = self.queue.take(dispatch_count(keep, self.ratio) - len(going))
        rows = [self.source.row_at(int(p)) for p in positions]
        prompts = [np.asarray(self.source.encode(r), np.int32) for r in rows]  # data.format, length checked
        self.send_prompts(np.asarray(positions, np.int64), rows, prompts, self.n, keep, carried)
        self.stats.add("reused_prompts", reused)
        self.stats.values["route_spread"] = max(self.stats.values.get("route_spread", 1.0), self.router.spread)
        return {int(p): int(self.source.row_at(int(p))["id"]) for p in going} | \
            {int(p): int(r["id"]) for p, r in zip(positions, rows)}

    def send_prompts(self, ids: np.ndarray, rows: list, prompts: list[np.ndarray], n: int, keep: int,
                     carried: SampleBatch | None = None) -> None:
        """n copies of each prompt (`ids` its prompt ids) after the `carried` groups, to each group's rollout
        rank; GenRM learns what comes."""
        answers = [np.frombuffer(r["answer"].encode(), np.uint8) for r in rows]
        questions = [np.frombuffer(r["question"].encode(), np.uint8) for r in rows]
        metadata = [np.frombuffer(json.dumps(r["metadata"]).encode() if r["metadata"] else b"", np.uint8) for r in rows]
        rep = np.repeat(np.arange(len(rows)), n)
        batch = SampleBatch(
            sample_id=np.repeat(ids, n) * n + np.tile(np.arange(n), len(rows)),
            prompt_id=np.repeat(ids, n),
            owner=np.full(len(rep), self.world.rank, np.int32),
            prompt_len=np.array([len(prompts[i]) for i in rep], np.int32),
            prompt_tokens=np.concatenate([prompts[i] for i in rep]) if rows else np.zeros(0, np.int32),
            answer_len=np.array([len(answers[i]) for i in rep], np.int32),
            answer=np.concatenate([answers[i] for i in rep]) if rows else np.zeros(0, np.uint8),
            question_len=np.array([len(questions[i]) for i in rep], np.int32),
            question=np.concatenate([questions[i] for i in rep]) if rows else np.zeros(0, np.uint8),
            metadata_len=np.array([len(metadata[i]) for i in rep], np.int32),
            metadata=np.concatenate([metadata[i] for i in rep]) if rows else np.zeros(0, np.uint8),
            **image_columns([r.get("images") or [] for r in rows], n),
        )
        if carried is not None:
            batch, prompts = SampleBatch.concat([carried, batch]), [*carried.ragged("prompt_tokens")[::n], *prompts]
        groups_to = self.router.assign(self.routes, [n * (len(p) + self.expected_response) for p in prompts])
        rank_of = np.repeat(np.asarray(groups_to, np.int64), n)
        self.stats.hold(len(batch))
        # GenRM learns how many groups to keep and how many samples each rollout rank got (it may
        # receive only after a phase gate: non-blocking); every destination gets one message
        counts = [(r, int((rank_of == r).sum())) for r in self.router.destinations(self.routes)]
        header = np.array([keep] + [x for r, c in counts if c for x in (r, c)], np.int64)
        genrm = self.routes.genrm_for(self.dp_rank)
        self._count_send = ([self.world.comm.Isend(header, dest=genrm, tag=TAG_COUNT)], header)
        DOORBELL.ring(self.world.comm, genrm)
        for r, _ in counts:
            send_batch(self.world.comm, r, TAG_PROMPTS, batch.select(np.flatnonzero(rank_of == r)))
        self.stats.hold(-len(batch))  # sent: the samples now live on the rollout ranks

    def collect_scored(self) -> SampleBatch:
        wait_all(self._count_send[0])
        batch, _ = recv_batch(self.world.comm, self.routes.genrm_for(self.dp_rank), TAG_SCORED)
        self.stats.hold(len(batch))
        if len(batch):
            self.expected_response = 0.5 * self.expected_response + 0.5 * float(batch.response_len.mean())
        # message arrival order must never change the math: order by sample id
        return batch.sorted_by_id()

    def settle(self, step: int, dispatched: dict[int, int], wave: SampleBatch) -> None:
        """The kept groups are consumed (trained on or filtered); the rest go back to the queue's front."""
        kept = [int(p) for p in np.unique(wave.prompt_id)]
        assert len(wave) == len(kept) * self.n and set(kept) <= dispatched.keys(), "GenRM returned a group we did not send"
        assert len(np.unique(wave.sample_id)) == len(wave), "a sample came back twice"
        returned = sorted(dispatched.keys() - set(kept))
        self.queue.give_back(returned)
        self.stats.add("returned_prompts", len(returned))
        self.stats.add("prompts_consumed", len(kept))
        if kept:
            self.consumed.record(step, kept, [dispatched[p] for p in kept])

    def _build_balancer(self):
        if not self.is_owner or self.cfg.train.balance == "none" or self.routes.dp == 1:
            return None
        hidden = self.policy.hf_config.get_text_config().hidden_size
        return Rebalancer(self.owners_comm, self.world.comm, [self.routes.trainer_owner(d) for d in range(self.routes.dp)],
                          balance_coeff(self.cfg.train, hidden), shared_prompts=self.cfg.train.share_prompts)

    def balance(self, batch: SampleBatch) -> SampleBatch:
        if self.balancer is None:
            return batch
        with self.stats.phase("balance"):
            self.stats.hold(-len(batch))
            batch, info = self.balancer.rebalance(batch)
            self.stats.hold(len(batch))
        self.stats.values.update({"balance_before": info.before, "balance_after": info.after,
                                  "balance_moved": info.moved_groups})
        return batch

    def sync_weights(self) -> None:
        targets = self.routes.weight_targets_of(self.dp_rank)
        # ep > 1: this replica's experts also go to the engines its expert-parallel peers update (after the rest)
        peers = [self.routes.weight_targets_of(p) for p in self.routes.expert_peers(self.dp_rank) if p != self.dp_rank]
        if not targets and not any(peers):
            return
        dests = targets if self.is_stage_owner else []  # each pipeline stage's owner sends its own layers
        sent = self.weights_out.send(dests, self.policy.hf_weights())  # each engine by its pair's transport
        for peer_targets in filter(None, peers):
            more = self.weights_out.send(peer_targets if self.is_stage_owner else [],
                                         self.policy.hf_weights(experts_only=True))
            sent = sent._replace(nbytes=sent.nbytes + more.nbytes, mpi_bytes=sent.mpi_bytes + more.mpi_bytes)
        if self.pp > 1:  # the replica's owner reports what every stage sent
            sent = type(sent)(*np.asarray(self.replica_comm.allreduce(
                np.array(sent if self.is_stage_owner else (0, 0, 0), np.int64)), np.int64).tolist())
        self.stats.add("weight_sync_bytes", sent.nbytes)
        self.stats.add("weight_sync_mpi_bytes", sent.mpi_bytes)
        self.stats.values["weight_sync_buckets"] = float(sent.buckets)  # of one sync, per destination

    # ------------------------------------------------------------------ checkpoint hooks

    @property
    def identity(self) -> str:
        return f"trainer/dp{self.dp_rank}/tp{self.tp_rank}/pp{self.pp_rank}"

    @property
    def shard(self) -> dict:
        """This rank's model shard as `CheckpointManager.load_from` reads it: tensor and pipeline rank, stage split."""
        return {"tp": self.tp_rank, "pp": self.pp_rank, "split": self.cfg.placement.trainer.pp_layers}

    def light_state(self, step: int) -> dict:
        """RNG, data position (with returned prompts), sampler and routing state: all that changes
        before the optimizer step."""
        position = {"next_index": self.queue.next_index, "stride": self.routes.dp, "offset": self.dp_rank,
                    "base": self.queue.base,
                    "returned": np.array(list(self.queue.returned), np.int64),  # prompts to dispatch first
                    "step": step, "world_rank": self.world.rank}
        if self.staleness:
            position.update(self.pending_state())
        return {"rng": capture_rng(), "data_position": position,
                "extra": {"sampling": self.sampler.state(),
                          "routing": {"expected_response": float(self.expected_response)},
                          "kl": {"coef": float(self.kl.coef)}, **({"lora": self.lora} if self.lora else {}),
                          **pipeline_record(self.cfg.placement.trainer.pp_layers)}}

    def checkpoint_state(self, step: int, light: dict | None = None) -> RankState:
        """Parameters (dp rank 0 of the shard), optimizer state, and `light_state` (now, or from the step start)."""
        params, coords = None, {"dp": self.dp_rank, "tp": self.tp_rank, "pp": self.pp_rank}
        if self.dp_rank == 0:
            params = self.policy.checkpoint_tensors()
        elif self.dp_rank < self.ep:  # the first expert group's other ranks: their experts, a file each
            params = self.policy.checkpoint_tensors(experts_only=True)
        if self.ep > 1:
            coords["ep"] = self.dp_rank % self.ep
        optim, meta = self.policy.optimizer_state()
        return RankState(self.identity, coords, model=params,
                         optim=optim, optim_meta=meta, **self.critic_state(),
                         **(light if light is not None else self.light_state(step)))

    def watch_mutations(self, guard) -> None:
        """Parameters and optimizer state change only in optimizer.step(): announce it first."""
        for model in (self.policy, self.critic) if self.critic is not None else (self.policy,):
            model.optimizer.register_step_pre_hook(lambda *_: guard.enter_mutation())

    def restore(self, restored) -> None:
        saved_lora = restored.trainers[0].extra.get("lora") if restored.trainers else None
        problem = resume_problem(saved_lora, self.lora, restored.step)
        if problem:
            raise InputError(problem)
        saved = restored.trainer_layout
        now = {"dp": self.routes.dp, "tp": self.world.plan.group("trainer").size("tp"), "pp": self.pp, "ep": self.ep}
        if saved == now and restored.pipeline_split == self.cfg.placement.trainer.pp_layers:
            self.policy.load_checkpoint_tensors(restored.model)
            self.policy.load_optimizer_state(restored.optim, restored.optim_meta)
            self.restore_critic(restored)
            restore_rng(restored.rng)
            position, light = restored.data_position, restored
        else:
            position, light = self._relayout(restored, saved, now)
        if "next_index" not in position or "sampling" not in light.extra:
            raise InputError(f"checkpoint step-{restored.step} of {self.identity} has no data position in this "
                             "version's format (written by an older yatt-hpc); start a fresh --run-dir, or use "
                             "checkpoint.load_from to take only its weights")
        self.queue.load_state(position["next_index"], position.get("returned", ()), position.get("base", 0))
        self.load_pending(position, restored.step)
        self.sampler.load_state(light.extra["sampling"])
        self.expected_response = float(light.extra.get("routing", {}).get("expected_response", self.expected_response))
        self.kl.coef = float(light.extra.get("kl", {}).get("coef", self.kl.coef))

    def _relayout(self, restored, saved: dict[str, int], now: dict[str, int]):
        """A checkpoint of another trainer layout (a requeue onto other nodes): this shard's parameters and
        optimizer state resharded (`ckpt/loader.py`), this replica's share of the prompts no replica has
        consumed (`relayout_positions`); the sampler, routing and KL state of the saved first replica. The RNG
        stays as a fresh start seeds it (sampling seeds come from the sample ids, not from it)."""
        waiting = int(np.asarray(restored.data_position.get("pending_count", [0])).reshape(-1)[0]) \
            if restored.found else max(int(np.asarray(r.data_position.get("pending_count", [0])).reshape(-1)[0])
                                       for r in restored.trainers)
        if saved["ep"] > 1 or now["ep"] > 1:  # each expert-parallel rank's optimizer file holds its own experts
            raise InputError(f"checkpoint step-{restored.step} written with trainer dp={saved['dp']} tp={saved['tp']} "
                             f"pp={saved['pp']} ep={saved['ep']} cannot resume with dp={now['dp']} tp={now['tp']} "
                             f"pp={now['pp']} ep={now['ep']}: a run with expert parallelism resumes in the layout it "
                             "was written with; use that placement, or checkpoint.load_from to take only its weights")
        if waiting or self.critic is not None:  # the critic's shards are not resharded (roles/update_steps.py)
            raise InputError(f"checkpoint step-{restored.step} of " + ("a run with a critic (train.adv_estimator=gae)"
                             if self.critic is not None else "an asynchronous run (its batches generated ahead of "
                             "their step wait on their replicas)") + " resumes in the trainer layout it was written "
                             f"with (dp={saved['dp']} tp={saved['tp']} pp={saved['pp']}, "
                             f"{Shards(split=restored.pipeline_split).stages_text()})")
        saved_shards = Shards(saved["tp"], saved["pp"], restored.pipeline_split)
        shard = Shards(now["tp"], now["pp"], self.cfg.placement.trainer.pp_layers)
        model = reshard_weights(restored.step_dir, self.policy.hf_config, saved_shards, self.tp_rank, self.pp_rank, shard)
        self.policy.load_checkpoint_tensors(model)
        optim, meta = reshard_optimizer(restored.step_dir, self.policy.hf_config, saved_shards, self.tp_rank,
                                        self.pp_rank, shard)
        self.policy.load_optimizer_state(optim, meta)
        replicas = sorted((r for r in restored.trainers if r.coords.get("tp", 0) == 0 and r.coords.get("pp", 0) == 0),
                          key=lambda r: r.coords["dp"])
        positions = relayout_positions([r.data_position for r in replicas], now["dp"])
        log.info("resumed checkpoint step %d written with trainer dp=%d tp=%d pp=%d (%s) into dp=%d tp=%d pp=%d (%s)",
                 restored.step, saved["dp"], saved["tp"], saved["pp"], saved_shards.stages_text(), now["dp"],
                 now["tp"], now["pp"], shard.stages_text())
        return positions[self.dp_rank], replicas[0]

    def rewind_logs(self, step: int) -> None:
        self.consumed.truncate(step)

    def load_weights(self, loaded) -> None:
        step, weights = loaded
        self.policy.load_checkpoint_tensors(weights)
        log.info("initialized weights from %s (its step %d)", self.cfg.checkpoint.load_from, step)

    def after_resume(self, step: int) -> None:
        """The rollout engines still hold the initial weights: send them the restored ones."""
        self.policy.resume_memory()  # the TP gather runs on the devices
        self.sync_weights()
        if self.colocate:
            self.policy.release_memory()

    def report(self, batch: SampleBatch, update) -> None:
        if not self.is_owner:
            return
        agree = (batch.genrm_score >= 0.5) == (batch.rule_score >= 0.5)
        agree &= batch.parse_fail == 0
        for key, value in {
            "samples": len(batch), "reward_sum": batch.reward.sum(), "rule_sum": batch.rule_score.sum(),
            "agree_sum": agree.sum(), "parse_fail_sum": batch.parse_fail.sum(),
            "response_tokens": batch.response_len.sum(), "loss": update.loss,
            "entropy_sum": update.entropy, "tokens": update.tokens, "clip_sum": update.clip_frac,
        }.items():
            self.stats.add(key, float(value))
        self.stats.values["grad_norm"] = update.grad_norm
        self.stats.values["logp_diff_max"] = update.logp_diff_max
        self.stats.values["micro_batch_tokens_max"] = float(update.micro_batch_tokens_max)
        if update.expert_load is not None and update.expert_load.sum():  # a MoE policy (summary._moe)
            for (layer, expert), tokens in np.ndenumerate(update.expert_load):
                self.stats.add(f"moe_tokens/{layer}/{expert}", float(tokens))
        if update.routing_agreement is not None:  # train.moe_routing_replay (summary._moe)
            self.stats.add("moe_replay_alike", float(update.routing_agreement[0]))
            self.stats.add("moe_replay_tokens", float(update.routing_agreement[1]))

