"""B12's arithmetic: what a trainer layout puts on the busiest GPU, from the bytes bench/memory_at_scale.py measures.

    from memory_on_paper import QWEN05, PAPER_MODELS, PaperLayout, paper_memory, paper_table
    paper_memory(PAPER_MODELS[2], PaperLayout("tp8 pp4", tp=8, dp=8, pp=4, shard=True, recompute="full"), cal, 16384)

`Shape` is a dense Qwen2.5 decoder's layout (its config.json); `Calibration` holds the measured coefficients (bytes
per parameter held, per token and layer of activations, per token and vocabulary entry of the logits); a
`PaperLayout` is tp, dp, pp, sharding and recomputation. `paper_memory` is the arithmetic (its docstring says what
it counts), `paper_table` its table for Qwen2.5-7B, 32B and 72B at 4k, 16k and 32k tokens a micro-batch. Nothing
here runs a model: bench/memory_at_scale.py measures, calibrates and checks the arithmetic against its measured
pipeline stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GB, MB = 1e9, 1e6
H200_BYTES = 141e9


@dataclass(frozen=True)
class Shape:
    """A dense Qwen2.5 decoder's layout (its config.json)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """One layer: Q/K/V with their biases, the output projection, the SwiGLU MLP, two RMSNorms."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * self.intermediate + 2 * h

    @property
    def vocab_params(self) -> int:
        """The embedding, and the output layer when it is not tied to it."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab_params + self.hidden  # + the final norm

    @property
    def split_width(self) -> int:
        """Width of what a layer keeps per token inside its tensor-parallel part: its attention's query, key,
        value and output (key and value repeated to every head) and its MLP's inputs and outputs, in the
        proportion a local-spec layer saves them, about 3 x hidden + intermediate."""
        return 3 * self.hidden + self.intermediate


QWEN05 = Shape("Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, tied=True)
PAPER_MODELS = [Shape("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, tied=False),
                Shape("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, tied=False),
                Shape("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, tied=False)]
PAPER_TOKENS = (4096, 16384, 32768)


@dataclass(frozen=True)
class Calibration:
    """What the measured layouts give `paper_memory`, in bytes (`calibrate` derives each)."""

    unsharded_per_param: float       # weights and gradients, per parameter a rank holds
    optimizer_per_param: float       # AdamW's moments: what train.shard_optimizer divides by dp
    step_transient: float            # the optimizer step's extra peak, in multiples of the largest tensor
    replicated_per_hidden: float     # activations per token, layer and hidden unit, on every tensor-parallel rank
    split_per_width: float           # ... per unit of `Shape.split_width`, divided over tensor-parallel ranks
    full_kept_per_hidden: float      # what full recomputation keeps per token, layer and hidden unit
    vocab_per_entry: float           # activations per token and vocabulary entry (logits, their gradient)


@dataclass(frozen=True)
class PaperLayout:
    """A trainer layout on paper: tensor, data and pipeline parallel sizes, sharding, recomputation."""

    name: str
    tp: int
    dp: int
    pp: int = 1
    shard: bool = False
    recompute: str = "none"  # "none" or "full"


def paper_memory(shape: Shape, layout: PaperLayout, cal: Calibration, tokens: int) -> dict:
    """Bytes on the busiest GPU of `layout` for `shape` with micro-batches of `tokens` tokens, from `cal`.

    State: a pipeline stage's layers (ceil(layers / pp)) and one vocabulary table (pp = 1: the model's
    embedding and untied output layer), over tp, at `unsharded_per_param` + `optimizer_per_param` (/ dp when
    sharded). Activations per token and layer: `replicated_per_hidden` x hidden + `split_per_width` x
    split_width / tp; full recomputation keeps `full_kept_per_hidden` x hidden per layer plus one layer's
    activations while it is recomputed, which the backward reaches after it has freed the logits' part
    (`vocab_per_entry` x vocab / tp), so the larger of the two counts. Pipeline stages run 1F1B: the first holds
    `pp` micro-batches of its layers in flight, the last one micro-batch and the logits. The optimizer
    step's transient (`step_transient` x the largest tensor, the vocabulary table's shard) and the activations
    are never held at once. Returns {"state", "activations", "total"} in bytes."""
    h, tp, pp = shape.hidden, layout.tp, layout.pp
    stage_layers = math.ceil(shape.layers / pp)
    table = shape.vocab * h
    params = stage_layers * shape.layer_params + (table if pp > 1 else shape.vocab_params)
    per_param = cal.unsharded_per_param + cal.optimizer_per_param / (layout.dp if layout.shard else 1)
    state = params / tp * per_param
    layer = cal.replicated_per_hidden * h + cal.split_per_width * shape.split_width / tp
    vocab = cal.vocab_per_entry * shape.vocab / tp
    if layout.recompute == "full":
        kept = cal.full_kept_per_hidden * h
        first = pp * stage_layers * kept + (max(layer, vocab) if pp == 1 else layer)
        last = stage_layers * kept + max(layer, vocab)
    else:
        first = pp * stage_layers * layer + (vocab if pp == 1 else 0.0)
        last = stage_layers * layer + vocab
    activations = tokens * max(first, last)
    transient = cal.step_transient * table / tp * 4
    return {"state": state, "activations": activations, "total": state + max(activations, transient)}


def largest_tp(shape: Shape, at_most: int = 8) -> int:
    """The largest tensor-parallel size up to `at_most` that divides the query and key/value heads."""
    return max(t for t in range(1, at_most + 1) if shape.heads % t == 0 and shape.kv_heads % t == 0
               and at_most % t == 0)


def paper_layouts(shape: Shape) -> list[PaperLayout]:
    tp = largest_tp(shape)
    base = f"tp{tp}"
    full = f"{base} + sharded dp8 + full recompute"
    return [PaperLayout(base, tp, 8),
            PaperLayout(f"{base} + sharded dp8", tp, 8, shard=True),
            PaperLayout(full, tp, 8, shard=True, recompute="full"),
            PaperLayout(f"{full} + pp2 (arithmetic)", tp, 8, pp=2, shard=True, recompute="full"),
            PaperLayout(f"{full} + pp4 (arithmetic)", tp, 8, pp=4, shard=True, recompute="full")]


def paper_table(cal: Calibration) -> list[dict]:
    return [{"model": shape.name, "params": shape.params, "layout": layout.name, "tp": layout.tp, "pp": layout.pp,
             **{str(t): paper_memory(shape, layout, cal, t) for t in PAPER_TOKENS}}
            for shape in PAPER_MODELS for layout in paper_layouts(shape)]


def paper_cells(paper: list[dict]) -> list[list[str]]:
    def cell(m: dict) -> str:
        return f"{m['total'] / GB:.0f}" + ("" if m["total"] <= SPARE * H200_BYTES else
                                          " (tight)" if m["total"] <= H200_BYTES else " (no)")

    return [[r["model"], r["layout"], f"{r['params'] / 1e9:.1f}", f"{r[str(PAPER_TOKENS[0])]['state'] / GB:.0f}",
             *[cell(r[str(t)]) for t in PAPER_TOKENS]] for r in paper]


PAPER_COLUMNS = ["model", "layout", "params (B)", "state GB", *[f"{t // 1024}k tokens GB" for t in PAPER_TOKENS]]
SPARE = 0.9  # what "fits" leaves of 141 GB: the CUDA context, NCCL's buffers, the caching allocator's slack


def most_tokens(rows: list[dict]) -> tuple[int, dict] | None:
    """The most tokens a micro-batch can hold within SPARE x 141 GB, under the first of `rows` that holds them."""
    fits = [(t, i) for i, r in enumerate(rows) for t in PAPER_TOKENS if r[str(t)]["total"] <= SPARE * H200_BYTES]
    return None if not fits else (lambda t, i: (t, rows[i]))(*max(fits, key=lambda x: (x[0], -x[1])))


def headline(paper: list[dict]) -> str:
    """Per model, the most tokens a micro-batch holds on one H200 without pipeline stages, and with them."""
    parts = []
    for shape in PAPER_MODELS:
        rows = [r for r in paper if r["model"] == shape.name]
        flat, best = most_tokens([r for r in rows if r["pp"] == 1]), most_tokens(rows)
        text = "nothing listed" if flat is None else \
            f"{flat[0] // 1024}k tokens with {flat[1]['layout']} ({flat[1][str(flat[0])]['total'] / GB:.0f} GB)"
        if best and (flat is None or best[0] > flat[0]):
            text += f", {best[0] // 1024}k with pp{best[1]['pp']} ({best[1][str(best[0])]['total'] / GB:.0f} GB)"
        parts.append(f"{shape.name.removeprefix('Qwen2.5-')}: {text}")
    return f"on paper, per H200 with {1 - SPARE:.0%} of 141 GB to spare: " + "; ".join(parts)
