"""Routing replay (`train.moe_routing_replay`, docs/moe.md): the HF engine records each response token's experts,
they travel in the batch, and the trainer's forward reuses them; the engine/trainer log-prob gap of a bf16 engine
against the fp32 trainer falls with replay.

    .venv/bin/python -m pytest tests/unit/test_routing_replay.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.mpi.moe_worker import tiny_moe
from yatt_hpc.batch import SampleBatch, batch_columns, batch_from_columns, from_wire
from yatt_hpc.config.schema import RunConfig, TrainConfig
from yatt_hpc.moe.routing_replay import ReplayTopK
from yatt_hpc.roles.rollout import routing_columns
from yatt_hpc.rollout import GenerationRequest
from yatt_hpc.rollout.hf_engine import HFEngine

pytestmark = pytest.mark.usefixtures("one_rank_world")  # a Megatron world of one rank
SEED = 0  # the tiny MoE's and the prompts' seed
SAMPLES_PER_PROMPT = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    tiny_moe(seed=SEED).save_pretrained(path)
    return path


def _rollout(model_dir, dtype: str) -> SampleBatch:
    """4 prompts x 4 samples of 16 tokens from a recording engine, as the rollout rank fills its batch."""
    engine = HFEngine(str(model_dir), dtype=dtype, record_routing=True, stop_token_ids=[])
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(1, 64, size=int(rng.integers(3, 9))) for _ in range(4)]
    n = SAMPLES_PER_PROMPT
    results = engine.generate([GenerationRequest(sample_id=i, prompt_ids=prompts[i // n], max_new_tokens=16)
                               for i in range(len(prompts) * n)])
    return SampleBatch(
        sample_id=np.arange(len(results)), prompt_id=np.arange(len(results)) // n,
        prompt_len=np.array([len(r.prompt_ids) for r in results], np.int32),
        prompt_tokens=np.concatenate([r.prompt_ids for r in results]),
        response_len=np.array([len(r.response_ids) for r in results], np.int32),
        response_tokens=np.concatenate([r.response_ids for r in results]),
        logprobs=np.concatenate([r.logprobs for r in results]), **routing_columns(results))


@pytest.fixture(scope="module")
def batches(model_dir):
    return {dtype: _rollout(model_dir, dtype) for dtype in ("float32", "bfloat16")}


def _gap(model_dir, batch: SampleBatch, replay: bool, share_prompts: bool) -> np.ndarray:
    from yatt_hpc.train.policy import MegatronPolicy

    policy = MegatronPolicy.from_hf(model_dir, 0, 1, TrainConfig(moe_routing_replay=replay, micro_batch_size=16,
                                                                 share_prompts=share_prompts))
    return np.abs(np.concatenate(policy.logprobs_of(policy.model, batch)) - batch.logprobs)


def test_the_engine_records_the_experts_of_each_token_it_feeds(model_dir, batches):
    """fp32: the recorded experts (the prefill's for the prompt, the decode steps' for the response) are HF's own
    top k at each position of a teacher-forced forward; the last token of a response, never fed, is -1."""
    from transformers import AutoModelForCausalLM

    batch = batches["float32"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    for i, (prompt, response, routed) in enumerate(zip(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"),
                                                       batch.ragged("routed_experts"))):
        seen.clear()
        with torch.no_grad():
            model(torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None])
        routed = routed.reshape(len(prompt) + len(response), len(seen), 2)
        for layer, ids in enumerate(seen):
            hf = ids[:-1].sort(-1).values.numpy()
            assert np.array_equal(np.sort(routed[:-1, layer], -1), hf), (i, layer)
        assert (routed[-1] == -1).all()


def test_in_fp32_replay_routes_as_the_trainer_would_on_both_layouts(model_dir, batches):
    """Engine and trainer agree in fp32, so replaying the engine's experts changes no log-prob beyond rounding:
    a replay at the wrong positions would send tokens to other experts and move them by ~1e-2."""
    for share in (True, False):
        assert _gap(model_dir, batches["float32"], True, share).max() < 1e-5


def test_a_bf16_engines_log_prob_gap_to_the_fp32_trainer_falls_with_replay(model_dir, batches):
    """The numbers of docs/moe.md (seeded): bf16 engine, fp32 trainer, 16 samples x 16 tokens."""
    for share in (True, False):
        without, with_replay = _gap(model_dir, batches["bfloat16"], False, share), \
            _gap(model_dir, batches["bfloat16"], True, share)
        print(f"share_prompts={share}: max {without.max():.3g} -> {with_replay.max():.3g}, "
              f"mean {without.mean():.3g} -> {with_replay.mean():.3g}")
        assert with_replay.max() < without.max() and with_replay.mean() < without.mean()


def test_replay_takes_the_recorded_experts_and_the_routers_scores_keep_their_gradient():
    scores = torch.randn(3, 4, requires_grad=True)
    replay = ReplayTopK()
    replay.target = torch.tensor([[3, 0], [-1, -1], [1, 2]])[:, None]  # [S, B, k]
    probs, top = replay.get_replay_topk(scores, 2, default_compute_topk=lambda s, k, **_: torch.topk(s, k, dim=1))
    own = torch.topk(scores, 2, dim=1).indices
    assert top[0].tolist() == [3, 0] and top[2].tolist() == [1, 2] and torch.equal(top[1], own[1])
    assert torch.equal(probs, scores.gather(1, top))
    probs.sum().backward()
    assert scores.grad[0, 3] == 1 and scores.grad[0, 0] == 1 and scores.grad[2, 1] == 1


def test_an_update_with_replay_trains_the_router(model_dir, batches):
    from yatt_hpc.train.policy import MegatronPolicy

    policy = MegatronPolicy.from_hf(model_dir, 0, 1, TrainConfig(moe_routing_replay=True, micro_batch_size=16, lr=1e-2))
    router = next(p for n, p in policy.model.named_parameters() if n.endswith("router.weight"))
    before = router.detach().clone()
    batch = batches["bfloat16"]
    stats = policy.update(batch, np.linspace(-1, 1, len(batch)).astype(np.float32))
    assert stats.logp_diff_max < 0.05 and not torch.equal(router.detach(), before)
    # every fed token replayed at each of 2 layers (a group's prompt once: the shared-prompt stream), and the bf16
    # engine chose some experts the trainer would not
    alike, replayed = stats.routing_agreement
    prompts = batch.prompt_len[::SAMPLES_PER_PROMPT].sum()
    assert replayed == 2 * (prompts + (batch.response_len - 1).sum()) and 0.5 < alike / replayed < 1


def test_routing_agreement_is_the_share_of_replayed_tokens_routed_alike_over_every_replica():
    from tests.unit.test_moe_arch import _scalars

    scalars = _scalars([{"moe_replay_alike": 30.0, "moe_replay_tokens": 40.0},
                        {"moe_replay_alike": 50.0, "moe_replay_tokens": 60.0}])
    assert scalars["moe/routing_agreement"] == pytest.approx(0.8)
    assert "moe/routing_agreement" not in _scalars([{"moe_tokens/0/0": 3.0}])  # replay off: no such metric


def test_the_routing_columns_travel_on_the_wire_and_in_checkpoints(batches):
    batch = batches["float32"]
    assert batch.routed_experts_len.tolist() == ((batch.prompt_len + batch.response_len) * 2 * 2).tolist()
    moved = from_wire(SampleBatch.concat([batch]).wire().copy()).select(np.array([3, 1]))
    assert np.array_equal(np.concatenate(moved.ragged("routed_experts")),
                          np.concatenate([batch.ragged("routed_experts")[i] for i in (3, 1)]))
    saved = batch_columns(batch)
    assert np.array_equal(batch_from_columns(saved).routed_experts, batch.routed_experts)
    old = {k: v for k, v in saved.items() if not k.startswith("routed_experts")}  # written before the columns
    assert batch_from_columns(old).routed_experts_len.tolist() == [0] * len(batch)


def test_a_sample_without_recorded_routing_is_refused_naming_the_option(model_dir, batches):
    from yatt_hpc.train.policy import MegatronPolicy

    policy = MegatronPolicy.from_hf(model_dir, 0, 1, TrainConfig(moe_routing_replay=True, micro_batch_size=16))
    batch = batches["float32"]
    unrecorded = batch.select(np.arange(len(batch)), response_len=batch.response_len,
                              response_tokens=batch.response_tokens, logprobs=batch.logprobs)
    with pytest.raises(ValueError, match="train.moe_routing_replay=true but sample 0 carries 0 recorded"):
        policy.logprobs_of(policy.model, unrecorded)


def test_a_dense_model_is_refused_by_the_engine_and_the_trainer(one_rank_world):
    from pathlib import Path

    from yatt_hpc.train.policy import MegatronPolicy

    demo = Path(__file__).resolve().parents[2] / "models" / "demo" / "policy"
    with pytest.raises(ValueError, match="train.moe_routing_replay=true but the policy has no MoE router"):
        HFEngine(str(demo), record_routing=True)
    with pytest.raises(ValueError, match="train.moe_routing_replay=true but the policy has no MoE layer"):
        MegatronPolicy.from_hf(demo, 0, 1, TrainConfig(moe_routing_replay=True))


@pytest.mark.parametrize("override, message", [
    pytest.param({"rollout": {"partial_rollouts": True, "max_staleness": 1}, "placement": {"mode": "disjoint"}},
                 "rollout.partial_rollouts=false", id="partial"),
    pytest.param({"agent": {"tools": [{"function": "builtin:python"}]}}, "drop the agent: section", id="agent"),
])
def test_what_cannot_record_routing_is_refused_naming_the_field(override, message):
    raw = {"train": {"moe_routing_replay": True}, **override}
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate(raw)


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompt", "padded"])
def test_replay_takes_the_prompts_and_responses_recorded_experts_and_never_the_last_tokens(model_dir, batches, share):
    from yatt_hpc.train.policy import MegatronPolicy

    policy = MegatronPolicy.from_hf(model_dir, 0, 1, TrainConfig(moe_routing_replay=True, micro_batch_size=16,
                                                                 share_prompts=share))
    batch = batches["float32"]
    base = np.concatenate(policy.logprobs_of(policy.model, batch))

    def changed(where) -> float:  # the largest log-prob move when experts (1, 0) replace the recorded ones at `where`
        routed = [r.reshape(-1, 2, 2).copy() for r in batch.ragged("routed_experts")]
        for r, p in zip(routed, batch.prompt_len):
            r[where(p, len(r))] = (1, 0) if (r[where(p, len(r))] != (1, 0)).any() else (2, 3)
        moved = batch.select(np.arange(len(batch)), routed_experts_len=batch.routed_experts_len,
                             routed_experts=np.concatenate([r.reshape(-1) for r in routed]))
        return float(np.abs(np.concatenate(policy.logprobs_of(policy.model, moved)) - base).max())

    assert changed(lambda p, n: slice(0, p)) > 1e-3  # the prompt's experts
    assert changed(lambda p, n: slice(p, n - 1)) > 1e-3  # the response's fed tokens
    assert changed(lambda p, n: slice(n - 1, n)) == 0.0  # the last token: no input, nothing to replay


def _sglang_meta(routed: np.ndarray) -> dict:
    """What SGLang's tokenizer manager puts in meta_info for `routed` ([seqlen - 1, layers, top k] int32): base64 of
    the tensor's bytes (sglang managers/tokenizer_manager.py, ``pybase64.b64encode(val.numpy().tobytes())``)."""
    import base64

    return {"routed_experts": base64.b64encode(np.ascontiguousarray(routed, dtype="<i4").tobytes()).decode("utf-8"),
            "finish_reason": {"type": "length"}}


def test_sglangs_returned_routing_becomes_the_hf_engines_column(model_dir):
    """The HF engine's recorded column of one sample, handed over as SGLang returns routing (every fed token: the
    prompt and the response but its last), decodes to the same column, -1 on the last token."""
    from yatt_hpc.rollout.routing_record import routed_experts_from_sglang
    from yatt_hpc.rollout.sglang_engine import result_from_sglang_output

    engine = HFEngine(str(model_dir), record_routing=True, stop_token_ids=[])
    request = GenerationRequest(sample_id=0, prompt_ids=np.array([5, 9, 2, 7], np.int32), max_new_tokens=6)
    hf = engine.generate([request])[0]
    fed = hf.routed_experts[:-1].astype(np.int32)  # [4 + 6 - 1, 2 layers, top 2]
    got = routed_experts_from_sglang(_sglang_meta(fed), 4, 6, layers=2, topk=2)
    assert got.dtype == np.int16 and np.array_equal(got, hf.routed_experts) and (got[-1] == -1).all()
    output = {"meta_info": {**_sglang_meta(fed), "output_token_logprobs": [
        (float(lp), int(t), None) for lp, t in zip(hf.logprobs, hf.response_ids)]}}
    result = result_from_sglang_output(request, output, weight_version=0, routing=(2, 2))
    assert np.array_equal(result.routed_experts, hf.routed_experts)
    assert result_from_sglang_output(request, output, weight_version=0).routed_experts is None  # not recording


def test_sglang_routing_of_the_wrong_size_or_missing_is_refused_and_an_abort_without_it_is_the_trainers_choice():
    from yatt_hpc.rollout.routing_record import routed_experts_from_sglang

    meta = _sglang_meta(np.zeros((8, 2, 2), np.int32))
    with pytest.raises(ValueError, match="holds 32 expert ids, but 4 prompt \\+ 6 response tokens"):
        routed_experts_from_sglang(meta, 4, 6, layers=2, topk=2)
    with pytest.raises(ValueError, match="enable_return_routed_experts=True"):
        routed_experts_from_sglang({}, 4, 6, layers=2, topk=2)
    assert (routed_experts_from_sglang({}, 4, 1, 2, 2, aborted=True) == -1).all()


def test_the_sglang_engine_reads_its_routing_shape_from_config_json_and_refuses_a_dense_model(model_dir, tmp_path):
    import json

    from yatt_hpc.rollout.sglang_engine import routing_shape

    assert routing_shape(str(model_dir)) == (2, 2)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="no num_experts_per_tok"):
        routing_shape(str(tmp_path))


def test_routing_replay_with_the_sglang_engine_validates():
    from pathlib import Path

    from yatt_hpc.config.load import load_config

    config = Path(__file__).resolve().parents[2] / "configs" / "qwen3_30b_a3b_disjoint_h200.yaml"
    cfg = load_config(config, ["train.moe_routing_replay=true"])
    assert cfg.rollout.engine == "sglang" and cfg.train.moe_routing_replay
