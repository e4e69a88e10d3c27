"""Turn the per-rank step reports into the run's metrics, and a finished run into a summary.

    scalars = step_scalars(reports, step_seconds, leader_report)   # the TensorBoard tags of one step
    summary = run_summary(history, wall_seconds)

Pure functions over plain dicts; the leader calls them, nothing here communicates.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from yatt_hpc.placement import GROUPS


def _sum(reports: list[dict], key: str, group: str = "trainer") -> float:
    return sum(r["values"].get(key, 0.0) for r in reports if r["group"] == group)


def _max_time(reports: list[dict], phase: str, group: str) -> float:
    return max((r["times"].get(phase, 0.0) for r in reports if r["group"] == group), default=0.0)


def _max_value(reports: list[dict], key: str, default: float, group: str = "trainer") -> float:
    return max((r["values"][key] for r in reports if r["group"] == group and key in r["values"]), default=default)


def step_scalars(reports: list[dict], step_seconds: float, leader_report: dict) -> dict[str, float]:
    samples = max(_sum(reports, "samples"), 1.0)
    tokens = max(_sum(reports, "tokens"), 1.0)
    response_tokens = _sum(reports, "response_tokens")
    out = {
        "reward/mean": _sum(reports, "reward_sum") / samples,
        "reward/accuracy": _sum(reports, "rule_sum") / samples,
        "reward/genrm_agreement": _sum(reports, "agree_sum") / samples,
        "reward/genrm_parse_fail": _sum(reports, "parse_fail_sum"),
        "train/loss": _sum(reports, "loss"),
        "train/kl": _sum(reports, "kl_sum") / max(_sum(reports, "kl_tokens"), 1.0),
        "train/kl_coef": _max_value(reports, "kl_coef", default=0.0),
        "train/lr": _max_value(reports, "lr", default=0.0),
        "train/optimizer_steps": _max_value(reports, "optimizer_steps", default=0.0),
        "train/no_signal_samples": _sum(reports, "no_signal"),
        "train/truncated_masked": _sum(reports, "truncated_masked"),
        "train/entropy": _sum(reports, "entropy_sum") / tokens,
        "train/clip_frac": _sum(reports, "clip_sum") / tokens,
        "train/grad_norm": _max_value(reports, "grad_norm", default=0.0),
        "train/rollout_logp_diff_max": _max_value(reports, "logp_diff_max", default=0.0),
        "train/micro_batch_tokens_max": _max_value(reports, "micro_batch_tokens_max", default=0.0),
        **_off_policy(reports),
        **_partial(reports),
        **_critic(reports),
        **_moe(reports),
        "async/staleness": _max_value(reports, "staleness", default=0.0),
        "rollout/response_len_mean": response_tokens / samples,
        "time/step": step_seconds,
        "time/rollout": _max_time(reports, "rollout", "rollout"),
        "time/reward": _max_time(reports, "reward", "genrm"),
        "time/train": _max_time(reports, "train", "trainer"),
        "time/weight_sync": _max_time(reports, "weight_sync", "trainer"),
        "throughput/tokens_per_s": response_tokens / max(step_seconds, 1e-9),
        "data/prompts_consumed": _sum(reports, "prompts_consumed"),
        "rollout/generated": _sum(reports, "generated", "rollout"),
        "rollout/generated_tokens": _sum(reports, "response_tokens", "rollout"),  # sampled, kept or not
        "rollout/aborted": _sum(reports, "aborted", "rollout"),
        "rollout/reused_prompts": _sum(reports, "reused_prompts"),
        "rollout/returned_prompts": _sum(reports, "returned_prompts"),
        "rollout/unused_samples": _sum(reports, "unused", "genrm"),
        "rollout/route_max_over_mean": _max_value(reports, "route_spread", default=1.0),
        "rollout/prompt_messages": _sum(reports, "prompt_messages", "rollout"),
        "rollout/stream_inflight_max": _max_value(reports, "stream_inflight_max", default=0.0, group="rollout"),
        "weight_sync/buckets": _max_value(reports, "weight_sync_buckets", default=0.0),
        "weight_sync/bytes": _sum(reports, "weight_sync_bytes"),
        "weight_sync/mpi_bytes": _sum(reports, "weight_sync_mpi_bytes"),
        "sampling/valid_group_ratio": _sum(reports, "groups_valid") / max(_sum(reports, "groups_total"), 1.0),
        "sampling/waves": _max_value(reports, "waves", default=1.0),
        "sampling/ema_expansion": _max_value(reports, "ema_expansion", default=1.0),
        "sampling/padded_groups": _sum(reports, "padded_groups"),
        "reward/scored": _sum(reports, "scored", "genrm"),
        "balance/max_over_mean_before": _max_value(reports, "balance_before", default=1.0),
        "balance/max_over_mean_after": _max_value(reports, "balance_after", default=1.0),
        "balance/moved_groups": _max_value(reports, "balance_moved", default=0.0),
        "control/leader_peak_held_samples": float(leader_report["peak_held"]),
    }
    out.update(_term_means(reports))
    out.update(_agent(reports))
    out.update(_code(reports))
    for group in GROUPS:
        members = [r for r in reports if r["group"] == group]
        if not members:  # the tools group, when there is none
            continue
        busy = sum(sum(r["times"].values()) for r in members) / max(len(members), 1)
        out[f"time/bubble_pct/{group}"] = 100.0 * max(0.0, 1.0 - busy / max(step_seconds, 1e-9))
        out[f"memory/peak_rss_mb/{group}"] = max(r["peak_rss_mb"] for r in members)
        out[f"memory/given_back_mb/{group}"] = _sum(reports, "given_back_bytes", group) / 2**20
        out[f"control/peak_held_samples/{group}"] = float(max(r["peak_held"] for r in members))
        out[f"wire/batch_bytes/{group}"] = _sum(reports, "wire_batch_bytes", group)
        out[f"wire/image_bytes/{group}"] = _sum(reports, "wire_image_bytes", group)
    return out


def _off_policy(reports: list[dict]) -> dict[str, float]:
    """`off_policy/...`: the importance weights pi_proximal / pi_behavior of the step's tokens, before truncation
    or masking, and the fractions truncated and masked (`train.off_policy`; absent when it is off)."""
    tokens = _sum(reports, "is_tokens")
    if not tokens:
        return {}
    return {"off_policy/is_weight_mean": _sum(reports, "is_weight_sum") / tokens,
            "off_policy/is_weight_max": _max_value(reports, "is_weight_max", default=0.0),
            "off_policy/truncated_frac": _sum(reports, "is_truncated") / tokens,
            "off_policy/masked_frac": _sum(reports, "is_masked") / tokens}


def _moe(reports: list[dict]) -> dict[str, float]:
    """`moe/...`: a mixture-of-experts policy's expert load in the step's update, from the tokens each replica routed
    to each expert of each layer (`moe_tokens/{layer}/{expert}`): per layer the busiest expert's tokens over the
    mean (1 is perfectly balanced, E/k the most skewed), and the worst layer's. Absent for a dense policy. With
    train.moe_routing_replay, the share of replayed (token, layer) routings the trainer's own router would have
    chosen alike (`moe/routing_agreement`)."""
    layers: dict[int, dict[int, float]] = {}
    for report in reports:
        if report["group"] != "trainer":
            continue
        for key, value in report["values"].items():
            if key.startswith("moe_tokens/"):
                _, layer, expert = key.split("/")
                experts = layers.setdefault(int(layer), {})
                experts[int(expert)] = experts.get(int(expert), 0.0) + value
    out = {}
    for layer, experts in sorted(layers.items()):
        mean = sum(experts.values()) / len(experts)
        out[f"moe/load_max_over_mean/layer{layer}"] = max(experts.values()) / mean if mean else 1.0
    if out:
        out["moe/load_max_over_mean"] = max(out.values())
    trainers = [r["values"] for r in reports if r["group"] == "trainer"]
    replayed = sum(v.get("moe_replay_tokens", 0.0) for v in trainers)
    if replayed:
        out["moe/routing_agreement"] = sum(v.get("moe_replay_alike", 0.0) for v in trainers) / replayed
    return out


def _agent(reports: list[dict]) -> dict[str, float]:
    """`agent/...`: multi-turn rollouts (agent:): turns per trajectory, tool calls and their outcomes, the mean
    tool latency (a call's own seconds, wherever it ran), the share of trajectories with a successful call, tokens
    the model did not sample (masked); the engine calls the turns took, the mean time a trajectory waited for a
    tool turn's results (from its calls' submission), and the time the rollout ranks' loops had no engine call to
    make because every live trajectory waited on tools (summed over rollout ranks); with a tools group, the calls
    its ranks ran and the longest time one of them had calls running in the step."""
    trajectories = _sum(reports, "agent_trajectories", "rollout")
    if not trajectories:
        return {}
    calls = _sum(reports, "agent_tool_calls", "rollout")
    group = {}
    if any(r["group"] == "tools" for r in reports):  # placement.tools: the calls ran on the tools group's ranks
        group = {"agent/tools_group_calls": _sum(reports, "tools_served_calls", "tools"),
                 "time/tools": _max_time(reports, "tools", "tools")}
    return group | {"agent/turns_mean": _sum(reports, "agent_turns", "rollout") / trajectories,
            "agent/tool_calls": calls,
            "agent/tool_calls_per_trajectory": calls / trajectories,
            "agent/tool_errors": _sum(reports, "agent_tool_error", "rollout"),
            "agent/tool_timeouts": _sum(reports, "agent_tool_timeout", "rollout"),
            "agent/tool_success_rate": _sum(reports, "agent_tool_ok", "rollout") / max(calls, 1.0),
            "agent/trajectories_with_tool_success": _sum(reports, "agent_used_tools", "rollout") / trajectories,
            "agent/tool_latency_mean_s": _sum(reports, "agent_tool_seconds", "rollout") / max(calls, 1.0),
            "agent/turn_limit_ends": _sum(reports, "agent_turn_limit", "rollout"),
            "agent/masked_tokens": _sum(reports, "agent_masked_tokens", "rollout"),
            "agent/masked_fraction": _sum(reports, "agent_masked_tokens", "rollout")
            / max(_sum(reports, "agent_response_tokens", "rollout"), 1.0),
            "agent/env_errors": _sum(reports, "agent_env_errors", "rollout"),
            "agent/engine_calls": _sum(reports, "agent_engine_calls", "rollout"),
            "agent/tool_wait_mean_s": _sum(reports, "agent_tool_wait_s", "rollout")
            / max(_sum(reports, "agent_tool_turns", "rollout"), 1.0),
            "agent/engine_idle_s": _sum(reports, "agent_engine_idle_s", "rollout")}


def _code(reports: list[dict]) -> dict[str, float]:
    """`code/...` (a `code` reward term; absent without one): responses scored, the share of their tests passed
    and of responses passing all, test runs that timed out or failed to run cleanly, answers without a ```python
    block, rows with missing or malformed tests, the mean seconds of a test run, and where the runs ran (the
    rollout ranks' own sandbox, or the tools group, whose ranks count what they served)."""
    samples = _sum(reports, "code_samples", "rollout")
    if not samples:
        return {}
    tests = _sum(reports, "code_tests", "rollout")
    out = {"code/samples": samples,
           "code/pass_rate": _sum(reports, "code_tests_passed", "rollout") / max(tests, 1.0),
           "code/all_passed_rate": _sum(reports, "code_all_passed", "rollout") / samples,
           "code/score_mean": _sum(reports, "code_score_sum", "rollout") / samples,
           "code/test_runs": tests,
           "code/timeouts": _sum(reports, "code_timeouts", "rollout"),
           "code/run_errors": _sum(reports, "code_run_errors", "rollout"),
           "code/parse_failures": _sum(reports, "code_parse_failures", "rollout"),
           "code/bad_tests": _sum(reports, "code_bad_tests", "rollout"),
           "code/run_latency_mean_s": _sum(reports, "code_run_seconds", "rollout") / max(tests, 1.0),
           "code/runs_on_rollout_ranks": _sum(reports, "code_runs_local", "rollout")}
    if any(r["group"] == "tools" for r in reports):
        out |= {"code/runs_on_tools_group": _sum(reports, "tools_served_code_runs", "tools"),
                "time/tools": _max_time(reports, "tools", "tools")}
    return out


def _partial(reports: list[dict]) -> dict[str, float]:
    """`partial/...` (rollout.partial_rollouts; absent when it is off): samples paused at a segment boundary,
    continued from a paused state, and dropped as too old in the step's waves; response tokens dispatched again
    instead of generated afresh; segments the rollout ranks ran; the trained samples' version span (max - min
    weight version of a sample's tokens) and the oldest trained token's age in updates."""
    if not any("partial_paused" in r["values"] or "partial_span_samples" in r["values"] for r in reports):
        return {}
    return {"partial/paused": _sum(reports, "partial_paused"),
            "partial/continued": _sum(reports, "partial_continued"),
            "partial/dropped": _sum(reports, "partial_dropped"),
            "partial/kept_tokens": _sum(reports, "partial_kept_tokens"),
            "partial/segments": _max_value(reports, "partial_segments", default=0.0, group="rollout"),
            "partial/version_span_mean": _sum(reports, "partial_span_sum") / max(_sum(reports, "partial_span_samples"), 1.0),
            "partial/version_span_max": _max_value(reports, "partial_span_max", default=0.0),
            "partial/token_age_max": _max_value(reports, "partial_token_age_max", default=0.0)}


def _critic(reports: list[dict]) -> dict[str, float]:
    """`critic/...`: the value model's loss (summed over the replicas' shares, as train/loss), the value mean, the
    explained variance 1 - Var(R - V) / Var(R) and the value-clip fraction over the step's response tokens
    (`algos/gae.py`; absent without a critic)."""
    tokens = _sum(reports, "critic_tokens")
    if not tokens:
        return {}
    from yatt_hpc.algos.gae import explained_variance  # torch: imported only in a run with a critic
    sums = [_sum(reports, f"critic_{k}") for k in ("tokens", "value_sum", "ret_sum", "ret_sq", "err_sum", "err_sq")]
    return {"critic/value_loss": _sum(reports, "critic_loss"),
            "critic/value_mean": sums[1] / tokens,
            "critic/return_mean": sums[2] / tokens,
            "critic/explained_var": explained_variance(sums),
            "critic/value_clip_frac": _sum(reports, "critic_clipped") / max(_sum(reports, "critic_loss_tokens"), 1.0),
            "critic/grad_norm": _max_value(reports, "critic_grad_norm", default=0.0),
            "critic/lr": _max_value(reports, "critic_lr", default=0.0),
            "time/critic": _max_time(reports, "critic", "trainer")}


def _term_means(reports: list[dict]) -> dict[str, float]:
    """`reward/<term>/mean`: each reward term's unweighted score averaged over every sample the GenRM ranks
    scored in the step (groups that over-dispatch or dynamic sampling then dropped included)."""
    scored = max(_sum(reports, "reward_term_samples", "genrm"), 1.0)
    keys = sorted({k for r in reports if r["group"] == "genrm" for k in r["values"] if k.startswith("reward_term/")})
    return {f"reward/{k.removeprefix('reward_term/')}/mean": _sum(reports, k, "genrm") / scored for k in keys}


def run_summary(history: list[dict], wall_seconds: float) -> dict:
    history = [h for h in history if "reward/mean" in h]  # not the validation before step 1
    rewards = [h["reward/mean"] for h in history]
    acc = [h["reward/accuracy"] for h in history]
    k = min(5, len(history))
    first = sum(rewards[:k]) / k if k else 0.0
    last = sum(rewards[-k:]) / k if k else 0.0
    return {
        "steps": len(history),
        "wall_seconds": round(wall_seconds, 2),
        "reward_first5": first,
        "reward_last5": last,
        "reward_gain": last - first,
        "accuracy_first5": sum(acc[:k]) / k if k else 0.0,
        "accuracy_last5": sum(acc[-k:]) / k if k else 0.0,
        "genrm_agreement_mean": sum(h["reward/genrm_agreement"] for h in history) / max(len(history), 1),
        "step_seconds_mean": sum(h["time/step"] for h in history) / max(len(history), 1),
    }


def print_summary(summary: dict, run_dir: Path | None, console: Console, logging_cfg=None) -> None:
    table = Table(title="run summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if run_dir is not None:
        trackers = logging_cfg.trackers if logging_cfg is not None else ["tensorboard"]
        if "tensorboard" in trackers:
            console.print(f"TensorBoard logs: {run_dir / 'tb'}   (yatt-hpc tb {run_dir})")
        if "wandb" in trackers and (run_dir / "wandb").is_dir():
            console.print(f"W&B:              {run_dir / 'wandb'}   (offline: wandb sync {run_dir / 'wandb'}/offline-run-*)")
        if "mlflow" in trackers:
            local = f"sqlite:///{Path(run_dir).resolve() / 'mlflow' / 'mlflow.db'}"
            uri = logging_cfg.mlflow_tracking_uri or local
            console.print(f"MLflow:           {uri}" + (f"   (mlflow ui --backend-store-uri {uri})" if uri == local else ""))
        console.print(f"report:           yatt-hpc report {run_dir}   -> {run_dir / 'report.png'}")
        if (run_dir / "checkpoints").is_dir():
            console.print(f"checkpoints:      {run_dir / 'checkpoints'}")
        console.print(f"per-rank logs:    {run_dir / 'logs'}   metrics: {run_dir / 'metrics.jsonl'}"
                      + (f"   samples: {run_dir / 'samples.jsonl'}" if (run_dir / "samples.jsonl").is_file() else ""))
