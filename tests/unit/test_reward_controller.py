"""The reward settings through the config: the GenRM controller built from a config (in a child process
without an MPI world) scores with the terms, the judge template, chat rendering, parser, scale, dtype and
batch size the config names; per-term metrics reach the step's scalars.

    .venv/bin/python -m pytest tests/unit/test_reward_controller.py -q

The probe loads `models/demo/` (made by tools/make_demo_models.py); its tests skip without it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from yatt_hpc.runtime.summary import step_scalars

DEMO = REPO / "models" / "demo"
needs_demo_models = pytest.mark.skipif(not (DEMO / "judge" / "model.safetensors").is_file(),
                                       reason="no models/demo; run .venv/bin/python tools/make_demo_models.py")
FNS = "tests.programs.reward_fns"
TERMS = ("reward.terms=[{name: acc, kind: exact}, {name: fmt, kind: format, pattern: '^[a-z]+$', weight: 0.1}, "
         f"{{name: short, kind: function, function: '{FNS}:shortness', weight: 0.5}}, "
         "{name: judge, kind: genrm, weight: 0.25}]")
PROBES = {
    "default": (),
    "terms": (TERMS,),
    "reference": ('reward.judge_template="{response}\\n{question}{reference}\\nCorrect? "',),  # the answer last
    "regex": ("reward.judge_parser=regex", "reward.judge_pattern='(yes|no)'"),
    "boxed": ("reward.judge_parser=boxed_score",),
    "last_number": ("reward.judge_parser=last_number",),
    "shifted_scale": ("reward.judge_parser=last_number", "reward.judge_score_min=2", "reward.judge_score_max=12"),
    "bf16": ("reward.judge_dtype=bfloat16",),
    "batch5": ("reward.judge_batch_size=5",),
    "rollout_batch6": ("rollout.max_batch_size=6",),  # judge_batch_size null follows it
    "engine_default": ("rollout.max_batch_size=null",),
    "chat_auto": ("reward.genrm_path={chat_judge}", "reward.judge_template='Q: {question} A: {response}'"),
    "chat_false": ("reward.genrm_path={chat_judge}", "reward.judge_template='Q: {question} A: {response}'",
                   "reward.judge_chat=false"),
    "chat_true_demo": ("reward.judge_chat=true",),
    "raises": ("reward.mode=rule_only", f"reward.terms=[{{name: picky, kind: function, function: "
                                        f"'{FNS}:fails_on_long_prompts'}}]"),
}


def _fake_world(cfg):
    from yatt_hpc.placement import plan

    p = plan(cfg)
    return types.SimpleNamespace(plan=p, rank=p.group("genrm").rank_start, group="genrm", group_rank=0, comm=None,
                                 is_leader=False)


def _batch(rows, responses, tokenizer):
    from yatt_hpc.batch import SampleBatch

    prompts = [np.asarray(tokenizer.encode(r["prompt"]), np.int32) for r in rows]
    answers = [np.frombuffer(r["answer"].encode(), np.uint8) for r in rows]
    ids = [np.asarray(tokenizer.encode(t), np.int32) for t in responses]
    return SampleBatch(sample_id=np.arange(len(rows), dtype=np.int64), prompt_id=np.arange(len(rows), dtype=np.int64),
                       owner=np.zeros(len(rows), np.int32), prompt_len=np.array([len(p) for p in prompts], np.int32),
                       prompt_tokens=np.concatenate(prompts), answer_len=np.array([len(a) for a in answers], np.int32),
                       answer=np.concatenate(answers), response_len=np.array([len(x) for x in ids], np.int32),
                       response_tokens=np.concatenate(ids), logprobs=np.zeros(sum(map(len, ids)), np.float32))


class _NumberEngine:
    """Stands in for the judge's engine: every verdict is `Score: 6`."""

    def __init__(self, tokenizer):
        self.ids = np.asarray(tokenizer.encode("Score: 6"), np.int32)

    def generate(self, requests):
        return [types.SimpleNamespace(sample_id=r.sample_id, response_ids=self.ids) for r in requests]


def _recording(generate, seen: list):
    """`generate` that also records each call's requests in `seen`: {sample_id: prompt ids}."""
    def wrapped(requests):
        seen.append({r.sample_id: r.prompt_ids.tolist() for r in requests})
        return generate(requests)
    return wrapped


def _probe(out: str, chat_judge: str) -> None:
    """Child process (MPI not initialised): one GenRM controller per probe config; what it did, as JSON."""
    import random

    import torch

    from yatt_hpc.config import load_config
    from yatt_hpc.data.tokenizer import load_tokenizer
    from yatt_hpc.demo.task import demo_rows, near_miss
    from yatt_hpc.errors import USER_ERRORS
    from yatt_hpc.roles.genrm import GenRMController
    from yatt_hpc.runtime.rank_stats import RankStats

    torch.set_num_threads(1)
    tok = load_tokenizer(DEMO / "policy")
    rng = random.Random(4242)
    rows = demo_rows(seed=7, count=24, split="heldout")
    responses = [r["answer"] if i % 2 else near_miss(r["answer"], rng) for i, r in enumerate(rows)]
    report: dict = {}
    for name, sets in PROBES.items():
        cfg = load_config(REPO / "configs/demo_cpu.yaml",
                          ["placement.mode=partial", *(s.replace("{chat_judge}", chat_judge) for s in sets)])
        try:
            ctl = GenRMController(_fake_world(cfg), cfg, RankStats("genrm"), None)
        except USER_ERRORS as err:
            report[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        seen: list[dict[int, list[int]]] = []
        if ctl.judge is not None:
            ctl.judge.engine.generate = _recording(ctl.judge.engine.generate, seen)
            if name in ("last_number", "shifted_scale"):
                ctl.judge.engine = _NumberEngine(ctl.judge.tokenizer)
        try:
            scored = ctl.score(_batch(rows, responses, tok))
        except USER_ERRORS as err:
            report[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        engine = ctl.judge.engine if ctl.judge is not None else None
        report[name] = {
            **{k: getattr(scored, k).tolist() for k in ("reward", "rule_score", "genrm_score", "parse_fail")},
            "stats": ctl.stats.values, "batches": [len(b) for b in seen],
            "first_prompt": ctl.judge.tokenizer.decode(seen[0][0]) if seen else None,  # sample 0's
            "dtype": str(next(engine._model.parameters()).dtype) if hasattr(engine, "_model") else None,
            "max_batch_size": getattr(engine, "_max_batch_size", None),
            "responses": responses, "answers": [r["answer"] for r in rows],
        }
    Path(out).write_text(json.dumps(report))


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    from yatt_hpc.demo.char_tokenizer import TOKENIZER_FILE, CharTokenizer, save_hf_twin

    base = tmp_path_factory.mktemp("reward_probe")
    chat_judge = base / "chat_judge"  # the demo judge's weights behind a transformers tokenizer with a chat template
    chat_judge.mkdir()
    for f in (DEMO / "judge").iterdir():
        if f.name != TOKENIZER_FILE:
            shutil.copy(f, chat_judge / f.name)
    save_hf_twin(CharTokenizer.load(DEMO / "judge"), chat_judge)
    out = base / "report.json"
    code = ("import sys, mpi4py; mpi4py.rc.initialize = False\n"
            "from tests.unit.test_reward_controller import _probe; _probe(sys.argv[1], sys.argv[2])")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code, str(out), str(chat_judge)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@needs_demo_models
def test_terms_make_the_weighted_reward_and_each_term_its_metric(probed):
    got = probed["terms"]
    stats, n = got["stats"], len(got["reward"])
    assert stats["reward_term_samples"] == n
    terms = {name: stats[f"reward_term/{name}"] for name in ("acc", "fmt", "short", "judge")}
    acc = [float(r == a) for r, a in zip(got["responses"], got["answers"])]
    assert got["rule_score"] == acc and terms["acc"] == sum(acc)  # rule_score: the first correctness term
    assert got["parse_fail"] == [0] * n
    shorts = [1.0 / (1.0 + len(r)) for r in got["responses"]]
    fmt = [1.0] * n  # every demo answer is lowercase letters
    for k in range(n):
        assert got["reward"][k] == pytest.approx(acc[k] + 0.1 * fmt[k] + 0.5 * shorts[k] + 0.25 * got["genrm_score"][k],
                                                 abs=1e-6)
    scalars = step_scalars([_report("trainer", {}), _report("rollout", {}), _report("genrm", stats)], 1.0,
                           leader_report=_report("trainer", {}))
    assert scalars["reward/acc/mean"] == pytest.approx(sum(acc) / n)
    assert scalars["reward/short/mean"] == pytest.approx(sum(shorts) / n)
    assert scalars["reward/judge/mean"] == pytest.approx(sum(got["genrm_score"]) / n)
    assert scalars["reward/fmt/mean"] == 1.0


@needs_demo_models
def test_the_mode_shorthand_scores_as_before(probed):
    got = probed["default"]  # demo_cpu.yaml: rm_with_rule, alpha = beta = 0.5, the demo judge prompt
    for g, r, reward in zip(got["genrm_score"], got["rule_score"], got["reward"]):
        assert reward == pytest.approx(0.5 * g + 0.5 * r, abs=1e-6)
    agree = sum((g >= 0.5) == (r >= 0.5) for g, r in zip(got["genrm_score"], got["rule_score"]))
    assert agree / len(got["reward"]) >= 0.9
    assert set(got["stats"]) >= {"reward_term/genrm", "reward_term/rule", "reward_term_samples"}
    assert got["first_prompt"].endswith("\nCorrect? ") and got["dtype"] == "torch.float32"


@needs_demo_models
def test_judge_template_is_what_the_judge_reads(probed):
    got, default = probed["reference"], probed["default"]
    question = default["first_prompt"].removesuffix(f"{got['responses'][0]}\nCorrect? ")
    assert default["first_prompt"] == f"{question}{got['responses'][0]}\nCorrect? "  # the demo prompt
    assert got["first_prompt"] == f"{got['responses'][0]}\n{question}{got['answers'][0]}\nCorrect? "
    assert got["genrm_score"] != default["genrm_score"]  # the demo judge was trained on its own prompt only


@needs_demo_models
def test_judge_parser_and_pattern_choose_how_a_verdict_is_read(probed):
    assert probed["regex"]["genrm_score"] == probed["default"]["genrm_score"]  # '(yes|no)' reads the demo verdicts
    boxed = probed["boxed"]  # the demo judge writes no \boxed{}: every verdict is a parse failure
    assert boxed["parse_fail"] == [1] * len(boxed["parse_fail"]) and set(boxed["genrm_score"]) == {0.0}


@needs_demo_models
def test_judge_score_min_and_max_set_the_scale(probed):
    assert probed["last_number"]["genrm_score"] == pytest.approx([0.6] * 24)  # 'Score: 6' on 0..10
    assert probed["shifted_scale"]["genrm_score"] == pytest.approx([0.4] * 24)  # on 2..12


@needs_demo_models
def test_judge_dtype_and_batch_size_reach_the_judges_engine(probed):
    assert probed["bf16"]["dtype"] == "torch.bfloat16" and probed["default"]["dtype"] == "torch.float32"
    assert probed["batch5"]["max_batch_size"] == 5 and probed["batch5"]["batches"] == [5, 5, 5, 5, 4]
    # null: the demo's rollout.max_batch_size (256), another one, or 64 without it
    assert probed["default"]["max_batch_size"] == 256 and probed["default"]["batches"] == [24]
    assert probed["rollout_batch6"]["max_batch_size"] == 6 and probed["rollout_batch6"]["batches"] == [6, 6, 6, 6]
    assert probed["engine_default"]["max_batch_size"] == 64


@needs_demo_models
def test_judge_chat_renders_through_the_judges_chat_template(probed):
    auto, plain = probed["chat_auto"]["first_prompt"], probed["chat_false"]["first_prompt"]
    assert auto.startswith("user: Q: ") and auto.endswith("\nassistant: ")  # the tokenizer's chat template
    assert plain.startswith("Q: ") and plain == auto.removeprefix("user: ").removesuffix("\nassistant: ")
    assert probed["chat_true_demo"]["error"].startswith("RewardError: reward.judge_chat=true but the judge's "
                                                        "tokenizer has no chat template")


@needs_demo_models
def test_a_raising_reward_function_stops_scoring_naming_the_row(probed):
    error = probed["raises"]["error"]
    assert error.startswith(f"RewardError: reward term 'picky' (function {FNS}:fails_on_long_prompts) raised on "
                            "sample 0 (prompt id 0 of the trainer replica at world rank 0, prompt 'reverse ")
    assert "ZeroDivisionError" in error and "in _divide" in error


def _report(group: str, values: dict) -> dict:
    return {"group": group, "times": {}, "values": values, "peak_held": 0, "peak_rss_mb": 1.0}


def test_term_means_average_over_every_genrm_rank():
    reports = [_report("genrm", {"reward_term/acc": 3.0, "reward_term/fmt": 4.0, "reward_term_samples": 4}),
               _report("genrm", {"reward_term/acc": 1.0, "reward_term/fmt": 0.0, "reward_term_samples": 4}),
               _report("trainer", {"samples": 8, "reward_sum": 5.0, "reward_term/acc": 99.0}), _report("rollout", {})]
    scalars = step_scalars(reports, 1.0, leader_report=reports[2])
    assert scalars["reward/acc/mean"] == 0.5 and scalars["reward/fmt/mean"] == 0.5  # the trainer's 99 is not a term
    assert sorted(k for k in scalars if k.count("/") == 2 and k.startswith("reward/")) == \
        ["reward/acc/mean", "reward/fmt/mean"]
