"""The inference-engine interface every rollout controller talks to.

Use it (any kind; the controller code does not change between them):

    from yatt_hpc.rollout import GenerationRequest, build_engine

    engine = build_engine("hf", "/path/to/hf_model", device="cpu", tp_size=1, seed=0)
    results = engine.generate([GenerationRequest(sample_id=0, prompt_ids=[1, 2, 3], max_new_tokens=32)])
    engine.update_weights(bucket_0, final=False)   # buckets of (hf_name, tensor) from the trainer
    engine.update_weights(bucket_1, final=True)    # the last bucket of a version
    engine.join_weight_group(rendezvous)           # or by broadcast over the pair's process group:
    engine.update_weights_from_group(manifest)     # (yatt_hpc/device/weight_group.py), one call per bucket
    engine.shutdown()

Tests: ``pytest tests/unit/test_hf_engine.py`` (CPU) and ``pytest tests/gpu/test_sglang_engine.py`` (CUDA + sglang).

One rollout rank (an MPI process) owns one engine replica. ``hf`` is transformers (CPU, or one GPU);
``sglang`` is SGLang's offline ``sglang.Engine`` (GPUs, tensor parallel). Both return, per sampled token,
its log-probability under the temperature-scaled full-vocabulary distribution, so the trainer's "old
logprobs" mean the same thing whichever engine produced them.
"""

from __future__ import annotations

import abc
import difflib
import importlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from typing_extensions import Self  # noqa: UP035 - typing.Self is 3.11+, setup.py allows 3.10

if TYPE_CHECKING:
    from yatt_hpc.device.weight_group import BucketManifest, Rendezvous

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
ENGINE_KINDS: tuple[str, ...] = ("hf", "sglang")
# Test hook, never a user setting: tests.programs.<module>:<class> wraps every engine built (see build_engine).
TEST_WRAPPER_ENV = "YATT_TEST_ENGINE_WRAPPER"
log = logging.getLogger(__name__)

# Seeds travel to SGLang as int64 and into torch.Generator.manual_seed; below 2**63 suits both.
_SEED_LIMIT = 2**63


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to sample one response for.

    ``seed`` makes the sample reproducible on its own: the same request with the same seed gives the
    same tokens whatever else is in the batch and in whatever order requests arrive (bit-exact for
    ``hf``; for ``sglang`` only with ``deterministic=True``, see ``sglang_engine``). ``None`` derives a
    seed from the engine seed and ``sample_id`` (see :meth:`effective_seed`).
    """

    sample_id: int
    """Caller's id for the sample; echoed in the result, also used to derive a seed when ``seed`` is None."""
    prompt_ids: np.ndarray
    """Prompt token ids (any int sequence; stored as a 1-D int32 array)."""
    max_new_tokens: int
    """Most response tokens to sample (the eos token, when sampled, counts)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax), whose logprobs are then those at temperature 1."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 samples from the whole vocabulary."""
    seed: int | None = None
    """Per-sample sampling seed in [0, 2**63), or None to derive one."""
    images: tuple[bytes, ...] = ()
    """A vision-language model's images for this prompt, ENCODED (PNG, JPEG...), in the order of the
    prompt's image-pad runs; the engine decodes them (`hf`) or hands them to SGLang's `image_data`."""

    def __post_init__(self) -> None:
        ids = np.asarray(self.prompt_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"GenerationRequest(sample_id={self.sample_id}).prompt_ids must be a non-empty 1-D sequence "
                f"of token ids, got shape {ids.shape} dtype {ids.dtype}"
            )
        if ids.min() < 0:
            raise ValueError(f"GenerationRequest(sample_id={self.sample_id}).prompt_ids has a negative id {ids.min()}")
        object.__setattr__(self, "prompt_ids", ids.astype(np.int32, copy=True))
        checks = (
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, "an int >= 1"),
            ("temperature", self.temperature, self.temperature >= 0.0, "a float >= 0 (0 = greedy)"),
            ("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "a float in (0, 1]"),
            ("seed", self.seed, self.seed is None or 0 <= self.seed < _SEED_LIMIT, "None or an int in [0, 2**63)"),
        )
        for field, value, ok, want in checks:
            if not ok:
                raise ValueError(f"GenerationRequest(sample_id={self.sample_id}).{field}={value!r}; it must be {want}")

    def effective_seed(self, engine_seed: int) -> int:
        """The seed this request samples with: ``seed``, or one mixed from (engine_seed, sample_id).

        SeedSequence mixing keeps neighbouring sample ids from getting correlated streams.
        """
        if self.seed is not None:
            return int(self.seed)
        mixed = np.random.SeedSequence([int(engine_seed) & 0xFFFFFFFF, int(self.sample_id) & 0xFFFFFFFF])
        return int(mixed.generate_state(1, dtype=np.uint64)[0] % _SEED_LIMIT)


@dataclass(frozen=True)
class GenerationResult:
    """The response sampled for one :class:`GenerationRequest`.

    ``logprobs[i]`` is ``log_softmax(logits / temperature)[response_ids[i]]`` over the whole vocabulary
    (temperature 1 for greedy): what the trainer recomputes from the same weights. Top-p truncation is
    not folded in, as in SGLang's default; at ``top_p=1`` it is exactly the sampling distribution.
    A ``stop`` response ends with the stop (eos) token it sampled; nothing after it is returned.
    """

    sample_id: int
    prompt_ids: np.ndarray
    """int32, the request's prompt."""
    response_ids: np.ndarray
    """int32, the sampled tokens (may be empty only for ``abort``)."""
    logprobs: np.ndarray
    """float32, same length as ``response_ids``."""
    finish_reason: FinishReason
    """``stop`` (sampled a stop token), ``length`` (hit max_new_tokens) or ``abort`` (cut by ``abort()``)."""
    weight_version: int
    """The engine's ``weight_version`` while this response was sampled."""
    routed_experts: np.ndarray | None = None
    """int16 [len(prompt_ids) + len(response_ids), MoE layers, top k]: the experts the engine's routers chose for
    each prompt token (in the prefill) and each response token when it was fed back as an input (-1 for the last,
    never fed); None unless the engine records routing."""

    def __post_init__(self) -> None:
        assert self.finish_reason in FINISH_REASONS, self.finish_reason
        assert self.response_ids.dtype == np.int32 and self.logprobs.dtype == np.float32
        assert self.response_ids.shape == self.logprobs.shape, (self.response_ids.shape, self.logprobs.shape)
        assert self.routed_experts is None or \
            self.routed_experts.shape[0] == self.prompt_ids.shape[0] + self.response_ids.shape[0]


class BaseEngine(abc.ABC):
    """One inference-engine replica, driven by one rollout rank.

    Lifecycle for colocation (engine and trainer share the accelerator)::

        generate(...) -> release_memory() -> [trainer steps] -> update_weights(..., final=True)
                      -> resume_memory() -> generate(...)

    ``update_weights`` is allowed while released. Between the first bucket of a version and its
    ``final`` bucket the weights are a mix of two versions, so ``generate`` refuses to run then.
    Subclasses keep ``_released`` (truthy while released) and ``_mid_update``, and say by
    ``_alive`` whether they still hold an engine; the shared checks below use them.
    """

    _released: object = False
    _mid_update: bool = False
    #: True when ``generate`` decodes on the caller's thread, reporting each result the step its request
    #: finishes and calling ``on_step`` after every decode step; False when results come at the call's end
    reports_while_decoding: bool = False

    @property
    def _alive(self) -> bool:
        return True

    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError(f"{type(self).__name__} was shut down; build a new engine")

    def _check_ready(self) -> None:
        """Refuse to generate when shut down, released, or halfway through a weight update."""
        name = type(self).__name__
        self._check_alive()
        if self._released:
            raise RuntimeError(f"{name}.generate after release_memory(); call resume_memory() first")
        if self._mid_update:
            raise RuntimeError(f"{name}.generate during a weight update: buckets arrived without a final=True "
                               "bucket, so the weights mix two versions")

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest],
                 on_result: Callable[[GenerationResult], None] | None = None,
                 on_step: Callable[[], None] | None = None) -> list[GenerationResult]:
        """Sample one response per request; results come back in request order. Blocks until done.

        ``on_result`` (called on the generating thread) gets each result as soon as its request is
        finished, so a caller can pass finished samples on while the rest still decode; every
        result is reported exactly once, before ``generate`` returns. ``on_step`` is called on the
        generating thread after each decode step, by an engine that `reports_while_decoding`
        (never by one that does not): the caller's periodic work (sending what is due, taking
        messages) runs between steps, with no second thread taking the interpreter from the decode loop.
        An exception raised by either ends the call and reaches the caller."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop the generation in flight (called from another thread than the one in ``generate``).

        Unfinished requests come back with ``finish_reason="abort"`` and the tokens sampled so far.
        A call while nothing is generating does nothing (it does not poison the next ``generate``).
        """

    @abc.abstractmethod
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool, version: int | None = None
    ) -> None:
        """Load one bucket of ``(hf_name, tensor)`` pairs into the live model.

        Called once per bucket; ``final=True`` on the last bucket of a version, after which the engine
        may flush caches and ``weight_version`` becomes ``version`` (or the previous one plus 1).
        A name the model does not have, or a shape that does not match, raises ``ValueError`` before
        any tensor of that bucket is loaded.
        """

    def take_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool, version: int | None = None
    ) -> None:
        """``update_weights`` for tensors the caller gives up (received for this engine, used by nothing else): the
        engine may keep them as its own storage rather than copy them. This default copies (``update_weights``);
        the `hf` engine keeps those that refill the weights it gave back (`hf_weights.py`)."""
        self.update_weights(named_tensors, final=final, version=version)

    def join_weight_group(self, rendezvous: Rendezvous) -> None:
        """Join the process group of this engine and the trainer owner that sends it weights
        (`rollout.weight_transport` collective), at ``rendezvous.rank_offset`` and the ranks after it.
        Called once per pair, before its first ``update_weights_from_group``; blocks until the group forms."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weights by broadcast; "
                                  "set rollout.weight_transport=mpi")

    def update_weights_from_group(self, manifest: BucketManifest, *, version: int | None = None) -> None:
        """Receive one bucket by broadcast from rank 0 of the manifest's group (one tensor per name, in
        order) and load it as ``update_weights`` would, ``final`` and version bookkeeping included.
        A name or shape the model does not have raises ``ValueError`` before any tensor is loaded."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weights by broadcast; "
                                  "set rollout.weight_transport=mpi")

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights being served: 0 as loaded from ``model_dir``, then set by ``final`` buckets."""

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Give the accelerator memory (weights and any KV cache) back so the trainer can use it."""

    @abc.abstractmethod
    def resume_memory(self) -> None:
        """Take the memory back: weights first, KV cache after.

        Why this order: a KV cache is sized from the memory it finds free, and the weights (plus any
        staging copy an update makes) must already be in place by then, or the wake-up OOMs, as in
        colocated NeMo-RL#191 and verl PR#729.
        """

    def drop_weights(self) -> int:
        """Free the weights a full weight sync is about to replace (CPU colocation, between the last wave and the
        sync); the bytes freed. This default keeps them (0); the `hf` engine frees them (`hf_weights.py`)."""
        return 0

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Free everything; the engine is unusable afterwards. Calling it twice is harmless."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def validate_bucket(bucket: Sequence[tuple[str, torch.Tensor]], known_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` for the first name not in ``known_shapes`` or tensor of another shape.

    Engines call it before loading any tensor of the bucket, so a bad bucket changes nothing.
    """
    for name, tensor in bucket:
        if name not in known_shapes:
            near = difflib.get_close_matches(name, list(known_shapes), n=3)
            hint = f"; close names: {', '.join(near)}" if near else ""
            raise ValueError(f"update_weights: unknown weight name {name!r} (model has {len(known_shapes)} tensors){hint}")
        if tuple(tensor.shape) != tuple(known_shapes[name]):
            raise ValueError(
                f"update_weights: shape mismatch for {name!r}: model has {tuple(known_shapes[name])}, "
                f"got {tuple(tensor.shape)}"
            )


def build_engine(kind: str, model_dir: str, *, device: str, tp_size: int, seed: int, **opts: object) -> BaseEngine:
    """Build an engine of ``kind`` (one of ``ENGINE_KINDS``) serving the HF checkpoint in ``model_dir``.

    ``opts`` go to the engine's constructor (see ``HFEngine`` and ``SGLangEngine`` for theirs).
    The engine modules are imported here, so ``import yatt_hpc.rollout`` never needs sglang.
    Tests may wrap the engine (``maybe_wrap_for_tests``); the configured engine still does the work.
    """
    if kind == "hf":
        from yatt_hpc.rollout.hf_engine import HFEngine

        return maybe_wrap_for_tests(HFEngine(model_dir, device=device, tp_size=tp_size, seed=seed, **opts), kind)
    if kind == "sglang":
        from yatt_hpc.rollout.sglang_engine import SGLangEngine

        return maybe_wrap_for_tests(SGLangEngine(model_dir, device=device, tp_size=tp_size, seed=seed, **opts), kind)
    raise ValueError(f"unknown engine kind {kind!r}; valid kinds: {', '.join(ENGINE_KINDS)}")


def maybe_wrap_for_tests(engine: BaseEngine, kind: str, environ: Mapping[str, str] = os.environ) -> BaseEngine:
    """``YATT_TEST_ENGINE_WRAPPER=tests.programs.MODULE:CLASS`` returns ``CLASS(engine)`` instead of ``engine``
    (a comma-separated list wraps in its order: ``A,B`` gives ``B(A(engine))``).

    For tests of how a rank lives with an engine's process habits (tests/programs/spawning_engine.py
    starts a child and takes SIGTERM, as SGLang does) without a GPU, and of a step that cannot end by
    itself (tests/programs/held_engine.py). Only classes under
    ``tests.programs`` are accepted, which no installed package ships, and the rank's log says so.
    """
    specs = [spec.strip() for spec in environ.get(TEST_WRAPPER_ENV, "").split(",") if spec.strip()]
    wrappers = []  # every entry checked before any is imported
    for spec in specs:
        module, _, name = spec.partition(":")
        if not module.startswith("tests.programs.") or not name:
            raise ValueError(f"{TEST_WRAPPER_ENV}={spec!r}: this test hook takes tests.programs.<module>:<class>; "
                             f"unset {TEST_WRAPPER_ENV} to run the configured engine alone")
        wrappers.append((spec, module, name))
    for spec, module, name in wrappers:
        log.warning("test hook %s=%s: the %r engine runs wrapped in %s", TEST_WRAPPER_ENV, spec, kind, name)
        engine = getattr(importlib.import_module(module), name)(engine)
    return engine
