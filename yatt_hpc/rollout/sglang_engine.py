"""SGLang-backed rollout engine: the GPU path, one offline ``sglang.Engine`` per rollout rank.

Run it:   build_engine("sglang", model_dir, device="cuda", tp_size=2, seed=0)   (see engine.py)
Needs:    a CUDA machine with ``pip install -e '.[gpu]'`` (SGLang >= 0.5.3, and ``torch_memory_saver`` for
          ``release_memory``). Importing this module never imports sglang; constructing the engine does.
Test it:  .venv/bin/python -m pytest tests/gpu/test_sglang_engine.py   (skips without CUDA + sglang)

How the contract maps onto SGLang (source read: sglang/srt/entrypoints/engine.py, layers/sampler.py):

* ``generate`` sends token ids (``skip_tokenizer_init=True``: no detokenizing) with ``return_logprob=True``.
  Tokens and logprobs are read from ``meta_info["output_token_logprobs"]`` (one ``(logprob, id, text)``
  per sampled token, eos included). SGLang's default logprob is ``log(softmax(logits / T))`` over the
  whole vocabulary, before top-p: the same quantity ``HFEngine`` returns.
* Per-request seeds need ``deterministic=True``: it sets ``enable_deterministic_inference`` (batch-
  invariant kernels) and the pytorch sampling backend, and sends ``sampling_seed`` (flashinfer sampling
  rejects it). Without it the engine's ``random_seed`` applies and results depend on batching, which is
  SGLang's normal trade of reproducibility for speed.
* ``abort`` schedules ``tokenizer_manager.abort_request(abort_all=True)`` on the engine's event loop from
  the calling thread (``generate`` blocks in ``loop.run_until_complete``); aborted requests come back
  with finish reason ``abort`` and their tokens so far.
* ``update_weights`` -> ``update_weights_from_tensor(bucket, flush_cache=final)``; ``join_weight_group`` and
  ``update_weights_from_group`` -> ``init_weights_update_group`` and ``update_weights_from_distributed``
  (the trainer owner broadcasts each bucket device to device). All in ``sglang_weights.SGLangWeights``:
  the radix cache is flushed once per version, names and shapes are checked first against the
  checkpoint's safetensors headers. For tied embeddings SGLang skips ``lm_head.weight``: send the
  embedding, as ``save_pretrained`` and Megatron-to-HF converters do.
* ``record_routing=True`` (train.moe_routing_replay) starts SGLang with ``enable_return_routed_experts`` and asks
  every request for ``return_routed_experts``; ``meta_info["routed_experts"]`` (base64 int32 [seqlen - 1, layers,
  top k]) becomes the result's ``routed_experts`` column (`routing_record.routed_experts_from_sglang`). The layer
  and top-k counts are config.json's ``num_hidden_layers`` and ``num_experts_per_tok``.
* ``release_memory`` releases weights, KV cache and CUDA graphs (``enable_memory_saver=True``);
  ``resume_memory`` takes the weights back first, then KV cache and CUDA graphs, so the peak is weights
  + cache. An ``update_weights`` while released resumes just the weights before loading into them.
  ``weights_cpu_backup=True`` keeps a host copy so release/resume without an update keeps the weights;
  colocated loops that always update after resume can turn it off to save host memory.
* Signals (managers/tokenizer_manager.py): the tokenizer manager registers, on its first request, SIGTERM
  on the engine's event loop (``auto_create_handle_loop``): drain, then ``kill_process_tree`` SIGKILLs the
  children and this process, so a preemption would kill the rank before it saves. The constructor has it
  register now, takes SIGTERM back off the loop and restores the handler that was there before (SIGQUIT,
  a failed child, stays SGLang's); the worker then checks all of them (``runtime/signals.StopFlag.reclaim``).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import signal
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from yatt_hpc.device.weight_group import BucketManifest, Rendezvous
from yatt_hpc.rollout.engine import BaseEngine, GenerationRequest, GenerationResult
from yatt_hpc.rollout.routing_record import routed_experts_from_sglang
from yatt_hpc.rollout.sglang_weights import SGLangWeights

_INSTALL_HINT = (
    "engine 'sglang' needs SGLang on a CUDA machine: install the GPU extra with "
    "`pip install -e '.[gpu]'` (yatt-hpc[gpu]); on a CPU-only machine use engine 'hf'"
)
# Memory tags of sglang.srt.constants (GPU_MEMORY_TYPE_*); resume order matters, see module docstring.
_WEIGHTS, _KV_CACHE, _CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"


def checkpoint_tensor_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """HF names and shapes in ``model_dir``'s safetensors files, read from their headers (no tensor loads).

    A tied ``lm_head.weight`` that the checkpoint omits is listed with the embedding's shape, so a
    trainer that sends it passes validation (SGLang then ignores it: it is the embedding).
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"engine 'sglang': no *.safetensors in model_dir={model_dir!r}; save with safe_serialization=True")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    config = _read_config(model_dir)
    text = config.get("text_config", config)
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
    if tied and "lm_head.weight" not in shapes:
        embeddings = [name for name in shapes if name.endswith(("embed_tokens.weight", "wte.weight"))]
        if len(embeddings) == 1:
            shapes["lm_head.weight"] = shapes[embeddings[0]]
    return shapes


def _read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def routing_shape(model_dir: str) -> tuple[int, int]:
    """(MoE layers, top k) of a policy whose routing SGLang records: config.json's ``num_hidden_layers`` and
    ``num_experts_per_tok`` (every layer a MoE layer: the converter refuses ``mlp_only_layers``)."""
    config = _read_config(model_dir)
    if not config.get("num_experts_per_tok"):
        raise ValueError(f"train.moe_routing_replay=true but {model_dir}/config.json has no num_experts_per_tok (a "
                         "dense model): routing replay needs a mixture-of-experts policy; set "
                         "train.moe_routing_replay=false")
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])


def result_from_sglang_output(request: GenerationRequest, output: dict, weight_version: int,
                              routing: tuple[int, int] | None = None) -> GenerationResult:
    """Turn one ``sglang.Engine.generate`` output dict into a :class:`GenerationResult`; with `routing` (MoE layers,
    top k) its ``meta_info["routed_experts"]`` becomes the result's ``routed_experts``."""
    meta = output["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    reason = (meta.get("finish_reason") or {}).get("type")
    response = np.asarray([int(token) for _, token, *_ in pairs], dtype=np.int32)
    # SGLang reports errors (e.g. a request it rejected) as aborts too; anything unfinished is one.
    finish = reason if reason in ("stop", "length") else "abort"
    routed = None if routing is None else routed_experts_from_sglang(
        meta, len(request.prompt_ids), len(response), *routing, aborted=finish == "abort")
    return GenerationResult(
        sample_id=request.sample_id,
        prompt_ids=request.prompt_ids,
        response_ids=response,
        logprobs=np.asarray([float(logprob) for logprob, *_ in pairs], dtype=np.float32),
        finish_reason=finish,
        weight_version=weight_version,
        routed_experts=routed,
    )


def drop_sigterm_drain(engine) -> None:
    """Create the tokenizer manager's event loop now, take its SIGTERM handler off it and put back the
    process's own (see the module docstring). Off the main thread SGLang registers no signal handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    before = signal.getsignal(signal.SIGTERM)
    manager = engine.tokenizer_manager
    manager.auto_create_handle_loop()
    manager.event_loop.remove_signal_handler(signal.SIGTERM)  # which leaves SIG_DFL: death on SIGTERM
    if before is not None:  # None: a handler installed outside Python, which removing cannot give back
        signal.signal(signal.SIGTERM, before)


class SGLangEngine(BaseEngine):
    """One ``sglang.Engine`` (tp_size GPUs from ``device``'s index on) behind ``BaseEngine``."""

    def __init__(
        self,
        model_dir: str,
        *,
        device: str = "cuda",
        tp_size: int = 1,
        seed: int = 0,
        mem_fraction_static: float = 0.8,
        enable_memory_saver: bool = True,
        weights_cpu_backup: bool = True,
        deterministic: bool = False,
        dtype: str = "auto",
        record_routing: bool = False,
        **engine_kwargs: object,
    ) -> None:
        """``engine_kwargs`` go to ``sglang.Engine`` unchanged (any ``ServerArgs`` field). ``record_routing``: each
        result carries the experts the MoE model's routers chose (module docstring; train.moe_routing_replay)."""
        target = torch.device(device)
        if target.type != "cuda":
            raise ValueError(f"engine 'sglang' runs on CUDA devices only, got device={device!r}; use engine 'hf' on CPU")
        self._image_pad = image_token_id_of(model_dir)
        self._routing = routing_shape(model_dir) if record_routing else None
        try:
            import sglang
        except ImportError as error:
            raise ImportError(_INSTALL_HINT) from error
        self._shapes = checkpoint_tensor_shapes(model_dir)
        self._seed = seed
        self._deterministic = deterministic
        self._memory_saver = enable_memory_saver
        kwargs: dict[str, object] = {
            "model_path": model_dir,
            "tp_size": tp_size,
            "random_seed": seed,
            "mem_fraction_static": mem_fraction_static,
            "enable_memory_saver": enable_memory_saver,
            "dtype": dtype,
            "skip_tokenizer_init": True,  # token ids in and out: no detokenizer work
        }
        if target.index is not None:
            kwargs["base_gpu_id"] = target.index
        if enable_memory_saver and weights_cpu_backup:
            kwargs["enable_weights_cpu_backup"] = True
        if deterministic:
            kwargs.update(enable_deterministic_inference=True, sampling_backend="pytorch")
        if record_routing:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(engine_kwargs)
        self._engine = sglang.Engine(**kwargs)
        self._device = torch.device("cuda", target.index or 0)
        drop_sigterm_drain(self._engine)
        self._released: set[str] = set()
        self._weights = SGLangWeights(self._engine, self._shapes, self._device, before_load=self._resume_weights)
        self._lock = threading.Lock()
        self._in_flight = False

    # -- generation ---------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest],
                 on_result: Callable[[GenerationResult], None] | None = None,
                 on_step: Callable[[], None] | None = None) -> list[GenerationResult]:
        """``on_result`` is called for every result once the whole call is done: the offline batch API
        returns them together (SGLang's streaming API would report each request as it finishes). The
        decode loop runs in SGLang's scheduler process, so ``on_step`` is never called
        (`reports_while_decoding` is False)."""
        self._check_ready()
        if not requests:
            return []
        with self._lock:
            assert not self._in_flight, "SGLangEngine.generate is not re-entrant"
            self._in_flight = True
        try:
            outputs = self._engine.generate(
                sampling_params=[self._sampling_params(r) for r in requests],
                return_logprob=True,
                **({"return_routed_experts": True} if self._routing else {}),
                **sglang_prompt_inputs(requests, self._image_pad),
            )
        finally:
            with self._lock:
                self._in_flight = False
        results = [result_from_sglang_output(r, out, self._weights.version, self._routing)
                   for r, out in zip(requests, outputs)]
        for result in results if on_result is not None else ():
            on_result(result)
        return results

    def _sampling_params(self, request: GenerationRequest) -> dict:
        params = {"max_new_tokens": request.max_new_tokens, "temperature": request.temperature, "top_p": request.top_p}
        if self._deterministic:
            params["sampling_seed"] = request.effective_seed(self._seed)
        return params

    def abort(self) -> None:
        with self._lock:
            if self._in_flight:
                manager = self._engine.tokenizer_manager
                self._engine.loop.call_soon_threadsafe(functools.partial(manager.abort_request, abort_all=True))

    # -- weights ------------------------------------------------------------------------------------

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool, version: int | None = None
    ) -> None:
        self._check_alive()
        self._weights.load_tensors(list(named_tensors), final=final, version=version)

    def join_weight_group(self, rendezvous: Rendezvous) -> None:
        self._check_alive()
        self._weights.join_group(rendezvous)

    def update_weights_from_group(self, manifest: BucketManifest, *, version: int | None = None) -> None:
        self._check_alive()
        self._weights.load_from_group(manifest, version=version)

    @property
    def weight_version(self) -> int:
        return self._weights.version

    @property
    def _mid_update(self) -> bool:
        return self._weights.mid_update

    def _resume_weights(self) -> None:
        """An update while released resumes just the weights before loading into them."""
        if _WEIGHTS in self._released:
            self._resume([_WEIGHTS])

    # -- memory and lifecycle -----------------------------------------------------------------------

    def release_memory(self) -> None:
        self._check_alive()
        if not self._memory_saver:
            raise RuntimeError("SGLangEngine.release_memory needs the engine built with enable_memory_saver=True")
        if not self._released:
            self._engine.release_memory_occupation()
            self._released = {_WEIGHTS, _KV_CACHE, _CUDA_GRAPH}

    def resume_memory(self) -> None:
        """Weights first (unless an update already brought them back), then KV cache and CUDA graphs."""
        self._check_alive()
        if _WEIGHTS in self._released:
            self._resume([_WEIGHTS])
        if self._released:
            self._resume(sorted(self._released))

    def _resume(self, tags: list[str]) -> None:
        self._engine.resume_memory_occupation(tags=tags)
        self._released -= set(tags)

    def shutdown(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is None:
            return
        self._engine = None
        engine.shutdown()

    @property
    def _alive(self) -> bool:
        return self._engine is not None


def image_token_id_of(model_dir: str) -> int | None:
    """The checkpoint's image-pad id (a vision-language model), else None."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return config.get("image_token_id") if "vision_config" in config else None


def sglang_prompt_inputs(requests: Sequence[GenerationRequest], image_token_id: int | None) -> dict:
    """`Engine.generate` keyword arguments for `requests`: `input_ids`, and for requests with images
    `image_data` (base64 data URLs of the encoded bytes) with every image's pad run collapsed to one pad,
    which SGLang expands itself from the image it processes (a pre-expanded run would be expanded twice)."""
    import base64

    if not any(r.images for r in requests):
        return {"input_ids": [r.prompt_ids.tolist() for r in requests]}
    if image_token_id is None:
        raise ValueError("requests carry images but the SGLang engine's model has no vision tower (config.json has "
                         "no vision_config); use a vision-language model")
    ids, images = [], []
    for r in requests:
        run = np.r_[False, r.prompt_ids[1:] == r.prompt_ids[:-1]] & (r.prompt_ids == image_token_id)
        ids.append(r.prompt_ids[~run].tolist())
        images.append([f"data:image;base64,{base64.b64encode(b).decode()}" for b in r.images])
    return {"input_ids": ids, "image_data": images}
