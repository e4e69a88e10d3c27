"""The update's forward and backward through pipeline stages (`placement.trainer.pp` > 1), mixed into
`MegatronPolicy`: each micro-batch's inputs built on every stage, the stage's forward, and on the last stage its
log-probabilities and loss, all driven by Megatron's 1F1B schedule (`train/pipeline.py`). The reference's and the
proximal log-probabilities come from a forward-only pass through the same stages, broadcast to every stage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from yatt_hpc.batch import SampleBatch
from yatt_hpc.train import megatron_model, shared_prompt, update_images
from yatt_hpc.train.logprobs import token_logprobs_and_entropy
from yatt_hpc.train.step_plan import micro_batches, pack_micro_batch, response_aligned

if TYPE_CHECKING:  # the policy's own types (train/policy.py mixes this class in)
    from yatt_hpc.train.policy import LossTerms, UpdateStats


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
            return shared_prompt.forward_shared(model, inputs)
        return megatron_model.forward_logits(model, inputs[0][:, :-1])

    def _stage_logprobs(self, inputs, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's log-probs and entropies of a micro-batch's targets."""
        if self.share_prompts:
            logits, targets = shared_prompt.gather_rows(logits, inputs.source), inputs.targets
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
