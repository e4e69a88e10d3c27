"""Multi-turn rollouts: the loop's token bookkeeping, its ends, its robustness, Qwen's tool turns, and the
trainer's log-probabilities and loss mask on the trajectories a real engine samples.

    .venv/bin/python -m pytest tests/unit/test_agent_loop.py -q
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.programs.scripted_engine import ScriptedEngine
from yatt_hpc.agent.calls import TurnRenderer
from yatt_hpc.agent.loop import AgentLoop
from yatt_hpc.agent.tools import build_toolbox
from yatt_hpc.batch import SampleBatch
from yatt_hpc.config.agent import AgentConfig, ToolSpec
from yatt_hpc.data.tokenizer import load_tokenizer
from yatt_hpc.demo.lookup import CALL_PATTERN, call_text, code_of, lookup_row
from yatt_hpc.roles.samples import transcript
from yatt_hpc.rollout.engine import GenerationRequest

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "models" / "demo_tools" / "policy"
TOOLS = ("yatt_hpc.demo.lookup:look", "tests.programs.agent_tools:fail", "tests.programs.agent_tools:slow",
         "tests.programs.agent_tools:meet")


def _loop(tok, engine_seed=0, max_turns=3, budget=140, max_new_tokens=64, **fields):
    cfg = AgentConfig(tools=[ToolSpec(function=f) for f in TOOLS], tool_call_pattern=CALL_PATTERN,
                      max_turns=max_turns, max_response_tokens=budget, **{"tool_timeout_s": 0.5, **fields})
    return AgentLoop(cfg, tok, max_new_tokens=max_new_tokens, engine_seed=engine_seed, toolbox=build_toolbox(cfg))


def _requests(tok, count, n=1, seed=5):
    rows = [lookup_row(seed, i) for i in range(count)]
    return rows, [GenerationRequest(sample_id=i * n + k, prompt_ids=tok.encode(r["prompt"]), max_new_tokens=64)
                  for i, r in enumerate(rows) for k in range(n)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(POLICY)


def test_a_tool_turn_is_appended_as_template_tokens_with_mask_zero(tok):
    rows, requests = _requests(tok, 1)
    key, code = rows[0]["prompt"].split()[1], rows[0]["answer"]
    engine = ScriptedEngine(tok, {0: [call_text(key), code]})
    (out,) = _loop(tok).run(engine, requests)
    call, tool = tok.encode(call_text(key)) + [2], tok.encode(f"\ntool: {code}\n> ")
    assert out.result.response_ids.tolist() == call + tool + tok.encode(code) + [2]
    assert out.mask.tolist() == [1] * len(call) + [0] * len(tool) + [1] * (len(code) + 1)
    assert out.result.logprobs.tolist() == [-0.5] * len(call) + [0.0] * len(tool) + [-0.5] * (len(code) + 1)
    assert out.result.finish_reason == "stop" and out.turns == 2
    assert transcript(tok, out.result.response_ids, out.mask) == f"{call_text(key)}\ntool: {code}\n> {code}"
    # token-in: the second turn's prompt is the prompt and every token so far, as ids (no re-tokenisation)
    assert engine.seen[1].prompt_ids.tolist() == requests[0].prompt_ids.tolist() + call + tool
    assert engine.seen[1].seed is not None and engine.seen[0].seed is None


@pytest.mark.parametrize("script, needle", [
    pytest.param(['<call>{"name":"look","arguments":{k:"a"}}</call>'], "not valid JSON", id="malformed"),
    pytest.param(['<call>{"name":"nope","arguments":{}}</call>'], "unknown tool 'nope'", id="unknown-tool"),
    pytest.param(['<call>{"name":"look","arguments":{"k":"zz"}}</call>'], "ValueError: no such key", id="raises"),
    pytest.param(['<call>{"name":"fail","arguments":{"x":"1"}}</call>'], "RuntimeError", id="raises-runtime"),
    pytest.param(['<call>{"name":"slow","arguments":{"seconds":3}}</call>'], "timed out", id="times-out"),
])
def test_bad_calls_become_error_text_for_the_model_and_are_counted(tok, script, needle):
    rows, requests = _requests(tok, 1)
    loop = _loop(tok, budget=400)  # room for the error texts (the scripted engine has no position limit)
    (out,) = loop.run(ScriptedEngine(tok, {0: script + ["abc"]}), requests)
    tool_text = tok.tok.decode(out.result.response_ids[out.mask == 0].tolist())
    assert needle in tool_text and out.result.finish_reason == "stop" and out.turns == 2
    stats = loop.take_stats()
    assert stats["agent_tool_calls"] == 1 and stats.get("agent_tool_ok", 0) == 0
    assert stats.get("agent_tool_error", 0) + stats.get("agent_tool_timeout", 0) == 1


def test_tool_role_output_cut_and_workers_come_from_the_config(tok):
    rows, requests = _requests(tok, 2)
    key = rows[0]["prompt"].split()[1]
    as_user = _loop(tok, tool_role="user", tool_timeout_s=5.0)
    (first,) = as_user.run(ScriptedEngine(tok, {0: [call_text(key), "x"]}), requests[:1])
    assert tok.tok.decode(first.result.response_ids[first.mask == 0].tolist()) == f"\n{code_of(key)}\n> "
    meet = '<call>{"name":"meet","arguments":{}}</call>'  # returns once the other trajectory's call runs too
    for workers, status in ((2, "ok"), (1, "error")):
        loop = _loop(tok, tool_timeout_s=5.0, tool_workers=workers)
        loop.run(ScriptedEngine(tok, {0: [meet, "x"], 1: [meet, "x"]}), requests)
        assert loop.take_stats().get(f"agent_tool_{status}") == 2, workers
    long = _loop(tok, max_tool_output_chars=16, budget=400)
    (out,) = long.run(ScriptedEngine(tok, {0: ['<call>{"name":"fail","arguments":{"x":"' + "y" * 5 + '"}}</call>',
                                               "x"]}), requests[:1])
    assert "cut at 16 characters" in tok.tok.decode(out.result.response_ids[out.mask == 0].tolist())


def test_trajectories_end_at_the_turn_limit_the_budget_and_a_cut_turn(tok):
    rows, requests = _requests(tok, 3)
    call = call_text(rows[0]["prompt"].split()[1])
    engine = ScriptedEngine(tok, {0: [call], 1: ["abcabc|length"], 2: [call]})
    loop = _loop(tok, max_turns=2)
    outs = loop.run(engine, requests)
    assert [o.result.finish_reason for o in outs] == ["length", "length", "length"]
    assert outs[0].turns == 2 and outs[1].turns == 1
    assert loop.take_stats()["agent_turn_limit"] == 2
    # a budget that holds one call but not its result and another turn
    (tight,) = _loop(tok, budget=60, max_new_tokens=64).run(ScriptedEngine(tok, {0: [call]}), requests[:1])
    assert tight.result.finish_reason == "length" and tight.mask.all() and tight.turns == 1


def test_an_environment_steps_on_turns_without_calls_and_its_rewards_add_up(tok):
    cfg = AgentConfig(environment="tests.programs.agent_tools:CountEnv", environment_args={"penalty": 0.25},
                      max_turns=4, max_response_tokens=100)
    loop = AgentLoop(cfg, tok, max_new_tokens=16, engine_seed=0)
    rows, requests = _requests(tok, 1)
    (out,) = loop.run(ScriptedEngine(tok, {0: ["aaa", "bbb", rows[0]["answer"]]}), requests,
                      rows=[{"prompt": rows[0]["prompt"], "answer": rows[0]["answer"], "metadata": {}}])
    assert out.turns == 3 and out.env_reward == pytest.approx(0.5) and out.result.finish_reason == "stop"
    assert "try again" in tok.tok.decode(out.result.response_ids[out.mask == 0].tolist())


QWEN25_TOOL_TEMPLATE = (  # the tool-role and generation-prompt parts of Qwen2.5's chat template
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_qwen_tool_results_follow_im_end_without_repeating_it(tmp_path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz_<>/|\n 0123456789{}\":,"))
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = QWEN25_TOOL_TEMPLATE
    fast.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    qwen = load_tokenizer(tmp_path)
    ids = TurnRenderer(qwen).results(["42", "7"], last_token=2)
    assert fast.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n"
                                "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] != 2, "the model's own <|im_end|> is not repeated"


def test_the_real_engine_samples_multi_turn_trajectories_reproducibly(tok):
    from yatt_hpc.rollout.hf_engine import HFEngine

    rows, requests = _requests(tok, 8, n=4)
    engine = HFEngine(str(POLICY), seed=3)
    first, again = (_loop(tok, engine_seed=3).run(engine, requests) for _ in range(2))
    used = [o for o in first if not o.mask.all()]
    assert used, "the demo policy calls the tool in some trajectories"
    for a, b in zip(first, again):  # a function of the seeds and the (deterministic) tool: exact resume
        assert a.result.response_ids.tolist() == b.result.response_ids.tolist() and a.mask.tolist() == b.mask.tolist()
    for o in used:
        tool = tok.tok.decode(o.result.response_ids[o.mask == 0].tolist())
        assert tool.startswith("\ntool: ") and tool.endswith("\n> ")
        assert np.all(o.result.logprobs[o.mask == 0] == 0) and np.all(o.result.logprobs[o.mask == 1] < 0.0 + 1e-6)
    right = sum(tok.decode(o.result.response_ids[np.flatnonzero(o.mask == 0)[-1] + 1:].tolist())
                == code_of(rows[o.result.sample_id // 4]["prompt"].split()[1]) for o in used)
    assert right >= 1


def agent_batch(tok, seed=3) -> SampleBatch:
    """Trajectories the HF engine samples with the real lookup tool, as the rollout rank's batch."""
    from yatt_hpc.rollout.hf_engine import HFEngine

    rows, requests = _requests(tok, 6, n=4, seed=seed)
    outs = _loop(tok, engine_seed=seed).run(HFEngine(str(POLICY), seed=seed), requests)
    lens = np.array([len(o.mask) for o in outs], np.int32)
    return SampleBatch(
        sample_id=np.arange(len(outs), dtype=np.int64), prompt_id=np.repeat(np.arange(6), 4).astype(np.int64),
        owner=np.zeros(len(outs), np.int32), prompt_len=np.array([len(r.prompt_ids) for r in requests], np.int32),
        prompt_tokens=np.concatenate([r.prompt_ids for r in requests]), response_len=lens,
        response_tokens=np.concatenate([o.result.response_ids for o in outs]),
        logprobs=np.concatenate([o.result.logprobs for o in outs]),
        response_mask=np.concatenate([o.mask for o in outs]),
        reward=np.array([float(i % 3 == 0) for i in range(len(outs))], np.float32),
        finish=np.zeros(len(outs), np.int8))


def _policy(share: bool, budget: int = 0):
    import torch

    from yatt_hpc.config.schema import TrainConfig
    from yatt_hpc.train.policy import MegatronPolicy

    torch.manual_seed(0)
    cfg = TrainConfig(lr=0.1, micro_batch_size=8, max_tokens_per_micro_batch=budget, kl_coef=0.01,
                      entropy_coef=0.01, grad_clip=0.0, share_prompts=share)
    return MegatronPolicy.from_hf(POLICY, 0, 1, cfg)


@pytest.mark.parametrize("share, budget", [pytest.param(True, 0, id="shared-prompts"),
                                           pytest.param(False, 0, id="padded"),
                                           pytest.param(True, 200, id="shared-prompts-token-budget")])
def test_trainer_logprobs_equal_the_engines_on_model_tokens_and_the_loss_skips_the_rest(one_rank_world, tok,
                                                                                      share, budget):
    import torch

    from yatt_hpc.train.step_plan import step_advantages, whole_batch_plan

    batch = agent_batch(tok)
    assert (batch.response_mask == 0).any()
    policy = _policy(share, budget)
    trainer = policy.logprobs_of(policy.model, batch)
    for got, engine, mask in zip(trainer, batch.ragged("logprobs"), batch.ragged("response_mask")):
        np.testing.assert_allclose(got[mask == 1], engine[mask == 1], atol=2e-5)

    def grads(b):
        p = _policy(share, budget)
        stats = p.update(b, step_advantages(b, p.cfg).values, whole_batch_plan(b, p.cfg, norm_len=64))
        return {n: t.grad.clone() for n, t in p.named_params.items()}, stats

    base, stats = grads(batch)
    assert stats.tokens == float(batch.response_mask.sum()), "the loss counts the model's tokens only"
    assert stats.logp_diff_max < 2e-5, "the ratio's old logprobs are the engine's on every token in the loss"
    # garbage where the model did not sample: no ratio, loss, KL or entropy there, so the gradient is the same
    noisy = batch.select(np.arange(len(batch)), logprobs=np.where(batch.response_mask == 1, batch.logprobs,
                                                                   -7.0).astype(np.float32))
    noisy.response_mask = batch.response_mask
    same, _ = grads(noisy)
    for name, grad in base.items():
        assert torch.equal(same[name], grad), name
