"""The typed configuration of a yatt-hpc run: one frozen, validated model per concern.

    from yatt_hpc.config import load_config
    cfg = load_config("configs/demo_cpu.yaml", overrides=["train.steps=3"])

Every field carries a docstring; `yatt-hpc config docs` and docs/configuration.md's reference are
generated from them. Cross-field rules of a section live in that section's single validator;
rules that span sections live in `RunConfig`. Derived values (ranks, layouts) are not stored
here: they belong to the placement plan (`yatt_hpc.placement`). The larger sections have modules
of their own (`config/reward.py`, `config/placement.py`, `config/cluster.py` for `slurm:` and
`health:`, `config/tracking.py` for `logging:`, `config/train.py` for `train:`); `RunConfig` gathers every section here.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from yatt_hpc.config.agent import AgentConfig, check_agent_fits
from yatt_hpc.config.cluster import HealthConfig, SlurmConfig
from yatt_hpc.config.placement import PlacementConfig
from yatt_hpc.config.reward import RewardConfig, RewardTerm  # noqa: F401  (the reward section; re-exported)
from yatt_hpc.config.section import Section
from yatt_hpc.config.tracking import LoggingConfig
from yatt_hpc.config.train import TrainConfig, recompute_layers_problem  # noqa: F401  (re-exported)


class ModelConfig(Section):
    """The policy being trained."""

    path: str = "models/demo/policy"
    """Directory of the initial policy in Hugging Face layout (config.json + *.safetensors + tokenizer).
    Relative paths are resolved against the working directory of `yatt-hpc run`."""
    arch: Literal["auto", "gpt2", "llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"] = "auto"
    """Architecture the Megatron <-> HF converter uses. `auto` takes `model_type` from config.json; a named
    arch is checked against config.json before launch and a mismatch refuses the run."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trainer's model, the rollout engines and the judge. `bfloat16` keeps fp32 master
    weights and AdamW state in the trainer and syncs weights to the engines in bfloat16. `float16` is refused
    (it would need loss scaling). The trainer scores with the same dtype the engines sample with, so the
    rollout/trainer logprob gap (`train/rollout_logp_diff_max`) is ~1e-6 in float32 and ~1e-2 in bfloat16."""

    @field_validator("dtype")
    @classmethod
    def _no_fp16(cls, value: str) -> str:
        if value == "float16":
            raise ValueError("model.dtype=float16 is not supported: fp16 training needs loss scaling, which the "
                             "trainer does not do; use model.dtype=bfloat16 (same memory, no scaling needed) "
                             "or float32")
        return value


class DataConfig(Section):
    """Where prompts come from, how a row becomes the policy's input, and how each data-parallel rank walks its shard."""

    source: str = "demo:train"
    """`demo:train` (the built-in verifiable task), `demo:heldout`, `demo:shapes-train` / `demo:shapes-heldout` (count
    the red shapes in a 56x56 image: the visual demo task), a JSONL file (one object per line), a Parquet file, or a
    directory: all its `*.jsonl` or all its `*.parquet` files, in sorted name order, as one list of rows. Rows are
    read lazily by position; a bad row is an error naming the file, the row and the column when it is read."""
    format: Literal["text", "chat"] = "text"
    """`text`: the prompt string is the model's input as is (with the tokenizer's BOS). `chat`: a row's messages (or
    its prompt string as the user's message, after data.system_prompt) go through the policy tokenizer's chat
    template (or data.chat_template) with the generation prompt."""
    prompt_key: str = "prompt"
    """Column (JSONL key) holding the prompt text; in chat format, for rows without data.messages_key."""
    messages_key: str = "messages"
    """Column holding a chat row's messages, a list of `{role, content}` ending with the user's turn (chat format
    only; a row without it uses data.prompt_key)."""
    answer_key: str = "answer"
    """Column holding the reference answer the rule verifier checks; required in every row unless every reward
    term is of kind genrm, code or format (reward.mode=rm_only, a code term's tests), where rows without it get
    an empty answer."""
    system_prompt: str | None = None
    """Chat format: a system message put first in every row that does not begin with its own."""
    chat_template: str | None = None
    """Chat format: path of a Jinja chat template file used instead of the policy tokenizer's own."""
    metadata_columns: list[str] | None = None
    """Columns passed to reward functions as the row's metadata (JSON values); null passes every column but the
    prompt, messages and answer; `[]` passes none."""
    images_key: str | None = None
    """Column holding a row's images, for an image dataset (null: a text-only one; the `demo:` sources bring their
    own). Each row gives one image or a list: encoded bytes (PNG, JPEG...), a file path (relative to the dataset
    file's directory unless absolute), or a Hugging Face `Image()` struct `{bytes, path}` (bytes win); `[]` or
    null for none. A row's images are read and checked from their header when the row is read, never decoded
    there; a missing, damaged or oversized image is an error naming the row."""
    max_image_pixels: int = Field(8192 * 8192, ge=1, le=178_956_970)
    """Largest image (width x height) a row may hold, checked from the image's header before any pixel is decoded
    (a guard against decompression bombs); at most Pillow's own limit, 178,956,970. Image sources only."""
    num_prompts: int = Field(4096, ge=1)
    """Size of the generated demo prompt set (`demo:` sources only; a file source uses all its rows, and another
    value with a file source is refused)."""
    seed: int = 1234
    """Seed of the per-epoch prompt permutation; the order is a pure function of (seed, epoch, position)."""
    max_prompt_tokens: int = Field(1024, ge=1)
    """Longest prompt in tokens (after the chat template); a longer row is an error naming it when it is read."""

    @model_validator(mode="after")
    def _chat_fields_need_chat(self) -> DataConfig:
        demo = self.source == "demo" or self.source.startswith("demo:")
        if not demo and self.num_prompts != DataConfig.model_fields["num_prompts"].default:
            raise ValueError(f"data.num_prompts={self.num_prompts} sizes the demo task only, but data.source is the "
                             f"file source {self.source!r}, which uses all its rows; drop data.num_prompts (or "
                             "write the subset you want to a file)")
        if demo and self.images_key is not None:
            raise ValueError(f"data.images_key={self.images_key!r} names a column, but data.source={self.source!r} is "
                             "a built-in demo task with its own columns; drop data.images_key")
        images = self.images_key is not None or self.source.startswith("demo:shapes-")
        if not images and self.max_image_pixels != DataConfig.model_fields["max_image_pixels"].default:
            raise ValueError(f"data.max_image_pixels={self.max_image_pixels} limits images, but the rows have none "
                             f"(data.source={self.source!r} without data.images_key); set data.images_key to the "
                             "column of the images, or drop data.max_image_pixels")
        if self.format == "text":
            given = [f for f in ("system_prompt", "chat_template") if getattr(self, f) is not None]
            if given:
                raise ValueError(f"data.{given[0]} is set but data.format=text, where rows are not chat messages and "
                                 f"no chat template is applied; set data.format=chat, or drop data.{given[0]}")
        return self


class DynamicSamplingConfig(Section):
    """DAPO-style filtering of zero-variance prompt groups, refilled in waves (WeChat-YATT v4)."""

    enabled: bool = False
    """Drop prompt groups whose rewards are all equal and refill with new prompts in waves."""
    oversampling: float = Field(1.2, ge=1.0)
    """Each refill wave asks for ceil(gap x ema_expansion x oversampling) prompts."""
    ema_decay: float = Field(0.9, ge=0.0, lt=1.0)
    """Decay of the EMA of total/valid groups (averaged across data-parallel ranks)."""
    ema_cap: float = Field(10.0, ge=1.0)
    """Upper bound of the expansion EMA."""
    max_refill_waves: int = Field(3, ge=0)
    """Refill waves per step at most; after them the step is padded with zero-advantage groups."""


class RolloutConfig(Section):
    """Sampling responses from the current policy."""

    engine: Literal["hf", "sglang"] = "hf"
    """Inference engine of the rollout replicas and of the GenRM judge: `hf` (CPU or one GPU per replica; GPT-2
    checkpoints in plain torch, any other model through transformers) or `sglang` (GPU only, tensor-parallel
    replicas, `pip install yatt-hpc[gpu]`)."""
    samples_per_prompt: int = Field(8, ge=1)
    """GRPO group size n: responses sampled per prompt."""
    max_new_tokens: int = Field(1024, ge=1)
    """Maximum response length in tokens."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; only 1.0 is accepted for training rollouts (see the validator)."""
    weight_sync_bucket_mb: float = Field(64.0, gt=0)
    """Size of one trainer -> rollout weight-sync bucket in MiB."""
    weight_transport: Literal["auto", "mpi", "collective"] = "auto"
    """How weights travel from a trainer replica's owner to each engine. `mpi`: device -> host -> MPI bytes ->
    host -> device. `collective`: device to device over a process group of its own per (owner, engine) pair
    (NCCL on GPU, Gloo on CPU; SGLang's `update_weights_from_distributed`); MPI carries only the rendezvous and
    each bucket's manifest. Refused where an engine shares a GPU with its owner (NCCL cannot hold two ranks on
    one device) or only one side has GPUs. `auto`: on GPU with rollout.engine=sglang, collective for an engine
    on GPUs apart from its owner's and CUDA IPC handles into SGLang's `update_weights_from_tensor` for one that
    shares its owner's GPU; mpi on CPU or with the hf engine. `yatt-hpc plan` shows the choice per engine."""
    max_batch_size: int | None = Field(None, ge=1)
    """Requests one rollout engine decodes together: `hf` cuts its requests (shortest prompts first) into
    micro-batches of this many rows, `sglang` takes it as `max_running_requests`. null: the engine's own
    (hf: 64 rows; sglang: what its memory pool fits). On CPU a decode step of a small model costs about
    the same for 64 rows as for 256, so one micro-batch per wave is fastest; its KV cache grows with it.
    Samples do not depend on it (every request draws from its own seed)."""
    stream_chunk: int = Field(8, ge=1)
    """In `partial` and `disjoint` placement, samples are generated and streamed to GenRM in chunks
    of this many, rounded down to whole prompt groups (at least one), so scoring overlaps generation
    (`colocate` sends each replica's batch whole)."""
    streaming: Literal["chunks", "finished_groups", "finished_samples"] = "chunks"
    """What a rollout rank streams to GenRM in `partial`/`disjoint`: `chunks` generates stream_chunk
    samples at a time, in sample-id order; `finished_groups` hands the engine the whole wave at once
    and sends each prompt group the moment its last sample finishes, so scoring overlaps the long
    tail without cutting the engine's batch (which groups finish first depends on the responses:
    with over-dispatch, which prompts make a step then depends on timing too); `finished_samples`
    does the same per sample (a group's worth of finished samples bound for one GenRM rank per
    message, or those that waited 20 ms), so GenRM starts with the first short response, not the
    first whole group; groups still reach the trainer whole. Not with over-dispatch (which keeps the
    first groups to finish whole). Both send from the engine's decode loop, between its steps; an
    engine that reports only at the end of its call (SGLang's offline API) generates the whole wave
    and sends it then."""
    stream_queue: int = Field(4, ge=1)
    """Chunks a rollout rank may have in flight to GenRM before it waits (backpressure)."""
    over_dispatch_ratio: float = Field(1.0, ge=1.0, le=4.0)
    """Long-tail control: a replica that needs k prompt groups dispatches ceil(k x ratio); once k are
    scored the stragglers are aborted and their prompts go back to the front of the replica's queue
    (each prompt is still consumed once). 1.0 turns it off. Above 1.0 which prompts make a step
    depends on timing, so a resumed run is not bitwise identical to an uninterrupted one; with
    rollout.partial_rollouts the stragglers are paused at a segment boundary instead (a function of the
    sampled tokens: bitwise reproducible)."""
    routing: Literal["static", "least_loaded"] = "static"
    """Which rollout rank generates a prompt group: `static` (trainer replica d to rollout rank d mod R)
    or `least_loaded` (per wave, every group to the least-loaded rollout rank by estimated tokens)."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """Dynamic sampling (off by default)."""
    max_staleness: int = Field(0, ge=0, le=4)
    """Asynchronous RL (one-step-off and beyond): 0 is the synchronous loop. With s >= 1 (`partial` or `disjoint`
    placement) the rollout and GenRM ranks generate and score the batch of step t + s while the trainer trains on
    step t's, generated s steps earlier: a step's samples come from the weights after step t - s's update, a
    function of the step, never of timing. The first s batches are generated before the first update. The
    batches waiting for their step are in the checkpoint, so a resume is exact. Use with
    `train.off_policy.proximal: recompute` (decoupled PPO) to take the ratio against the trainer's weights."""
    partial_rollouts: bool = False
    """Partial rollouts (docs/async.md): with over-dispatch and rollout.max_staleness >= 1, a wave generates in
    segments of rollout.partial_segment_tokens new tokens per unfinished sample; once a replica has the groups
    its step needs complete, its unfinished samples are paused at that segment boundary instead of aborted,
    keeping their tokens, log-probs and weight versions (`token_version`), and continued first in its next
    wave under newer weights. A paused group whose oldest token is more than max_staleness versions older than
    the weights that would continue it is dropped and its prompt generated afresh. Which samples pause is a
    function of the sampled tokens, not of timing, so runs and resumes stay bitwise reproducible."""
    partial_segment_tokens: int | None = Field(None, ge=1)
    """With rollout.partial_rollouts: the new tokens each unfinished sample samples per segment (the pause
    granularity: smaller cuts the long tail finer and costs more engine calls). null: max_new_tokens / 4,
    rounded up."""

    @property
    def segment_tokens(self) -> int:
        """Partial rollouts' segment length (rollout.partial_segment_tokens, or max_new_tokens / 4 rounded up)."""
        return self.partial_segment_tokens or -(-self.max_new_tokens // 4)

    @model_validator(mode="after")
    def _samples_stream_alone(self) -> RolloutConfig:
        if self.streaming == "finished_samples" and self.over_dispatch_ratio > 1.0:
            raise ValueError(f"rollout.streaming=finished_samples with rollout.over_dispatch_ratio="
                             f"{self.over_dispatch_ratio:g}: over-dispatch keeps the first prompt groups to finish "
                             "whole, and samples streamed one by one would have GenRM score groups it then drops; "
                             "use rollout.streaming=finished_groups with over-dispatch, or "
                             "rollout.over_dispatch_ratio=1.0")
        if self.partial_segment_tokens is not None and not self.partial_rollouts:
            raise ValueError(f"rollout.partial_segment_tokens={self.partial_segment_tokens} without "
                             "rollout.partial_rollouts: the segment length only applies to partial rollouts; set "
                             "rollout.partial_rollouts=true or drop rollout.partial_segment_tokens")
        if not self.partial_rollouts:
            return self
        if self.max_staleness < 1 or self.over_dispatch_ratio <= 1.0:
            raise ValueError(f"rollout.partial_rollouts=true with rollout.max_staleness={self.max_staleness} and "
                             f"rollout.over_dispatch_ratio={self.over_dispatch_ratio:g}: a paused sample is continued "
                             "in a later wave under newer weights, which needs asynchronous steps and groups "
                             "dispatched beyond the step's need; set rollout.max_staleness >= 1 and "
                             "rollout.over_dispatch_ratio > 1, or rollout.partial_rollouts=false")
        if self.streaming != "chunks":
            raise ValueError(f"rollout.streaming={self.streaming} with rollout.partial_rollouts=true: partial rollouts "
                             "send a replica's samples when its wave's last segment ends (which samples pause is "
                             "decided per segment); use rollout.streaming=chunks or rollout.partial_rollouts=false")
        if self.segment_tokens >= self.max_new_tokens:
            raise ValueError(f"rollout.partial_segment_tokens={self.segment_tokens} with rollout.max_new_tokens="
                             f"{self.max_new_tokens}: a segment as long as the response never pauses anything; "
                             "set rollout.partial_segment_tokens below max_new_tokens (null: a quarter of it)")
        return self

    @field_validator("top_p")
    @classmethod
    def _full_support_only(cls, value: float) -> float:
        if value < 1.0:
            raise ValueError(f"rollout.top_p={value:g} is not supported: the engines report each token's logprob under "
                             "the untruncated softmax (as SGLang does) and the trainer scores the same, so with nucleus "
                             "sampling the PPO ratio would not be the ratio to the distribution the tokens were drawn "
                             "from; set rollout.top_p=1.0 (use rollout.temperature to sharpen)")
        return value


class CheckpointConfig(Section):
    """Checkpoints (safetensors for tensors, HDF5 for the rest, atomic commit)."""

    model_config = ConfigDict(extra="forbid", frozen=True,
                              populate_by_name=True)

    interval: int = Field(10, ge=0)
    """Save every N steps; 0 saves only on preemption and at the end."""
    keep_last: int = Field(2, ge=2)
    """Committed checkpoints to keep (at least 2, so a corrupt latest still has a predecessor)."""
    async_save: bool = Field(True, alias="async")
    """Write in a background thread after a host-memory snapshot (YAML key: `async`)."""
    staging_mb: int = Field(2048, ge=0)
    """Host memory (MiB) an async save's snapshot may hold on each rank, allocated at the first save and
    reused by every later one. A rank whose model and optimizer shards are larger copies what fits and
    writes the rest into the checkpoint before its step goes on (that part of the save is not async);
    0 writes every tensor before the step goes on and keeps no copy. The files are the same either way."""
    load_from: str | None = None
    """Start a fresh run from another run's checkpoint directory (weights only)."""
    stop_grace_s: float | None = Field(60.0, gt=0)
    """Longest a stop signal waits for the running step to end. Past it the step is given up: every rank
    commits the last completed step and the run exits (and requeues). Keep it below the warning time of
    `slurm.signal` (and a preempting partition's GraceTime) minus the time a checkpoint takes to write;
    null always waits for the step boundary. Needs MPI THREAD_MULTIPLE."""


class EvalConfig(Section):
    """Validation during training: held-out prompts sampled and scored by the same rollout and GenRM ranks,
    each trainer replica owning its share of them; nothing is trained on them."""

    sources: list[str] = []
    """Held-out prompt sources, each in any form `data.source` takes (read with the data section's keys, format
    and template); each gets its own metrics under `val/<name>/`, <name> the source with every character but
    letters, digits, `-` and `_` turned into `_`. Empty: no validation."""
    every: int = Field(10, ge=0)
    """Validate after every N-th step (and after the last one); 0: only before training (if `before_train`)."""
    before_train: bool = True
    """Validate the initial policy before step 1 (logged at step 0)."""
    samples_per_prompt: int = Field(1, ge=1)
    """Responses per held-out prompt (n); pass@k is reported for k = 1, 2, 4, ... up to n, and n."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature of validation; 0 is greedy (then samples_per_prompt must be 1); null: rollout's."""
    max_prompts: int | None = Field(None, ge=1)
    """Held-out prompts per source at most (the first ones of the source's order); null: all its rows."""

    @model_validator(mode="after")
    def _greedy_is_one_sample(self) -> EvalConfig:
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError(f"eval.temperature=0 (greedy) gives the same response every time, so "
                             f"eval.samples_per_prompt={self.samples_per_prompt} would count one answer "
                             f"{self.samples_per_prompt} times; set eval.samples_per_prompt=1 or a temperature > 0")
        if not self.sources:
            given = [f for f in ("every", "before_train", "samples_per_prompt", "temperature", "max_prompts")
                     if getattr(self, f) != EvalConfig.model_fields[f].default]
            if given:
                raise ValueError(f"eval.{given[0]} is set but eval.sources is empty, so nothing is validated; "
                                 "list the held-out sources in eval.sources, or drop eval." + given[0])
        names = [eval_name(src) for src in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.sources {self.sources} give two sources the same metric name; list each once")
        return self


def eval_name(source: str) -> str:
    """The metric name of an eval source: `val/<this>/...`."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", source.rstrip("/").split("/")[-1] if "/" in source else source)


SECTIONS = ("model", "data", "train", "rollout", "agent", "reward", "eval", "placement", "checkpoint", "health",
            "slurm", "logging")


class RunConfig(Section):
    """A whole run. Each section is owned by the component that reads it."""

    model: ModelConfig = ModelConfig()
    """The policy."""
    data: DataConfig = DataConfig()
    """Prompts."""
    train: TrainConfig = TrainConfig()
    """GRPO update."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling."""
    agent: AgentConfig = AgentConfig()
    """Multi-turn rollouts with tools and environments (`config/agent.py`, docs/agentic.md)."""
    reward: RewardConfig = RewardConfig()
    """Scoring."""
    eval: EvalConfig = EvalConfig()
    """Validation during training."""
    placement: PlacementConfig = PlacementConfig()
    """Where groups run."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints."""
    health: HealthConfig = HealthConfig()
    """Stall detection."""
    slurm: SlurmConfig = SlurmConfig()
    """Slurm job."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics and logs."""

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        lead = re.match(r"^.*@(\d+)$", self.slurm.signal)  # the format itself is checked where sbatch is written
        grace = self.checkpoint.stop_grace_s
        if grace is not None and lead and grace >= int(lead.group(1)):
            raise ValueError(f"checkpoint.stop_grace_s={grace:g} is not below the {lead.group(1)} s warning of "
                             f"slurm.signal={self.slurm.signal}: Slurm would kill the job before the checkpoint of a "
                             "given-up step is written; lower checkpoint.stop_grace_s (leave time to write a "
                             "checkpoint) or raise the @seconds of slurm.signal")
        buffer = self.reward.overlong_buffer_len
        if buffer is not None and buffer >= (cap := self.rollout.max_new_tokens):
            raise ValueError(f"reward.overlong_buffer_len={buffer} must be below rollout.max_new_tokens={cap}"
                             ": the penalty ramps over the last overlong_buffer_len tokens before the cap; lower it")
        if self.eval.sources and self.placement.dynamic_split.enabled:
            raise ValueError("eval.sources with placement.dynamic_split.enabled: validation runs between steps, where a dynamic "
                             "split moves engines between rollout and GenRM and the held-out prompts would meet engines "
                             "the new weights have not reached; validate with a fixed split "
                             "(placement.dynamic_split.enabled=false) or drop eval.sources")
        s = self.rollout.max_staleness
        if s and self.placement.mode == "colocate":
            raise ValueError(f"rollout.max_staleness={s} with placement.mode=colocate: the groups take the devices in turns, "
                             "so generation cannot overlap training; use placement.mode=partial or disjoint, or max_staleness=0")
        if s and self.placement.dynamic_split.enabled:
            raise ValueError(f"rollout.max_staleness={s} with placement.dynamic_split.enabled: a split moves engines "
                             "between rollout and GenRM at step boundaries, which generation ahead of its step "
                             "crosses; use a fixed split (placement.dynamic_split.enabled=false) or max_staleness=0")
        if s and self.rollout.dynamic_sampling.enabled:
            raise ValueError(f"rollout.max_staleness={s} with rollout.dynamic_sampling.enabled: refill waves are "
                             "decided from the batch being trained, which asynchronous steps train later; set "
                             "rollout.dynamic_sampling.enabled=false or rollout.max_staleness=0")
        if self.train.lora.enabled and self.checkpoint.load_from is not None:
            raise ValueError(f"checkpoint.load_from={self.checkpoint.load_from!r} with train.lora.rank={self.train.lora.rank}: "
                             "adapters start from the base model at model.path; export that checkpoint with `yatt-hpc "
                             "ckpt export-hf` and point model.path at the export, or drop checkpoint.load_from")
        split = self.placement.trainer.pp_layers
        if split is not None and self.train.adv_estimator == "gae":
            raise ValueError(f"placement.trainer.pp_layers={list(split)} with train.adv_estimator=gae: the value model "
                             "is built, checkpointed and exported in even pipeline stages only; drop "
                             "placement.trainer.pp_layers (a pp that divides the layers), or use a group estimator "
                             "such as grpo")
        self._check_routing_replay()
        engines = ("rollout",) + (("genrm",) if self.reward.mode != "rule_only" else ())
        for group in engines:
            shape = getattr(self.placement, group)
            if self.rollout.engine == "sglang" and shape.devices_per_task == 0:
                raise ValueError(f"rollout.engine=sglang (the engine of rollout and GenRM) needs GPUs but "
                                 f"placement.{group}.devices_per_task=0; set placement.{group}.devices_per_task to "
                                 f"its tp, or use rollout.engine=hf")
            if self.rollout.engine == "hf" and shape.tp > 1:
                raise ValueError(f"placement.{group}.tp={shape.tp}: the hf engine runs one device per replica; set "
                                 f"placement.{group}.tp=1 or rollout.engine=sglang")
        check_agent_fits(self)
        return self

    def _check_routing_replay(self) -> None:
        if not self.train.moe_routing_replay:
            return
        if self.agent.enabled:
            raise ValueError("train.moe_routing_replay=true with an agent: section: the tool turns' tokens are fed to "
                             "the engine as prompt text, whose routing is not recorded; drop the agent: section or "
                             "set train.moe_routing_replay=false")
        if self.rollout.partial_rollouts:
            raise ValueError("train.moe_routing_replay=true with rollout.partial_rollouts=true: a continued sample's "
                             "earlier segments are re-fed as prompt, whose routing is not recorded; set "
                             "rollout.partial_rollouts=false or train.moe_routing_replay=false")
