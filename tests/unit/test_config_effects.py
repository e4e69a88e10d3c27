"""Config fields whose effect no other test showed: each test sets the field and asserts what it changes
(or that a value is refused, naming the field and the fix). The registry is tests/unit/test_config_coverage.py.

    .venv/bin/python -m pytest tests/unit/test_config_effects.py -q

The values travel the way a run takes them: `load_config` overrides into `plan`/`render_sbatch`, the
`TrainConfig` section into `MegatronPolicy` (the trainer passes `cfg.train` whole), the `DataConfig`
section into `build_prompt_source`, and the whole config into the rollout and GenRM controllers (built in a
child process without an MPI world: `_probe_controllers`).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.config.schema import DataConfig, TrainConfig
from yatt_hpc.launch.sbatch import render_sbatch
from yatt_hpc.placement import PlanError, plan

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models" / "demo"
needs_demo_models = pytest.mark.skipif(not (DEMO / "policy" / "model.safetensors").is_file(),
                                       reason="no models/demo; run .venv/bin/python tools/make_demo_models.py")


def _cfg(*overrides: str, config: str = "demo_cpu.yaml"):
    return load_config(REPO / "configs" / config, list(overrides))


def _directives(cfg) -> list[str]:
    text = render_sbatch(cfg, plan(cfg), "/runs/a", "/opt/venv/bin/python")
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def _components(cfg) -> list[list[str]]:
    """The #SBATCH lines of each het component (one list when the groups share an allocation)."""
    return [block.strip().splitlines() for block in "\n".join(_directives(cfg)).split("#SBATCH hetjob")]


# ------------------------------------------------------------------ refused values (validators)


@pytest.mark.parametrize("override, needles", [
    pytest.param("rollout.top_p=0.9", ["rollout.top_p=0.9", "not supported", "rollout.top_p=1.0"], id="top-p"),
    pytest.param("model.dtype=float16", ["model.dtype=float16", "not supported", "model.dtype=bfloat16"], id="fp16"),
    pytest.param("rollout.engine=sglang", ["rollout.engine=sglang", "needs GPUs", "placement.rollout.devices_per_task=0",
                                           "rollout.engine=hf"], id="sglang-on-cpu"),
    pytest.param("checkpoint.stop_grace_s=90", ["checkpoint.stop_grace_s=90", "slurm.signal=USR2@90"],
                 id="grace-not-below-signal"),
    pytest.param("slurm.time=soon", ["slurm.time='soon'", "not a Slurm time", "4:00:00"], id="slurm-time"),
])
def test_refused_values_name_the_field_and_the_fix(override, needles):
    with pytest.raises(ConfigError) as err:
        _cfg(override)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_streaming_by_sample_is_refused_beside_over_dispatch():
    with pytest.raises(ConfigError) as err:
        _cfg("rollout.streaming=finished_samples", "rollout.over_dispatch_ratio=1.5", config="partial_cpu.yaml")
    for needle in ("rollout.streaming=finished_samples", "rollout.over_dispatch_ratio=1.5",
                   "rollout.streaming=finished_groups", "rollout.over_dispatch_ratio=1.0"):
        assert needle in str(err.value), str(err.value)
    assert _cfg("rollout.streaming=finished_samples", config="partial_cpu.yaml").rollout.streaming == "finished_samples"


def test_accepted_neighbours_of_the_refused_values_load():
    cfg = _cfg("rollout.top_p=1.0", "model.dtype=bfloat16", "checkpoint.stop_grace_s=89", "slurm.time='90'")
    assert (cfg.rollout.top_p, cfg.model.dtype, cfg.checkpoint.stop_grace_s, cfg.slurm.time) == \
        (1.0, "bfloat16", 89, "90")
    assert _cfg("rollout.engine=sglang", config="partial_gpu.yaml").rollout.engine == "sglang"


@pytest.mark.parametrize("overrides, needle", [
    pytest.param(("placement.rollout.cp=2",), "placement.rollout.cp=2: context parallelism is a trainer feature; "
                 "set placement.rollout.cp=1", id="rollout-cp"),
    pytest.param(("placement.genrm.pp=2", "placement.genrm.devices_per_task=2"), "placement.genrm.pp=2: "
                 "pipeline-parallel engine replicas are not implemented", id="genrm-pp"),
    pytest.param(("placement.genrm.dp=3",), "placement.genrm.dp=3 but the group has 1 ranks", id="genrm-dp"),
])
def test_engine_group_shapes_the_planner_refuses(overrides, needle):
    with pytest.raises(PlanError) as err:
        plan(_cfg(*overrides))
    assert needle in str(err.value)
    assert plan(_cfg("placement.genrm.dp=1")).group("genrm").layout == (("tp", 1), ("pp", 1), ("dp", 1))


# ------------------------------------------------------------------ the job script


def test_account_and_qos_go_to_every_component():
    assert not any("--account" in line or "--qos" in line for line in _directives(_cfg()))
    shared = _directives(_cfg("slurm.account=rl-team", "slurm.qos=high"))
    assert "#SBATCH --account=rl-team" in shared and "#SBATCH --qos=high" in shared
    blocks = _components(_cfg("slurm.account=rl-team", "slurm.qos=high", "placement.mode=disjoint"))
    assert len(blocks) == 3
    assert all("#SBATCH --account=rl-team" in b and "#SBATCH --qos=high" in b for b in blocks)


def test_cpus_per_task_of_each_group_reach_its_component():
    sets = ("placement.trainer.cpus_per_task=3", "placement.rollout.cpus_per_task=5", "placement.genrm.cpus_per_task=7")
    blocks = _components(_cfg("placement.mode=disjoint", *sets))
    assert [[line for line in b if "--cpus-per-task" in line] for b in blocks] == \
        [["#SBATCH --cpus-per-task=3"], ["#SBATCH --cpus-per-task=5"], ["#SBATCH --cpus-per-task=7"]]
    # one shared allocation: every rank gets the most any group asks for
    assert "#SBATCH --cpus-per-task=7" in _directives(_cfg(*sets))
    assert [g.cpus_per_task for g in plan(_cfg(*sets)).groups] == [3, 5, 7]  # torch threads per rank (worker)


def test_mem_of_each_group_reaches_its_component():
    assert not any("--mem" in line for line in _directives(_cfg()))
    sets = ("placement.trainer.mem=64G", "placement.rollout.mem=32000M", "placement.genrm.mem=16G")
    blocks = _components(_cfg("placement.mode=disjoint", *sets))
    assert [[line for line in b if "--mem" in line] for b in blocks] == \
        [["#SBATCH --mem=64G"], ["#SBATCH --mem=32000M"], ["#SBATCH --mem=16G"]]
    # shared nodes: the largest request, whichever group makes it
    shared = _directives(_cfg("placement.trainer.mem=1G", "placement.rollout.mem=2048M", "placement.genrm.mem=512M"))
    assert [line for line in shared if "--mem" in line] == ["#SBATCH --mem=2048M"]


def test_submitit_executor_takes_max_requeues_and_the_time_limit(tmp_path):
    from yatt_hpc.launch.submitit_exec import HetSlurmExecutor

    cfg = _cfg("slurm.max_requeues=7", "slurm.time=1-02:00:00")
    executor = HetSlurmExecutor(tmp_path / "submitit", cfg, plan(cfg), tmp_path)
    assert executor.max_num_timeout == 7  # submitit requeues a timed-out job at most this often
    assert executor.parameters["time"] == 26 * 60


# ------------------------------------------------------------------ the dynamic split schedule


def _report(group: str, **times: float) -> dict:
    return {"group": group, "times": times, "values": {}, "peak_held": 0, "peak_rss_mb": 1.0}


def _split_schedule(*overrides: str):
    from yatt_hpc.sched.split import SplitSchedule

    cfg = _cfg("placement.dynamic_split.enabled=true", *overrides, config="partial_cpu.yaml")
    return SplitSchedule.from_config(cfg, plan(cfg))


@pytest.mark.parametrize("hysteresis, pending", [pytest.param(0.1, 1, id="moves"), pytest.param(0.9, 2, id="keeps")])
def test_hysteresis_decides_whether_a_better_split_is_taken(hysteresis, pending):
    s = _split_schedule("placement.rollout.tasks_per_node=2", f"placement.dynamic_split.hysteresis={hysteresis}")
    # scoring-heavy: one rollout rank fewer predicts the busiest replica 50% less busy
    s.end_step([_report("rollout", rollout=1.0), _report("rollout", rollout=1.0), _report("genrm", reward=12.0)])
    assert s.pending == pending, s.decision


@pytest.mark.parametrize("min_replicas, pending", [pytest.param(1, 1, id="one"), pytest.param(2, 2, id="two")])
def test_min_replicas_bounds_how_far_the_split_moves(min_replicas, pending):
    s = _split_schedule("placement.trainer.tasks_per_node=12", "placement.trainer.dp=null", "train.prompts_per_step=24",
                        "placement.rollout.tasks_per_node=2", "placement.genrm.tasks_per_node=2",
                        f"placement.dynamic_split.min_replicas={min_replicas}")
    reports = [_report("rollout", rollout=1.0)] * 2 + [_report("genrm", reward=12.0)] * 2
    s.end_step(reports)
    assert (s.pool, s.current, s.pending) == (4, 2, pending), s.decision


# ------------------------------------------------------------------ prompts


@needs_demo_models
def test_prompt_and_answer_keys_select_the_jsonl_fields(tmp_path):
    from yatt_hpc.data.prompts import DatasetError, build_prompt_source
    from yatt_hpc.data.tokenizer import load_tokenizer

    tok = load_tokenizer(DEMO / "policy")

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "abc=", "solution": "cba", "prompt": "other", "answer": "x"}) + "\n")
    row = build_prompt_source(DataConfig(source=str(path), prompt_key="question", answer_key="solution"),
                              tok).row_at(0)
    assert (row["prompt"], row["answer"]) == ("abc=", "cba")
    assert build_prompt_source(DataConfig(source=str(path)), tok).row_at(0)["prompt"] == "other"
    with pytest.raises(DatasetError, match="data.answer_key"):
        build_prompt_source(DataConfig(source=str(path), answer_key="nope"), tok)


# ------------------------------------------------------------------ the GRPO update (cfg.train)


def _batch(vocab: int, old_logp: float, samples: int = 8, seed: int = 0):
    from yatt_hpc.batch import SampleBatch

    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(4, 10, samples), rng.integers(2, 12, samples)
    return SampleBatch(
        sample_id=np.arange(samples, dtype=np.int64), prompt_id=np.arange(samples, dtype=np.int64) // 4,
        prompt_len=plen.astype(np.int32), prompt_tokens=rng.integers(3, vocab, plen.sum()).astype(np.int32),
        response_len=rlen.astype(np.int32), response_tokens=rng.integers(3, vocab, rlen.sum()).astype(np.int32),
        logprobs=np.full(rlen.sum(), old_logp, np.float32))


def _policy(**train):
    from yatt_hpc.train.policy import MegatronPolicy

    torch.manual_seed(0)
    return MegatronPolicy.from_hf(DEMO / "policy", 0, 1, TrainConfig(**train))


def _update(policy, advantage, old_logp: float = -2.0):
    """One `update` on 8 samples with the given advantage (a number, or +1/-1 alternating if None)."""
    batch = _batch(policy.hf_config.vocab_size, old_logp)
    adv = np.where(np.arange(len(batch)) % 2 == 0, 1.0, -1.0) if advantage is None else np.full(len(batch), advantage)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    stats = policy.update(batch, adv.astype(np.float32))
    return stats, before



@needs_demo_models
@pytest.mark.parametrize("lr", [1e-3, 1e-2])
def test_lr_is_the_size_of_adams_first_step(one_rank_world, lr):
    policy = _policy(lr=lr)
    assert policy.optimizer.param_groups[0]["lr"] == lr
    _, before = _update(policy, None)
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in policy.model.named_parameters())
    assert moved == pytest.approx(lr, rel=0.02)  # AdamW's first step moves an element by lr * g/|g|


@needs_demo_models
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_weight_decay_shrinks_parameters_the_loss_does_not_move(one_rank_world, weight_decay):
    policy = _policy(lr=1e-2, weight_decay=weight_decay)
    _, before = _update(policy, 0.0)  # zero advantages, no KL or entropy term: zero gradient
    for name, p in policy.model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name] * (1 - 1e-2 * weight_decay), rtol=1e-6, atol=0)


@needs_demo_models
@pytest.mark.parametrize("grad_clip", [0.0, 1e-3])
def test_grad_clip_bounds_the_gradient_the_optimizer_steps_with(one_rank_world, grad_clip):
    policy = _policy(grad_clip=grad_clip)
    stats, _ = _update(policy, None)
    stepped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in policy.master.values() if p.grad is not None))
    assert stats.grad_norm > 1e-2, "the check needs a gradient larger than the clip"
    assert stepped == pytest.approx(grad_clip if grad_clip else stats.grad_norm, rel=1e-3)


@needs_demo_models
@pytest.mark.parametrize("clip_low, clipped", [pytest.param(0.0, True, id="zero"), pytest.param(1.0, False, id="one")])
def test_clip_low_clips_ratios_below_one_for_negative_advantages(one_rank_world, clip_low, clipped):
    # old logprob 0: every ratio exp(logp) is below 1; with advantage -1 it is clipped below 1 - clip_low
    stats, _ = _update(_policy(clip_low=clip_low, clip_high=0.28), -1.0, old_logp=0.0)
    assert stats.clip_frac == (stats.tokens if clipped else 0.0), (stats.clip_frac, stats.tokens)


@needs_demo_models
@pytest.mark.parametrize("clip_high, clipped", [pytest.param(0.0, True, id="zero"), pytest.param(1e20, False, id="huge")])
def test_clip_high_clips_ratios_above_one_for_positive_advantages(one_rank_world, clip_high, clipped):
    # old logprob -30: every ratio exp(logp + 30) is far above 1; with advantage +1 it is clipped above 1 + clip_high
    stats, _ = _update(_policy(clip_low=0.2, clip_high=clip_high), 1.0, old_logp=-30.0)
    assert stats.clip_frac == (stats.tokens if clipped else 0.0), (stats.clip_frac, stats.tokens)


@needs_demo_models
def test_kl_coef_builds_the_reference_and_adds_its_kl(one_rank_world):
    plain = _policy(kl_coef=0.0, epochs=2, lr=1e-2)
    assert plain.reference is None
    assert _update(plain, None)[0].kl == 0.0
    with_kl = _policy(kl_coef=0.5, epochs=2, lr=1e-2)
    assert with_kl.reference is not None
    assert _update(with_kl, None)[0].kl > 0  # the second pass scores a policy that moved off the reference


@needs_demo_models
@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_entropy_coef_is_the_weight_of_the_entropy_bonus(one_rank_world, entropy_coef):
    policy = _policy(entropy_coef=entropy_coef)
    batch_tokens = float(_batch(policy.hf_config.vocab_size, -2.0).response_len.sum())
    stats, _ = _update(policy, 0.0)  # zero advantages: the loss is the entropy term alone
    assert stats.entropy > 0
    assert stats.loss == pytest.approx(-entropy_coef * stats.entropy / batch_tokens, rel=1e-4, abs=1e-9)


@needs_demo_models
@pytest.mark.parametrize("passes", [1, 3])
def test_epochs_is_the_number_of_passes_each_one_optimizer_step(one_rank_world, passes):
    policy = _policy(epochs=passes)
    _update(policy, None)
    assert {int(s["step"]) for s in policy.optimizer.state.values()} == {passes}


@needs_demo_models
@pytest.mark.parametrize("size, sizes", [pytest.param(3, [3, 3, 2], id="3"), pytest.param(8, [8], id="8")])
def test_micro_batch_size_cuts_the_forward_backward_passes(one_rank_world, monkeypatch, size, sizes):
    policy = _policy(micro_batch_size=size)
    seen, step = [], policy._micro_step
    monkeypatch.setattr(policy, "_micro_step", lambda mb, *a: seen.append(len(mb)) or step(mb, *a))
    _update(policy, None)
    assert seen == sizes


# ------------------------------------------------------------------ the rollout and GenRM controllers


def _fake_world(cfg, group: str):
    p = plan(cfg)
    g = p.group(group)
    return types.SimpleNamespace(plan=p, rank=g.rank_start, group=group, group_rank=0, comm=None, is_leader=False)


def _prompt_batch(rows, tokenizer, n: int = 1, responses=None):
    """SampleBatch of `rows` (n samples each), with `responses` as generated text if given."""
    from yatt_hpc.batch import SampleBatch

    prompts = [np.asarray(tokenizer.encode(r["prompt"]), np.int32) for r in rows]
    answers = [np.frombuffer(r["answer"].encode(), np.uint8) for r in rows]
    rep = np.repeat(np.arange(len(rows)), n)
    batch = SampleBatch(
        sample_id=np.arange(len(rep), dtype=np.int64), prompt_id=rep.astype(np.int64),
        owner=np.zeros(len(rep), np.int32), prompt_len=np.array([len(prompts[i]) for i in rep], np.int32),
        prompt_tokens=np.concatenate([prompts[i] for i in rep]),
        answer_len=np.array([len(answers[i]) for i in rep], np.int32), answer=np.concatenate([answers[i] for i in rep]))
    if responses is not None:
        ids = [np.asarray(tokenizer.encode(t), np.int32) for t in responses]
        batch.response_len = np.array([len(x) for x in ids], np.int32)
        batch.response_tokens = np.concatenate(ids)
        batch.logprobs = np.zeros(len(batch.response_tokens), np.float32)
    return batch


PROBED = ("placement.mode=partial",)  # engines stay resident (colocate releases them between phases)


def _counting(decode, sizes: list):
    """`decode` (an engine's micro-batch call) that appends each micro-batch's size to `sizes`."""
    def counted(requests, *args, **kwargs):
        sizes.append(len(requests))
        return decode(requests, *args, **kwargs)
    return counted


def _probe_controllers(out: str) -> None:
    """Child process (MPI not initialised): build the rollout and GenRM controllers from configs and record
    what they do. The parent's tests assert on the JSON."""
    import random

    from yatt_hpc.data.tokenizer import load_tokenizer
    from yatt_hpc.demo.task import demo_rows, near_miss
    from yatt_hpc.roles.genrm import GenRMController
    from yatt_hpc.roles.rollout import RolloutController
    from yatt_hpc.runtime.rank_stats import RankStats

    torch.set_num_threads(1)
    tok = load_tokenizer(DEMO / "policy")
    report: dict = {"rollout": {}, "genrm": {}}
    rows = demo_rows(seed=4242, count=8, split="heldout")
    runs = {"a": ("train.seed=0",), "again": ("train.seed=0",), "other_seed": ("train.seed=1",),
            "batches_of_5": ("train.seed=0", "rollout.max_batch_size=5")}
    for name, sets in runs.items():
        cfg = _cfg(*PROBED, "rollout.max_new_tokens=3", "rollout.temperature=1.5", *sets)
        ctl = RolloutController(_fake_world(cfg, "rollout"), cfg, RankStats("rollout"), None)
        micro_batches = []
        ctl.engine._generate_batch = _counting(ctl.engine._generate_batch, micro_batches)
        prompts = _prompt_batch(rows, tok, n=4)
        requests = ctl.requests(prompts)
        done = ctl.generate(prompts)
        report["rollout"][name] = {
            "engine": type(ctl.engine).__module__, "micro_batches": micro_batches,
            "requests": sorted({(r.max_new_tokens, r.temperature, r.top_p) for r in requests}),
            "responses": [r.tolist() for r in done.ragged("response_tokens")]}
        ctl.close()
    rng = random.Random(4242)
    judged = demo_rows(seed=7, count=32, split="heldout")
    responses = [r["answer"] if i % 2 else near_miss(r["answer"], rng) for i, r in enumerate(judged)]
    judged.append({"prompt": "x" * 200, "answer": "abc"})  # too long for the judge: a parse failure
    responses.append("abc")
    configs = {
        "mix_a": ("reward.alpha=0.3", "reward.beta=0.6", "reward.parse_fail_score=0.2"),
        "mix_b": ("reward.alpha=0.6", "reward.beta=0.1", "reward.parse_fail_score=0.7"),
        "one_token": ("reward.alpha=0.3", "reward.beta=0.6", "reward.parse_fail_score=0.2",
                      "reward.verdict_max_tokens=1"),
        "hot": ("reward.alpha=0.3", "reward.beta=0.6", "reward.parse_fail_score=0.2",
                "reward.verdict_temperature=50"),
        "rule_only": ("reward.mode=rule_only",),
    }
    for name, sets in configs.items():
        cfg = _cfg(*PROBED, *sets)
        ctl = GenRMController(_fake_world(cfg, "genrm"), cfg, RankStats("genrm"), None)
        scored = ctl.score(_prompt_batch(judged, tok, responses=responses))
        report["genrm"][name] = {"judge": ctl.judge is not None,
                                 **{k: getattr(scored, k).tolist() for k in ("reward", "rule_score", "genrm_score",
                                                                              "parse_fail")}}
    Path(out).write_text(json.dumps(report))


@pytest.fixture(scope="module")
def controllers(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("controllers") / "report.json"
    code = ("import sys, mpi4py; mpi4py.rc.initialize = False\n"
            "from tests.unit.test_config_effects import _probe_controllers; _probe_controllers(sys.argv[1])")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@needs_demo_models
def test_rollout_requests_carry_the_configured_sampling(controllers):
    a = controllers["rollout"]["a"]
    assert a["engine"] == "yatt_hpc.rollout.hf_engine"  # rollout.engine=hf
    assert a["requests"] == [[3, 1.5, 1.0]]  # max_new_tokens, temperature, top_p of every request
    lengths = [len(r) for r in a["responses"]]
    assert max(lengths) == 3 and min(lengths) >= 1


@needs_demo_models
def test_max_batch_size_cuts_the_engines_decode_batches_and_not_the_samples(controllers):
    got = controllers["rollout"]
    assert got["a"]["micro_batches"] == [32]  # 8 prompts x 4 in one batch (the demo's 256 rows)
    assert got["batches_of_5"]["micro_batches"] == [5, 5, 5, 5, 5, 5, 2]
    assert got["batches_of_5"]["responses"] == got["a"]["responses"]  # every request draws from its own seed


def test_max_batch_size_is_the_sglang_engines_max_running_requests():
    from yatt_hpc.roles.base import rollout_engine_options

    def options(*sets, config="demo_cpu.yaml"):
        cfg = _cfg(*sets, config=config)
        return rollout_engine_options(_fake_world(cfg, "rollout"), cfg)

    assert "max_batch_size" not in options("rollout.max_batch_size=null")  # the engine's own default
    assert options("rollout.max_batch_size=7")["max_batch_size"] == 7
    assert "max_running_requests" not in options(config="colocate_gpu.yaml")
    assert options("rollout.max_batch_size=96", config="colocate_gpu.yaml")["max_running_requests"] == 96


@needs_demo_models
def test_train_seed_seeds_the_rollout_engine(controllers):
    got = controllers["rollout"]
    assert got["a"]["responses"] == got["again"]["responses"]
    differ = sum(a != b for a, b in zip(got["a"]["responses"], got["other_seed"]["responses"]))
    assert differ > len(got["a"]["responses"]) // 4, differ


@needs_demo_models
def test_reward_is_alpha_genrm_plus_beta_rule_with_the_parse_fail_score(controllers):
    for name, (alpha, beta, fail) in {"mix_a": (0.3, 0.6, 0.2), "mix_b": (0.6, 0.1, 0.7)}.items():
        got = controllers["genrm"][name]
        assert got["parse_fail"][-1] == 1 and got["genrm_score"][-1] == pytest.approx(fail), name
        assert sum(got["parse_fail"]) <= 2, "the committed judge parses almost every verdict"
        for g, r, reward in zip(got["genrm_score"], got["rule_score"], got["reward"]):
            assert reward == pytest.approx(min(1.0, alpha * g + beta * r), abs=1e-6), name
    # the rows where the judge's score differs from the rule's (the parse failure) tell alpha from beta
    assert controllers["genrm"]["mix_a"]["reward"] != controllers["genrm"]["mix_b"]["reward"]


@needs_demo_models
def test_verdict_max_tokens_cuts_the_verdict(controllers):
    one = controllers["genrm"]["one_token"]  # "y"/"n" of "yes"/"no": never a verdict
    assert one["parse_fail"] == [1] * len(one["parse_fail"])
    assert all(s == pytest.approx(0.2) for s in one["genrm_score"])


@needs_demo_models
def test_verdict_temperature_samples_the_verdict(controllers):
    greedy, hot = controllers["genrm"]["mix_a"], controllers["genrm"]["hot"]
    assert sum(greedy["parse_fail"]) <= 2
    assert sum(hot["parse_fail"]) > len(hot["parse_fail"]) // 2, "at temperature 50 the judge writes noise"


@needs_demo_models
def test_rule_only_mode_scores_without_a_judge(controllers):
    got = controllers["genrm"]["rule_only"]
    assert not got["judge"] and got["reward"] == got["rule_score"] and set(got["parse_fail"]) == {0}
    assert controllers["genrm"]["mix_a"]["judge"]
