"""transformers-backed rollout engine: CPU, or one GPU; the engine every CPU test and demo uses.

Run it:    build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0)   (see engine.py)
Test it:   .venv/bin/python -m pytest tests/unit/test_hf_engine.py   (weights by broadcast, real Gloo groups:
           tests/mpi/test_weight_collective.py)
Measure:   .venv/bin/python bench/bench_hf_engine.py

Design choices (``bench/bench_hf_engine.py --threads 1`` on the 2-core build machine; 32 requests x 32
new tokens, tiny GPT-2 h32/L2/V64: 36 ms = 28k tok/s vs 47 ms for ``model.generate``; Llama h128/L4/V512:
123 ms vs 153 ms):

* Own decode loop over ``model(...)`` with a KV cache instead of ``model.generate``: generate draws
  from the process-global RNG, so a sample would depend on its batch neighbours; here every request
  draws its ``max_new_tokens`` uniforms up front from its own ``torch.Generator(seed)`` and each step
  samples all rows at once by inverse CDF. Per-request seeding then costs ~0.13 ms per generate call
  (the draws) + ~0.02 ms per step over a global-RNG ``torch.multinomial`` (~2% of the 36 ms above);
  a per-row ``multinomial(generator=...)`` would cost ~0.4 ms more per step (+36%). Tokens are identical
  whatever the batch order or composition; logprobs agree to ~5e-7 (padding changes fp32 summation order).
* Logprobs come from the very logits the token was sampled from: ``log_softmax(logits / T)`` over the
  whole vocabulary (T=1 for greedy). That is what the trainer recomputes with a teacher-forced forward
  pass (max difference 4.8e-7 on the tiny test model, at T=1 and T=0.7) and what SGLang returns by
  default, so no second forward pass is spent. Top-p truncation only restricts which tokens can be
  drawn; it is not folded into the logprob (the trainer could not recompute it either).
* torch's intra-op threads must not outnumber the cores a rank owns: with 2 threads on 2 busy cores the
  same generate took 0.25-5 s instead of 36 ms. Whoever launches ranks sets ``OMP_NUM_THREADS``.
* Requests are sorted by prompt length and cut into micro-batches of ``max_batch_size``: less left
  padding. A micro-batch sheds its finished rows (their KV cache rows too) once they are 1/8 of the rows
  it computes: a long-tail batch (128 rows, P(eos) 0.02 per token, lengths p50 26 / max 256, a 64-wide
  GPT-2) took 1.32 s when finished rows rode along to the end and takes 0.82 s (2 threads; 1 thread
  1.61 -> 0.85 s). A shed moves the last live rows into the finished rows' places (`micro_batch.live_rows`), so
  the cache copies only those rows, in place (B4's wave: ~10 ms less a call on one thread, the same on
  two). A row's tokens are still those it draws alone (the test holds them equal).
* A prompt group's n requests share their prompt: the prefill computes each distinct prompt (tokens
  and images) once, and its KV cache rows are then repeated, one per request (`micro_batch.distinct_prompts`).
  B4's wave (16 prompts x 8 samples): first decode step 18 -> 4.5 ms on one thread, 12 -> 4 ms on two.
* A decode step of a long tail's last rows is mostly per-op cost (B4's wave: ~140 of its ~250 steps
  decode under 16 rows), so a step issues only the ops every row needs: no per-row length (a running row
  has step + 1 tokens), one mask buffer viewed per step, finished rows counted in Python, the sampler's
  short path when every row is at temperature 1 without top-p, and the native model's decode without
  module calls. B4's wave 0.20 -> 0.14 s on one thread (0.19 -> 0.13 on two; a step of under 16 rows
  0.60 -> 0.36 ms); tokens and logprobs bit for bit the same (sampling mixes, greedy, limits, abort).
* A vision-language checkpoint (Qwen2-VL) loads as ``AutoModelForImageTextToText``. A request's encoded
  images are decoded once per generate call (the n requests of a group share them) into pixel values
  by ``vision/processor.py``; the prefill gets them with their grids and the M-RoPE positions of each
  left-padded row, and decoding continues every row's three position axes from its last position.
* ``release_memory`` on CUDA moves the weights to host memory and empties the CUDA cache; on CPU it is
  a no-op, because the weights would have to stay in host memory anyway and there is no accelerator
  memory to give back. There is no KV cache between calls (one per micro-batch), so
  ``resume_memory`` only moves the weights back: weights-before-cache holds trivially.
* A GPT-2 checkpoint whose config.json states every setting is served by ``native_gpt2.py``: the same
  function and parameter names in plain torch, without importing transformers (a rollout rank serving
  the demo is ready ~2.5 s of CPU sooner, and the demo's 4-rank start -> step 1 went 8.0 -> 5.0 s with
  the trainer's own cuts). Anything else (other architectures, Qwen2-VL, a model built in memory)
  goes through transformers; the rank's log says which and why.
* Through transformers, the model runs the same function faster (``hf_fast.py``): GPT-2's Python GELU
  as torch's one kernel, a KV cache written in place instead of re-concatenated every step, and the
  one-token attention of a decode step as two strided ``bmm`` calls instead of SDPA (a 128-row x
  48-token decode of a 256-wide GPT-2: 2.53 -> 2.00 s, one thread).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from yatt_hpc.device.offload import HostParking
from yatt_hpc.device.weight_group import PairGroup
from yatt_hpc.metrics.activity import ACTIVITY
from yatt_hpc.models.hf_experts import expert_slots
from yatt_hpc.rollout.engine import (
    BaseEngine,
    GenerationRequest,
    GenerationResult,
)
from yatt_hpc.rollout.hf_weights import HFWeightUpdates
from yatt_hpc.rollout.micro_batch import distinct_prompts, live_rows, shed
from yatt_hpc.rollout.native_gpt2 import load_native, why_not_native
from yatt_hpc.rollout.routing_record import RoutingRecorder
from yatt_hpc.rollout.sampling import draw_uniforms, sample_next_tokens
from yatt_hpc.vision.processor import ImageProcessor, decode_rgb, is_vision_model

log = logging.getLogger(__name__)

# A micro-batch sheds its finished rows once they are at least 1/COMPACT_FRACTION of the rows it still computes.
COMPACT_FRACTION = 8


class HFEngine(HFWeightUpdates, BaseEngine):
    """One transformers ``AutoModelForCausalLM`` replica (tp_size must be 1; use ``sglang`` for TP)."""

    reports_while_decoding = True  # the decode loop runs on the caller's thread

    def __init__(
        self,
        model_dir: str | torch.nn.Module,
        *,
        device: str = "cpu",
        tp_size: int = 1,
        seed: int = 0,
        dtype: str | None = None,
        max_batch_size: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        record_routing: bool = False,
    ) -> None:
        """``model_dir``: an HF model directory, or an already built causal LM. ``dtype``: e.g. "float32" /
        "bfloat16", None keeps the checkpoint's. ``max_batch_size``: rows
        per decode micro-batch. ``stop_token_ids``: tokens that end a response; None takes the model's
        eos ids from generation_config.json / config.json. ``record_routing``: each result carries the experts a MoE
        model's routers chose for its tokens (`routing_record.py`; train.moe_routing_replay)."""
        if tp_size != 1:
            raise ValueError(f"engine 'hf' runs one device per replica: tp_size={tp_size}; set tp_size=1 or use 'sglang'")
        if max_batch_size < 1:
            raise ValueError(f"HFEngine max_batch_size={max_batch_size}; it must be >= 1")
        self._device = torch.device(device)
        model = None if isinstance(model_dir, torch.nn.Module) else load_native(model_dir, dtype)
        self._native = model is not None
        if self._native:  # GPT-2 in plain torch (native_gpt2.py): transformers is never imported
            self._vision = None
            self._vocab_size, self._max_positions = model.shape.vocab_size, model.shape.max_positions
            default_stop = list(model.shape.eos_token_ids)
        else:
            model = self._load_transformers(model_dir, dtype)
            text = model.config.get_text_config()
            self._vocab_size, self._max_positions = int(text.vocab_size), getattr(text, "max_position_embeddings", None)
            default_stop = self._model_eos(model)
        in_memory = isinstance(model_dir, torch.nn.Module)
        log.info("engine 'hf' serves %s %s", "a model built in memory" if in_memory else model_dir,
                 "with the native GPT-2 forward" if self._native else
                 f"through transformers ({'built in memory' if in_memory else why_not_native(model_dir)})")
        self._model = model.to(self._device).eval()
        self._recorder = RoutingRecorder(self._model) if record_routing else None
        self._seed = seed
        self._max_batch_size = max_batch_size
        self._stop_ids = torch.tensor(sorted(self._resolve_stop_ids(default_stop if stop_token_ids is None
                                                                    else stop_token_ids)), dtype=torch.long)
        self._state_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        # a MoE model's experts arrive under their checkpoint names, one expert each (models/hf_experts.py)
        self._expert_slots = expert_slots(self._state_shapes)
        self._state_shapes.update({name: slot[3] for name, slot in self._expert_slots.items()})
        self._tied = self._tied_name_groups(model)
        self._version = 0
        self._mid_update = False
        self._released = False
        self._parking = HostParking()
        # drop_weights (CPU colocation): parameter name -> shape while its memory is given back; fused expert
        # parameters being refilled -> the expert names written so far (hf_weights.py)
        self._dropped: dict[str, tuple[int, ...]] = {}
        self._refilling: dict[str, set[str]] = {}
        self._adopting = False  # inside take_weights: a dropped parameter may keep the tensor received for it
        self._lock = threading.Lock()
        self._in_flight = False
        self._abort = threading.Event()
        self._groups: dict[str, PairGroup] = {}  # weight groups joined, by name (one per sending owner)

    def _load_transformers(self, model_dir: str | torch.nn.Module, dtype: str | None) -> torch.nn.Module:
        """Any other checkpoint (or a model built in memory) through transformers, with hf_fast's paths."""
        from yatt_hpc.rollout.hf_fast import fuse_activations, use_decode_attention, use_onednn_linears

        if isinstance(model_dir, torch.nn.Module):  # a model built in memory (tools/make_demo_models.py)
            model = model_dir if dtype is None else model_dir.to(getattr(torch, dtype))
        else:
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

            auto = AutoModelForImageTextToText if is_vision_model(model_dir) else AutoModelForCausalLM
            model = auto.from_pretrained(model_dir, dtype=getattr(torch, dtype) if dtype else "auto")
        fuse_activations(model)  # the same GELU, one kernel (as the trainer's)
        use_decode_attention(model)  # decode steps' attention as two bmm calls (hf_fast.py)
        use_onednn_linears(model)  # fp32 projections through oneDNN's matmul (hf_fast.py)
        self._vision = ImageProcessor.from_hf_config(model.config) if hasattr(model.config, "vision_config") else None
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; take whichever this version has.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_last_logits = "logits_to_keep" in params
        return model

    # -- generation ---------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest],
                 on_result: Callable[[GenerationResult], None] | None = None,
                 on_step: Callable[[], None] | None = None) -> list[GenerationResult]:
        """Micro-batches of up to max_batch_size requests (shortest prompts first); ``on_result`` gets
        a row at the decode step it finishes (the micro-batch goes on decoding the others), ``on_step``
        is called after every decode step."""
        self._check_ready()
        if self._dropped:
            raise RuntimeError(f"HFEngine.generate after drop_weights(): {len(self._dropped)} parameters wait for the "
                               "weight sync that refills them")
        for request in requests:
            self._check_request(request)
        with self._lock:
            assert not self._in_flight, "HFEngine.generate is not re-entrant"
            self._in_flight = True
            self._abort.clear()
        try:
            order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
            results: list[GenerationResult | None] = [None] * len(requests)
            for start in range(0, len(order), self._max_batch_size):
                chunk = order[start : start + self._max_batch_size]
                for i, result in zip(chunk, self._generate_batch([requests[i] for i in chunk], on_result, on_step)):
                    results[i] = result
            return results  # type: ignore[return-value]
        finally:
            with self._lock:
                self._in_flight = False
                self._abort.clear()

    def abort(self) -> None:
        """Unfinished rows stop at the next decode step; micro-batches not started return empty ``abort``s."""
        with self._lock:
            if self._in_flight:
                self._abort.set()

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest],
                        on_result: Callable[[GenerationResult], None] | None = None,
                        on_step: Callable[[], None] | None = None) -> list[GenerationResult]:
        """One micro-batch. Per decode step only what every row needs is computed on tensors (a step
        of a long tail's last rows is mostly per-op cost): a running row has `step + 1` tokens, so no
        length is kept; the attention mask is a view of one buffer (the prompt's padding, then ones);
        rows finishing, and how many of the rows computed are finished, are counted in Python."""
        device, rows = self._device, len(requests)
        distinct, repeats = distinct_prompts(requests)  # a group's n requests share one prompt: prefilled once
        input_ids, prompt_mask = self._left_pad([requests[i].prompt_ids for i in distinct])
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        prefill = {}
        if self._vision is not None:
            positions, prefill = self._vision_prefill([requests[i] for i in distinct], input_ids, prompt_mask)
        temperature, top_p = (torch.tensor([getattr(r, k) for r in requests], dtype=torch.float32, device=device)
                              for k in ("temperature", "top_p"))
        plain = all(r.temperature == 1 and r.top_p >= 1 for r in requests)  # the sampler's short path
        limit = torch.tensor([r.max_new_tokens for r in requests], device=device)
        uniforms = draw_uniforms(requests, self._seed).to(device)
        steps, width = uniforms.shape[1], input_ids.shape[1]
        mask = torch.ones(len(distinct), width + steps, dtype=prompt_mask.dtype, device=device)
        mask[:, :width] = prompt_mask  # step s attends to mask[:, :width + s]
        tokens, logprobs = (torch.zeros(rows, steps, dtype=t, device=device) for t in (torch.long, torch.float32))
        cache = self._new_cache(width + steps)
        stop_ids = self._stop_ids.to(device)
        results: list[GenerationResult | None] = [None] * rows
        present = torch.arange(rows, device=device)  # the request computed at each row, in cache order
        done = torch.zeros(rows, dtype=torch.bool, device=device)  # per row computed: finished
        finished = 0  # rows computed that are finished (they ride along until a shed)
        routed = None if self._recorder is None else self._recorder.buffer(rows, steps)
        # each request's prompt experts: unrouted (-1) until the prefill runs (an abort may come first)
        prefill_routed = [] if routed is None else [self._recorder.buffer(1, len(r.prompt_ids))[0] for r in requests]

        def report(places: torch.Tensor, length: int, stop: list[bool], ended: bool) -> None:
            for i, stopped in zip(present[places].tolist(), stop):
                results[i] = self._result(requests[i], tokens[i, :length], logprobs[i, :length], stopped, ended,
                                          None if routed is None else torch.cat([prefill_routed[i], routed[i, :length]]))
                if on_result is not None:
                    on_result(results[i])

        for step in range(steps):
            if self._abort.is_set():
                break
            logits = self._forward(input_ids, mask[:, :width + step], positions, cache, prefill if step == 0 else {})
            if routed is not None and step:  # the experts of the tokens sampled at the step before
                routed[present.cpu(), step - 1] = self._recorder.take(len(present))[:, 0]
            elif routed is not None:  # the prefill's, each request's prompt positions of its distinct row
                prefill_routed = self._prompt_routing(requests, len(distinct), repeats, width)
            if step == 0 and repeats is not None:  # every request its own row from here on
                positions, logits, mask = shed(repeats.to(device), cache, positions, logits, mask)
            ACTIVITY.progress()  # one decode step: the health monitor sees a long generation move
            token, logprob = sample_next_tokens(logits, temperature, top_p, uniforms[:, step], plain)
            tokens[present, step], logprobs[present, step] = token, logprob
            stop_now = torch.isin(token, stop_ids)
            end_now = (stop_now | (limit <= step + 1)) & ~done  # the rows that finish at this step
            if bool(end_now.any()):
                places = end_now.nonzero().squeeze(1)
                done[places] = True
                finished += len(places)
                report(places, step + 1, stop_now[places].tolist(), True)
            if on_step is not None:
                on_step()
            if finished == len(present):
                return results  # type: ignore[return-value]
            input_ids = token[:, None]
            positions = positions[..., -1:] + 1
            if finished and finished * COMPACT_FRACTION >= len(present):  # a long tail decodes its last rows alone
                positions, present, input_ids, mask, temperature, top_p, limit, uniforms = shed(
                    live_rows(~done), cache, positions, present, input_ids, mask, temperature, top_p, limit, uniforms)
                done, finished = torch.zeros(len(present), dtype=torch.bool, device=device), 0
        else:
            step = steps
        live = (~done).nonzero().squeeze(1)  # aborted: the rows still running have `step` tokens each
        report(live, step, [False] * len(live), False)
        return results  # type: ignore[return-value]

    def _prompt_routing(self, requests: list[GenerationRequest], rows: int, repeats: torch.Tensor | None,
                        width: int) -> list[torch.Tensor]:
        """Each request's prompt tokens' experts in the prefill just run (`rows` distinct prompts, left-padded to
        `width`; `repeats`: each request's row, None when every request has its own)."""
        prefill = self._recorder.take(rows, width)
        row_of = range(len(requests)) if repeats is None else repeats.tolist()
        return [prefill[row, width - len(r.prompt_ids):] for r, row in zip(requests, row_of)]

    def _vision_prefill(self, requests: list[GenerationRequest], input_ids: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """M-RoPE positions [3, B, W] of the left-padded rows, and the prefill's image inputs."""
        vision, memo = self._vision, {}
        per_row = []
        for request in requests:
            key = tuple(request.images)
            if key and key not in memo:  # a group's n requests share one decode
                memo[key] = vision.pixel_inputs([decode_rgb(b, f"request {request.sample_id}") for b in key])
            per_row.append(memo[key] if key else (None, np.zeros((0, 3), np.int64)))
        positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
        for row, (request, (_, grids)) in enumerate(zip(requests, per_row)):
            vision.check_tokens(request.prompt_ids, grids, f"request sample_id={request.sample_id}")
            width = len(request.prompt_ids)
            positions[:, row, -width:] = torch.from_numpy(vision.mrope_positions(request.prompt_ids, grids))
        with_images = [r for r in per_row if r[0] is not None]
        extra = {"mm_token_type_ids": (input_ids == vision.image_token_id).long()}
        if with_images:
            extra["pixel_values"] = torch.from_numpy(np.concatenate([p for p, _ in with_images])).to(self._device)
            extra["image_grid_thw"] = torch.from_numpy(np.concatenate([g for _, g in with_images])).to(self._device)
        return positions.to(self._device), extra

    def _new_cache(self, capacity: int):
        if self._native:
            return self._model.new_cache(capacity)
        from yatt_hpc.rollout.hf_fast import preallocated_cache

        return preallocated_cache(self._model.config, capacity)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
                 extra: dict | None = None) -> torch.Tensor:
        if self._native:
            return self._model.last_logits(input_ids, mask, positions, cache)
        kwargs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions, "use_cache": True,
                  **(extra or {})}
        kwargs[self._cache_kwarg] = cache
        if self._keep_last_logits:
            kwargs["logits_to_keep"] = 1
        return self._model(**kwargs).logits[:, -1, :]

    def _left_pad(self, prompts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        # Left padding keeps every row's next token in the last column; pad id 0 is masked out.
        width = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), width), dtype=np.int64)
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        return torch.from_numpy(ids).to(self._device), torch.from_numpy(mask).to(self._device)

    def _result(self, request: GenerationRequest, tokens: torch.Tensor, logprobs: torch.Tensor, stopped: bool,
                done: bool, routed: torch.Tensor | None = None) -> GenerationResult:
        reason = "stop" if stopped else ("length" if done else "abort")
        return GenerationResult(
            sample_id=request.sample_id,
            prompt_ids=request.prompt_ids,
            response_ids=tokens.cpu().numpy().astype(np.int32),
            logprobs=logprobs.cpu().numpy().astype(np.float32),
            finish_reason=reason,
            weight_version=self._version,
            routed_experts=None if routed is None else routed.numpy(),
        )

    @staticmethod
    def _model_eos(model: torch.nn.Module) -> list[int]:
        """A transformers model's eos ids: its generation config's, else its config's."""
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config.get_text_config(), "eos_token_id", None)
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def _resolve_stop_ids(self, stop_token_ids: Sequence[int]) -> set[int]:
        # An eos id outside the vocabulary can never be sampled (tiny test models keep GPT-2's 50256).
        return {int(t) for t in stop_token_ids if 0 <= int(t) < self._vocab_size}

    # -- memory and lifecycle -----------------------------------------------------------------------

    def release_memory(self) -> None:
        """CUDA: weights to reused pinned host buffers, then ``empty_cache``. CPU: nothing to give back."""
        self._check_alive()
        if self._device.type == "cuda" and not self._released:
            self._parking.release([self._model])
        self._released = True

    def resume_memory(self) -> None:
        """CUDA: weights back to the device. The KV cache is allocated per generate call, i.e. after."""
        self._check_alive()
        if self._device.type == "cuda" and self._released:
            self._parking.resume([self._model], None, self._device)
        self._released = False

    def shutdown(self) -> None:
        if getattr(self, "_model", None) is None:
            return
        self._model = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def _alive(self) -> bool:
        return self._model is not None

    def _check_request(self, request: GenerationRequest) -> None:
        if request.images and self._vision is None:
            raise ValueError(f"request sample_id={request.sample_id} has {len(request.images)} image(s) but the "
                             "engine's model is a text model; use a vision-language model (Qwen2-VL)")
        if int(request.prompt_ids.max()) >= self._vocab_size:
            raise ValueError(
                f"request sample_id={request.sample_id}: token id {int(request.prompt_ids.max())} "
                f"is outside the vocabulary (size {self._vocab_size})"
            )
        total = len(request.prompt_ids) + request.max_new_tokens
        if self._max_positions is not None and total > self._max_positions:
            raise ValueError(
                f"request sample_id={request.sample_id}: prompt ({len(request.prompt_ids)}) + max_new_tokens "
                f"({request.max_new_tokens}) = {total} exceeds the model's {self._max_positions} positions"
            )
