"""Asynchronous steps of the trainer (`rollout.max_staleness` = s >= 1; docs/async.md), mixed into
`TrainerController`:

    step t's wave:  dispatch the prompts of step t + s -> train on the oldest waiting batch -> collect the new one
    after the wave: the weights go to the rollout ranks, which generate step t + s + 1's batch with them

A fresh start first runs the s waves that fill the queue (generated with the initial weights). A batch generated
at step g is trained at step g + s: its samples come from the weights after update g, a function of the step.
The replica's owner holds the waiting batches; every trainer rank of the replica counts them (the waves they
walk depend on it). The batches are in the checkpoint (`pending_state`, as arrays), so a resume is exact.
"""
from __future__ import annotations

import numpy as np

from yatt_hpc.batch import SampleBatch, batch_columns, batch_from_columns
from yatt_hpc.comm.transport import bcast_batch
from yatt_hpc.errors import InputError
from yatt_hpc.roles.partial import PartialCarry
from yatt_hpc.roles.protocol import GENERATED, SCORED
from yatt_hpc.roles.samples import samples_due
from yatt_hpc.sched.dynamic_sampling import has_signal


class AsyncSteps(PartialCarry):
    """The asynchronous step; the controller provides the waves' pieces (dispatch, collect, train_on, report).
    With partial rollouts (`PartialCarry`) a wave sends the replica's paused groups first and keeps those that
    come back unfinished."""

    staleness: int
    pending: list[tuple[int, SampleBatch]]
    pending_count: int

    def async_step(self, step: int) -> None:
        """`rollout.max_staleness` = s >= 1: this step's wave generates and scores the batch of step + s while the
        replica trains on the oldest waiting batch (generated at step - s, or before the first update on a fresh
        start: its first step first runs the s waves that fill the queue, generated with the initial weights)."""
        fill = self.staleness - self.pending_count  # s on a fresh start; 0 after it, and after a resume
        done: dict = {}

        def wave() -> bool:
            index = len(done.setdefault("waves", []))
            done["waves"].append(index)
            # the step whose batch this wave generates; none past the run's last step (the wave sends nothing)
            needed = step + self.staleness - fill + index < self.cfg.train.steps
            if self.is_owner:
                dispatched = self.dispatch_wave(self.sampler.first_wave() if needed else 0, step)
            if index == fill:  # generation runs on the rollout and GenRM ranks while this replica trains
                done["batch"], done["update"], done["age"] = self.train_waiting(step)
            self.protocol.gate(GENERATED)
            self.protocol.gate(SCORED)
            if self.is_owner:
                got = self.collect_wave(step, dispatched)
                if needed:
                    groups = np.unique(got.prompt_id)
                    self.sampler.observe(len(groups), sum(has_signal(got.reward[got.prompt_id == g]) for g in groups))
                    self.pending.append((step, self.keep_groups(got)))
            self.pending_count += int(needed)
            return index < fill

        self.protocol.waves(wave)
        with self.stats.phase("weight_sync"):
            self.sync_weights()
        batch = done["batch"]
        self.stats.values["staleness"] = float(done["age"])
        self.note_versions(batch, step)
        self.report(batch, done["update"])
        if self.is_owner and samples_due(self.cfg, step + 1):
            self.add_samples(batch, step + 1, "train", lambda pid: self.source.row_at(pid)["image_names"])
        self.stats.hold(-len(batch))

    def train_waiting(self, step: int):
        """Train on the oldest waiting batch: (the batch, the update, its age in steps: step - the step that
        generated it)."""
        generated, batch = self.pending.pop(0) if self.is_owner else (None, None)
        self.pending_count -= 1
        if self.is_owner:
            batch = self.balance(batch)
        batch = bcast_batch(self.replica_comm, batch, root=0)
        generated = self.replica_comm.bcast(generated, root=0)
        if not self.is_owner:
            self.stats.hold(len(batch))
        with self.stats.phase("train"):
            update = self.train_on(batch, step)
        return batch, update, step - generated

    def pending_state(self) -> dict:
        """The checkpoint's record of the waiting batches (owners: the batches; every rank: how many)."""
        return {"pending": {str(i): {"generated": np.array([g], np.int64), "columns": batch_columns(b)}
                            for i, (g, b) in enumerate(self.pending)},
                "pending_count": np.array([self.pending_count], np.int64), **self.carry_state()}

    def load_pending(self, position: dict, step: int) -> None:
        """The waiting batches of an asynchronous run's checkpoint (`light_state`)."""
        saved = int(np.asarray(position.get("pending_count", [0])).reshape(-1)[0])
        if saved and not self.staleness:
            raise InputError(f"checkpoint step-{step} holds {saved} batches generated ahead of their step "
                             "(rollout.max_staleness > 0); resume it with the rollout.max_staleness it was written with")
        if self.staleness and saved > self.staleness:
            raise InputError(f"checkpoint step-{step} holds {saved} batches generated ahead of their step, more than "
                             f"rollout.max_staleness={self.staleness}; resume with rollout.max_staleness >= {saved}")
        pending = position.get("pending", {})
        self.pending = [(int(np.asarray(pending[k]["generated"]).reshape(-1)[0]), batch_from_columns(pending[k]["columns"]))
                        for k in sorted(pending, key=int)]
        self.pending_count = saved
        for _, batch in self.pending:
            self.stats.hold(len(batch))
        self.load_carry(position, step)
