"""The trainer's forward with each prompt computed once per GRPO group instead of once per sample.

    layout = build_layout(prompts, responses, prompt_ids)          # ragged numpy token arrays, group ids
    logits = forward_shared(model, layout, rows=layout.source)     # [N, R, V_local]: the predicting positions'
    logp, entropy = token_logprobs_and_entropy(logits, layout.targets, ...)   # [N, R]

A GRPO step samples G responses per prompt, and the padded layout ([N, P + R] rows) runs every prompt
token through every layer G times: in the demo task prompts are 15 of 22 tokens, so two thirds of the
trainer's matmuls recompute the same hidden states. Causal attention makes a prompt's hidden states
independent of what follows it, so they are the same in every sample of the group.

The shared layout is one flat stream of the micro-batch's distinct tokens: each distinct prompt once, then
the response tokens of each of its samples that are inputs of a prediction (all but the last). Linear
layers, norms and the MLP do not care how tokens are arranged; attention does, and `SharedPromptAttention`
(the core attention of every layer our models build) gathers, for each sample, the keys and values of its
prompt followed by its own response and runs one masked attention per query set: prompts causally over
themselves, responses over their prompt and causally over their own tokens. Gathers are differentiable, so
the backward sums each shared prompt's gradient over its samples, exactly what the padded layout computes.
Positions are explicit (a response token sits at P + j): GPT-2's learned position embeddings take them as
ids, a RoPE model's rotary angles are looked up by them (`_rotary_at`), and a vision-language model's M-RoPE
positions are given per stream token (`update_images.shared_inputs`); its images go through the tower once
per distinct prompt too.

Equality with the padded layout (logprobs, entropies and every gradient, including groups of one, empty
and one-token responses, and different prompts in one micro-batch) is what `tests/unit/test_shared_prompt.py`
checks.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from yatt_hpc.train.mcore import DotProductAttention


@dataclass
class SharedLayout:
    """Index tensors of one micro-batch's shared-prompt stream (all on the model's device)."""

    tokens: torch.Tensor         # [S] the stream's token ids
    positions: torch.Tensor      # [S] each token's position in its own sequence
    prompt_rows: torch.Tensor    # [G, Pmax] stream index of each distinct prompt's tokens (pad: 0)
    prompt_mask: torch.Tensor    # [G, 1, Pmax, Pmax] True where a prompt query may attend
    response_rows: torch.Tensor  # [N, Qmax] stream index of each sample's response inputs (pad: 0)
    key_rows: torch.Tensor       # [N, Pmax + Qmax] its keys: its prompt's rows, then its response rows
    response_mask: torch.Tensor  # [N, 1, Qmax, Pmax + Qmax] True where a response query may attend
    unpack: torch.Tensor         # [S] row of each stream token in cat(prompt outputs, response outputs)
    source: torch.Tensor         # [N, R] stream position whose logits predict response token j (pad: 0)
    targets: torch.Tensor        # [N, R] response tokens (pad: 0)
    mask: torch.Tensor           # [N, R] 1.0 on real response tokens
    in_prompt: torch.Tensor      # [S] True on prompt tokens
    token_group: torch.Tensor    # [S] distinct prompt each stream token belongs to
    group_first: torch.Tensor    # [G] a sample (its first) of each distinct prompt, in stream order
    prompts: int                 # G distinct prompts

    def to(self, device: torch.device) -> SharedLayout:
        return SharedLayout(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                               for k, v in vars(self).items()})


def layout_of(mb) -> SharedLayout:
    """The layout of a micro-batch (a SampleBatch); its `mask` leaves out what the model did not sample."""
    return build_layout(mb.ragged("prompt_tokens"), mb.ragged("response_tokens"), mb.prompt_id, mb.ragged("response_mask"))


def build_layout(prompts: list[np.ndarray], responses: list[np.ndarray],
                 groups: np.ndarray | None = None, sampled: list[np.ndarray] | None = None) -> SharedLayout:
    """The shared stream of samples whose prompts are `prompts` and whose sampled tokens are `responses`;
    samples keep their order in every [N, ...] tensor. Samples share a prompt when its tokens are equal and
    so are their `groups` (the prompt ids: two groups may ask the same text about different images).
    `sampled`: per response token 1 where the model sampled it, 0 where not (an agent's tool results): the
    layout's `mask`, the loss's, is 0 there (every token counts when None)."""
    groups = np.zeros(len(prompts), np.int64) if groups is None else np.asarray(groups, np.int64)
    distinct: dict[tuple[int, bytes], int] = {}
    group_of = np.array([distinct.setdefault((int(g), _key(p)), len(distinct)) for g, p in zip(groups, prompts)],
                        dtype=np.int64)
    first = {g: i for i, g in reversed(list(enumerate(group_of)))}
    group_prompts = [np.asarray(prompts[first[g]]) for g in range(len(distinct))]
    if any(len(p) == 0 for p in group_prompts):
        raise ValueError("a sample has an empty prompt: its first response token has nothing to be predicted from")
    lengths = np.array([len(r) for r in responses], dtype=np.int64)
    inputs = np.maximum(lengths - 1, 0)  # response tokens that are inputs of a later prediction
    # stream: prompt g, then the response inputs of g's samples, group after group
    order = np.argsort(group_of, kind="stable")
    starts, cursor = np.zeros(len(distinct), np.int64), 0
    response_start = np.zeros(len(prompts), np.int64)
    tokens, positions = [], []
    for g in range(len(distinct)):
        starts[g], p = cursor, group_prompts[g]
        tokens.append(p)
        positions.append(np.arange(len(p)))
        cursor += len(p)
        for i in order[group_of[order] == g]:
            response_start[i] = cursor
            tokens.append(responses[i][:inputs[i]])
            positions.append(len(p) + np.arange(inputs[i]))
            cursor += inputs[i]
    prompt_len = np.array([len(p) for p in group_prompts], np.int64)
    prompt_rows, prompt_valid = _rows(starts, prompt_len, int(prompt_len.max()))
    rows = _attention_rows(prompt_rows, prompt_valid, group_of, response_start, inputs, cursor)
    source, targets, valid = _predictions(responses, lengths, response_start,
                                          starts[group_of] + prompt_len[group_of] - 1)
    if sampled is not None:
        valid = valid & (_left_aligned(sampled, valid.shape[1], np.int64) > 0)
    stream = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
    in_prompt = np.zeros(cursor, bool)
    in_prompt[prompt_rows[prompt_valid]] = True
    token_group = np.repeat(np.arange(len(distinct)), np.diff(np.append(starts, cursor)))
    t = torch.from_numpy
    return SharedLayout(
        tokens=t(stream), positions=t(np.concatenate(positions).astype(np.int64)), **rows,
        source=t(source), targets=t(targets), mask=t(valid.astype(np.float32)), in_prompt=t(in_prompt),
        token_group=t(token_group), group_first=t(np.array([first[g] for g in range(len(distinct))], np.int64)),
        prompts=len(distinct))


def _predictions(responses: list[np.ndarray], lengths: np.ndarray, response_start: np.ndarray,
                 last_prompt_token: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, R] stream position whose logits predict each response token (the prompt's last token for the
    first, response token j - 1 for token j), the tokens themselves, and which entries are real."""
    source, valid = _rows(response_start - 1, lengths, int(lengths.max(initial=0)))
    if source.shape[1]:  # (a micro-batch whose responses are all empty predicts nothing)
        source[:, 0] = np.where(lengths > 0, last_prompt_token, 0)
    return source, _left_aligned(responses, source.shape[1], np.int64), valid


def _attention_rows(prompt_rows: np.ndarray, prompt_valid: np.ndarray, group_of: np.ndarray,
                    response_start: np.ndarray, inputs: np.ndarray, size: int) -> dict[str, torch.Tensor]:
    """The layout's gather indices and masks for the two query sets (prompts; each sample's response),
    and where each stream token's output sits in their concatenation."""
    q_max, p_max = int(inputs.max(initial=0)), prompt_rows.shape[1]
    response_rows, response_valid = _rows(response_start, inputs, q_max)
    key_rows = np.concatenate([prompt_rows[group_of], response_rows], axis=1)
    prompt_mask = np.tril(np.ones((p_max, p_max), bool))[None] & prompt_valid[:, None, :]
    response_mask = np.concatenate(
        [np.broadcast_to(prompt_valid[group_of][:, None, :], (len(group_of), q_max, p_max)),
         np.tril(np.ones((q_max, q_max), bool))[None] & response_valid[:, None, :]], axis=2)
    # a padding query row must see some key (an all-masked softmax is NaN); its output is never read
    prompt_mask[:, :, 0] |= ~prompt_valid
    response_mask[:, :, 0] |= ~response_valid
    unpack = np.empty(size, np.int64)
    unpack[prompt_rows[prompt_valid]] = np.flatnonzero(prompt_valid.reshape(-1))
    unpack[response_rows[response_valid]] = prompt_valid.size + np.flatnonzero(response_valid.reshape(-1))
    t = torch.from_numpy
    return {"prompt_rows": t(prompt_rows), "prompt_mask": t(np.ascontiguousarray(prompt_mask[:, None])),
            "response_rows": t(response_rows), "key_rows": t(key_rows),
            "response_mask": t(np.ascontiguousarray(response_mask[:, None])), "unpack": t(unpack)}


def padded(arrays: list[np.ndarray], width: int) -> torch.Tensor:
    """[len(arrays), width] float32 rows, each array left-aligned and zero-padded (the rollout's logprobs)."""
    return torch.from_numpy(_left_aligned(arrays, width, np.float32))


def _left_aligned(arrays: list[np.ndarray], width: int, dtype) -> np.ndarray:
    """[len(arrays), width] of `dtype`: row i holds arrays[i] from column 0, zeros after it."""
    lengths = np.array([len(a) for a in arrays], np.int64)
    flat = np.concatenate([np.asarray(a, dtype) for a in arrays] + [np.zeros(1, dtype)])
    index, valid = _rows(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths, width)
    return np.where(valid, flat[index], 0).astype(dtype)


def _key(prompt: np.ndarray) -> bytes:
    return np.asarray(prompt, dtype=np.int64).tobytes()


def _rows(starts: np.ndarray, lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """[len(starts), width] stream indices starts[i] + j for j < lengths[i] (0 elsewhere), and validity."""
    j = np.arange(width)[None, :]
    valid = j < lengths[:, None]
    return np.where(valid, starts[:, None] + j, 0), valid


# ---------------------------------------------------------------------------------------- the forward

def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`x[rows]` ([*rows.shape, *x.shape[1:]]) whose backward is bitwise reproducible on every thread count.

    The stream's gathers repeat rows (a prompt's keys serve each sample of its group, its last token predicts
    each sample's first response token). The backward of `x[rows]` adds the repeats with `index_put_(...,
    accumulate=True)`, which PyTorch's CPU kernel runs with atomic float adds across threads once it passes
    32,768 elements: the order of the adds, and so the last bits of the sum, change from run to run.
    `index_select`'s backward is `index_add_`, which adds the rows in index order."""
    return x.index_select(0, rows.reshape(-1)).view(*rows.shape, *x.shape[1:])


_ACTIVE: list[SharedLayout] = []
STREAM_MASK_SHAPE = (1, 1, 1, 1)
"""The attention mask `forward_shared` hands Megatron: it only passes it along (a padded forward's is [1, 1, T, T])."""


@contextlib.contextmanager
def active(layout: SharedLayout) -> Iterator[None]:
    """Every `SharedPromptAttention` runs on `layout` inside the block. With activation recomputation
    (`train.recompute`) the backward runs layers' forwards again, so it must run inside the block too."""
    _ACTIVE.append(layout)
    try:
        yield
    finally:
        _ACTIVE.pop()


def set_backward_layout(layout: SharedLayout | None) -> None:
    """The layout a pipeline stage's recomputed layers attend on while a micro-batch's backward runs (the
    1F1B schedule interleaves micro-batches, so no `active` block spans one's backward); None clears it."""
    _ACTIVE[:] = [] if layout is None else [layout]


def forward_shared(model, layout: SharedLayout, position_ids: torch.Tensor | None = None,
                   decoder_input: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits [S, V_local] for every token of the stream (vocab-parallel like `forward_logits`), or
    [*rows.shape, V_local] for the stream positions `rows` only (`layout.source`: the positions that predict a
    response token); a pipeline stage before the last gives its hidden states [S, 1, H] (`train/pipeline.py`).
    A vision-language model passes its M-RoPE `position_ids` [3, 1, S] and the stream's embeddings with
    the image features in (`decoder_input`, `megatron_model.vision_decoder_input`).

    With `rows`, the output projection runs on those positions' hidden states alone (`_output_at`): a prompt's
    tokens but its last predict nothing the loss reads, and a vocabulary-sized projection of them is most of
    their cost (at Qwen2.5-0.5B's shape a token's logits are 136 M multiply-adds a pass, its 24 layers 360 M)."""
    # the core attention reads the layout, not the mask; Megatron only passes this one along
    unused_mask = torch.zeros(STREAM_MASK_SHAPE, dtype=torch.bool, device=layout.tokens.device)
    positions = layout.positions[None] if position_ids is None else position_ids
    last_stage = getattr(model, "post_process", True)
    with active(layout), _rotary_at(model, layout.positions), _output_at(model if last_stage else None, rows) as picked:
        logits = model(layout.tokens[None], positions, unused_mask, decoder_input=decoder_input)
    if not last_stage:
        return logits
    if rows is None:
        return logits[0]
    return logits[0].view(*rows.shape, logits.shape[-1]) if picked else gather_rows(logits[0], rows)


@contextlib.contextmanager
def _output_at(model, rows: torch.Tensor | None) -> Iterator[bool]:
    """Inside the block `model`'s output layer projects the hidden states of stream positions `rows` only
    (in `rows`' order, flattened); yields whether it does. Not with sequence parallelism, where a rank's hidden
    states are a slice of the stream: the caller gathers the rows of the whole stream's logits instead."""
    layer = None if model is None or rows is None else getattr(model, "output_layer", None)
    if layer is None or getattr(layer, "sequence_parallel", False):
        yield False
        return
    own, project, flat = vars(layer).get("forward"), layer.forward, rows.reshape(-1)
    layer.forward = lambda hidden_states, *args, **kwargs: project(gather_rows(hidden_states, flat), *args, **kwargs)
    try:
        yield True
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own


@contextlib.contextmanager
def _rotary_at(model, positions: torch.Tensor) -> Iterator[None]:
    """A RoPE model's rotary angles at each stream token's own position.

    Megatron's GPTModel asks its RotaryEmbedding for the angles of positions 0..S-1 and applies row s
    to token s; a stream token's position is not its row, so the angles of rows 0..max(position) are
    computed by Megatron's own module (scaling included) and handed out by position instead."""
    rope = getattr(model, "rotary_pos_emb", None)
    if getattr(model, "position_embedding_type", None) != "rope" or rope is None:
        yield
        return
    by_position = rope(int(positions.max()) + 1)[positions]  # [S, 1, 1, rotary dim]
    rope.forward = lambda *args, **kwargs: by_position
    try:
        yield
    finally:
        del rope.forward


class SharedPromptAttention(DotProductAttention):
    """Megatron's local core attention, or, inside `active(layout)`, the shared-prompt attention."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not _ACTIVE:
            if attention_mask is not None and tuple(attention_mask.shape) == STREAM_MASK_SHAPE \
                    and query.shape[0] > 1:
                raise RuntimeError("a shared-prompt stream reached the attention outside `shared_prompt.active`: "
                                   "a recomputed layer's backward must run inside the block of its forward's layout")
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        layout = _ACTIVE[-1]
        if self.config.apply_query_key_layer_scaling or self.config.softmax_type != "vanilla" \
                or self.config.window_size is not None:
            raise NotImplementedError("the shared-prompt attention computes plain scaled softmax attention only")
        # [S, 1, heads, d] -> [S, heads, d]; grouped-query keys repeated as Megatron's attention does
        q, k, v = query[:, 0], key[:, 0], value[:, 0]
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        prompt_out = self._attend(q, k, v, layout.prompt_rows, layout.prompt_rows, layout.prompt_mask)
        response_out = self._attend(q, k, v, layout.response_rows, layout.key_rows, layout.response_mask)
        out = gather_rows(torch.cat([prompt_out, response_out]), layout.unpack)
        return out.view(out.shape[0], 1, self.hidden_size_per_partition)

    def _attend(self, q, k, v, query_rows, key_rows, mask) -> torch.Tensor:
        """[rows * width, heads * d]: SDPA of the gathered queries over the gathered keys."""
        if query_rows.numel() == 0:
            return q.new_zeros(0, self.hidden_size_per_partition)
        qs = gather_rows(q, query_rows).transpose(1, 2)  # [rows, heads, width, d]
        ks, vs = gather_rows(k, key_rows).transpose(1, 2), gather_rows(v, key_rows).transpose(1, 2)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.softmax_scale)
        return out.transpose(1, 2).reshape(-1, self.hidden_size_per_partition)
