"""Pipeline parallelism in the trainer: Megatron-Core's 1F1B schedule over one mini-batch's micro-batches.

    stages = PipelineStages()                       # after initialize_model_parallel(pp_size > 1)
    stats = stages.run(model, items, forward, loss) # forward and backward of every item; stats on the last stage
    logp = stages.run(model, items, forward, loss, forward_only=True)

Each trainer rank holds one stage: a `GPTModel` built with ``pre_process`` on the first stage (embeddings)
and ``post_process`` on the last (final norm, head, logits). Every stage of a data-parallel replica holds the
replica's whole batch, so each builds its micro-batches' inputs itself: the first stage embeds the tokens,
the others receive the hidden states from the stage before (Megatron's ``p2p_communication``, the shapes
sent first: micro-batches differ in length), and the last computes the loss. ``forward(model, item)`` returns
the stage's output (logits on the last stage, hidden states elsewhere); ``loss(item, logits)`` returns the
micro-batch's loss (its share of the mini-batch's, already divided by the global counts) and whatever the
caller wants back. The schedule is ``forward_backward_pipelining_without_interleaving`` (1F1B: pp-1-s
warm-up forwards on stage s, then one forward one backward); the interleaved schedule needs several model
chunks per rank, which the trainer does not build.

A stage's parameters are its layers only, so the data-parallel all-reduce, clipping and AdamW work per stage.
Two things cross stages: the gradient norm (a sum of squares over the pipeline group) and, with tied
embeddings, the word embeddings, which the first stage holds as its input embedding and the last as its
head (``output_layer.weight``, marked ``shared``): their gradients are summed over Megatron's embedding
group before the optimizer step, so both copies take the same update (Megatron's
``finalize_model_grads``, ``_allreduce_word_embedding_grads``, which we do not run).

`StageUpdate`, mixed into `MegatronPolicy`: each micro-batch's inputs built on every stage, the stage's forward,
and on the last stage its log-probabilities and loss, all driven by the schedule above. The reference's and the
proximal log-probabilities come from a forward-only pass through the same stages, broadcast to every stage.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from yatt_hpc.batch import SampleBatch
from yatt_hpc.train import cpu_compat, megatron_model, shared_prompt, update_images
from yatt_hpc.train.logprobs import token_logprobs_and_entropy
from yatt_hpc.train.mcore import parallel_state
from yatt_hpc.train.step_plan import micro_batches, pack_micro_batch, response_aligned

if TYPE_CHECKING:  # the policy's own types (train/policy.py mixes StageUpdate in)
    from yatt_hpc.train.policy import LossTerms, UpdateStats


class PipelineStages:
    """This rank's place in the pipeline and the schedule that drives it."""

    def __init__(self) -> None:
        self.size = parallel_state.get_pipeline_model_parallel_world_size()
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        self.last_rank = parallel_state.get_pipeline_model_parallel_last_rank()  # global rank of this replica's last stage

    def run(self, model, items: Sequence[Any], forward: Callable[[Any, Any], torch.Tensor],
            loss: Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]], forward_only: bool = False,
            on_backward: Callable[[Any], None] | None = None) -> list:
        """Forward (and, unless `forward_only`, backward) of every item through the stages; the list of
        `loss`'s second values on the last stage, [] on the others. `on_backward(item)` runs when an item's
        backward starts on this stage (a recomputed layer needs what its forward had)."""
        from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

        results: list = []
        feed = iter(items)

        def step(_data, stage_model):
            item = next(feed)
            output = forward(stage_model, item)
            if on_backward is not None and output.requires_grad:
                output.register_hook(lambda grad: (on_backward(item), grad)[1])

            def loss_func(logits):
                value, extra = loss(item, logits)
                results.append(extra)
                return value, torch.tensor(1, dtype=torch.int), {}

            return output, loss_func

        if not items:
            return results
        with cpu_compat.pipeline_on_cpu():
            forward_backward_pipelining_without_interleaving(
                forward_step_func=step, data_iterator=None, model=model, num_microbatches=len(items),
                seq_length=1, micro_batch_size=1,  # unused: every send carries its shape (variable_seq_lengths)
                forward_only=forward_only)
        return results

    # ------------------------------------------------------------------ across stages

    def broadcast_from_last(self, values: np.ndarray) -> np.ndarray:
        """`values` of the last stage, on every stage (float64; the same shape everywhere)."""
        t = torch.from_numpy(np.ascontiguousarray(values, np.float64)).clone()
        device = _group_device()
        t = t.to(device)
        torch.distributed.broadcast(t, src=self.last_rank, group=self.group)
        return t.cpu().numpy()

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """A scalar summed over the stages (the squared gradient norm)."""
        torch.distributed.all_reduce(value, group=self.group)
        return value


def sync_tied_embeddings(model) -> None:
    """Sum the word embeddings' gradient of the first stage and the head's of the last stage (tied
    embeddings, pp > 1) over Megatron's embedding group; a no-op on other stages and without tying."""
    if not getattr(model, "share_embeddings_and_output_weights", False) or not (model.pre_process or model.post_process):
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    if not weight.requires_grad:  # frozen (LoRA): both copies stay the base's
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def _group_device() -> torch.device:
    return torch.device("cpu") if cpu_compat.is_cpu_runtime() else torch.device("cuda", torch.cuda.current_device())


class StageUpdate:
    """The pipelined update; `MegatronPolicy` provides the model, the loss (`_loss`) and `pipeline`."""

    def _stage_inputs(self, mb: SampleBatch, pixels: update_images.Pixels):
        """What every stage builds for a micro-batch: the padded tokens or the shared-prompt stream."""
        if self.share_prompts:
            return shared_prompt.layout_of(mb).to(self.device)
        tokens, mask, old_logp = pack_micro_batch(mb)
        return tokens.to(self.device), mask.to(self.device), old_logp.to(self.device)

    def _stage_forward(self, model, inputs) -> torch.Tensor:
        """This stage's output for a micro-batch: logits on the last stage, hidden states elsewhere."""
        if self.share_prompts:
            return shared_prompt.forward_shared(model, inputs, rows=inputs.source)  # the last stage: [N, R, V]
        return megatron_model.forward_logits(model, inputs[0][:, :-1])

    def _stage_logprobs(self, inputs, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's log-probs and entropies of a micro-batch's targets."""
        if self.share_prompts:
            targets = inputs.targets
        else:
            targets = inputs[0][:, 1:]
        return token_logprobs_and_entropy(logits, targets, self.tp_group, self.vocab_size, self.temperature)

    def _aligned(self, mb: SampleBatch, inputs, values: list[np.ndarray]) -> torch.Tensor:
        """Per-response-token `values` laid out like the micro-batch's log-probs."""
        if self.share_prompts:
            return shared_prompt.padded(values, inputs.targets.shape[1]).to(self.device)
        return response_aligned(mb.prompt_len, values, inputs[0].shape[1] - 1).to(self.device)

    def _pipeline_steps(self, batch: SampleBatch, micros: list[np.ndarray], advantages: list[np.ndarray],
                        keep: np.ndarray, terms: LossTerms, reference: list[np.ndarray] | None) -> list[UpdateStats]:
        """Forward and backward of a mini-batch's micro-batches through the stages (1F1B); the last stage's
        statistics of each (none on the other stages)."""
        items = []
        for micro in micros:
            mb = batch.select(micro)
            items.append((micro, mb, self._stage_inputs(mb, {})))

        def loss(item, logits):
            micro, mb, inputs = item
            logp, entropy = self._stage_logprobs(inputs, logits)
            old_logp = self._aligned(mb, inputs, mb.ragged("logprobs"))
            mask = inputs.mask if self.share_prompts else inputs[1]
            adv_tok = self._aligned(mb, inputs, [advantages[i] for i in micro])
            ref_logp = None if reference is None else self._aligned(mb, inputs, [reference[i] for i in micro])
            return self._loss(logp, entropy, ref_logp, old_logp, mask, adv_tok, keep[micro], terms)

        recompute = self.share_prompts and self.cfg.recompute != "none"
        try:
            return self.pipeline.run(self.model, items, lambda model, item: self._stage_forward(model, item[2]), loss,
                                     on_backward=(lambda item: shared_prompt.set_backward_layout(item[2]))
                                     if recompute else None)
        finally:
            if recompute:
                shared_prompt.set_backward_layout(None)

    @torch.no_grad()
    def _pipeline_logprobs(self, model, batch: SampleBatch) -> list[np.ndarray]:
        """`logprobs_of` through `model`'s stages; every stage gets the last stage's result."""
        micros = list(micro_batches(batch, np.arange(len(batch)), self.cfg))
        items = [(micro, batch.select(micro)) for micro in micros]
        items = [(micro, mb, self._stage_inputs(mb, {})) for micro, mb in items]

        def rows(item, logits):
            _, mb, inputs = item
            logp, _ = self._stage_logprobs(inputs, logits)
            padded = logp.float().cpu().numpy()
            if self.share_prompts:
                got = [row[:n] for row, n in zip(padded, mb.response_len)]
            else:
                got = [padded[i, p - 1:p - 1 + n] for i, (p, n) in enumerate(zip(mb.prompt_len, mb.response_len))]
            return torch.zeros(()), got

        per_micro = self.pipeline.run(model, items, lambda model, item: self._stage_forward(model, item[2]),
                                      rows, forward_only=True)
        flat = np.zeros(int(batch.response_len.sum()))
        if self.pipeline.last:
            out: list = [None] * len(batch)
            for (micro, _, _), got in zip(items, per_micro):
                for i, row in zip(micro, got):
                    out[i] = row
            flat = np.concatenate(out) if out else flat
        flat = self.pipeline.broadcast_from_last(flat).astype(np.float32)
        return np.split(flat, np.cumsum(batch.response_len)[:-1]) if len(batch) else []
