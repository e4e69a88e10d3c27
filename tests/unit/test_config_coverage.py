"""Every config field takes effect or is refused (STYLE.md 15): for each leaf field of `RunConfig`, the
test that shows its effect. A field without an entry fails here; so does an entry for a field that is gone,
or one naming a test that does not exist.

    .venv/bin/python -m pytest tests/unit/test_config_coverage.py -q

An entry counts only if its test sets the field (an override, a `--set`, a section built with it) or relies
on its value, and asserts a behaviour that depends on it: not a test that merely loads a config holding the
field. A field whose value the code passes on by hand (a keyword argument in a controller that needs MPI)
is not shown by a test of the callee alone: such a field needs a test through the config. Fields refused
in some values also name the validator's test in `REFUSED`. Tests of fields no other test showed are in
tests/unit/test_config_effects.py, and for fields only a real run shows, tests/mpi/test_config_effects_run.py.
"""
from __future__ import annotations

import ast
import functools
import re
import types
import typing
from pathlib import Path

import pytest

from yatt_hpc.config.schema import RunConfig, Section

REPO = Path(__file__).resolve().parents[2]
EFFECTS = "tests/unit/test_config_effects.py"
REWARD = "tests/unit/test_reward_controller.py"  # the GenRM controller built from reward configs
TERMS = "tests/unit/test_reward_terms.py::test_refused_reward_terms_name_the_field_and_the_fix"
IMAGES = "tests/unit/test_image_rows.py"  # image rows: data.images_key, data.max_image_pixels
RUN = "tests/mpi/test_config_effects_run.py"
RECIPES = "tests/unit/test_recipe_effects.py"  # the recipe settings of train: and reward:, and eval's sampling
RECIPE_RUN = "tests/mpi/test_recipes_run.py"  # runs of each recipe family, and validation
RECOMPUTE = "tests/unit/test_recompute.py"  # activation recomputation: bytes kept, gradients, refusals
TRACKERS = "tests/unit/test_trackers.py"  # trackers: W&B and MLflow given names and stores, refusals
TRACKERS_RUN = "tests/mpi/test_trackers_run.py"  # trackers read back after real runs, stopped and resumed
CRITIC = "tests/unit/test_critic.py"  # the value model: its start, head, clip, optimizer, refusals
OPTIM = f"{CRITIC}::test_the_critics_optimizer_takes_its_own_settings_and_lr_is_adams_first_step"
GAE = "tests/unit/test_gae.py"  # GAE, the critic's schedule and its refusals
LORA = "tests/unit/test_lora.py"  # train.lora: adapters, their maths and peft's, refusals
AGENT = "tests/unit/test_agent_loop.py"  # agent: the multi-turn loop built from AgentConfig
AGENT_TOOLS = "tests/unit/test_agent_tools.py::test_refused_agent_settings_name_the_field_and_the_fix"
TURNS = "tests/unit/test_turn_schedule.py"  # agent.turn_schedule: lockstep vs as_ready with a slow tool
SANDBOX = "tests/unit/test_sandbox.py"  # agent.sandbox: PythonSandbox reads SandboxConfig
TOOLS_GROUP = "tests/unit/test_tools_group.py"  # placement.tools: the plan, its Slurm component, refusals

EFFECT: dict[str, str] = {
    # ---------------------------------------------------------------- model
    "model.path": "tests/mpi/test_grpo_run.py::test_missing_model_file_is_a_clear_error",
    "model.arch": "tests/unit/test_inputs.py::test_model_arch_must_match_config_json",
    "model.dtype": "tests/mpi/test_grpo_run.py::test_bf16_run_trains_and_checkpoints_fp32_masters",
    # ---------------------------------------------------------------- data (build_prompt_source takes cfg.data)
    "data.source": "tests/unit/test_prompts.py::test_build_prompt_source_follows_the_data_config",
    "data.prompt_key": f"{EFFECTS}::test_prompt_and_answer_keys_select_the_jsonl_fields",
    "data.answer_key": f"{EFFECTS}::test_prompt_and_answer_keys_select_the_jsonl_fields",
    "data.num_prompts": "tests/unit/test_prompts.py::test_build_prompt_source_follows_the_data_config",
    "data.seed": "tests/unit/test_prompts.py::test_build_prompt_source_follows_the_data_config",
    "data.max_prompt_tokens": "tests/unit/test_prompts.py::test_prompts_over_the_token_limit_fail_when_read_naming_the_row",
    "data.format": "tests/unit/test_chat_prompts.py::test_format_text_keeps_the_prompt_string_as_the_models_input",
    "data.messages_key": "tests/unit/test_chat_prompts.py::test_messages_key_names_the_column_of_the_messages",
    "data.system_prompt": "tests/unit/test_chat_prompts.py::"
                          "test_messages_and_prompt_strings_go_through_the_tokenizers_chat_template",
    "data.chat_template": "tests/unit/test_chat_prompts.py::test_a_chat_template_file_overrides_the_tokenizers",
    "data.metadata_columns": "tests/unit/test_datasets.py::test_metadata_columns_select_what_reward_functions_see",
    "data.images_key": f"{IMAGES}::test_images_key_and_max_image_pixels_reach_the_row_reader",
    "data.max_image_pixels": f"{IMAGES}::test_images_key_and_max_image_pixels_reach_the_row_reader",
    # ---------------------------------------------------------------- train (MegatronPolicy takes cfg.train)
    "train.steps": "tests/mpi/test_grpo_run.py::test_metrics_are_consistent",
    "train.seed": f"{EFFECTS}::test_train_seed_seeds_the_rollout_engine",
    "train.prompts_per_step": "tests/mpi/test_grpo_run.py::test_metrics_are_consistent",
    "train.micro_batch_size": f"{EFFECTS}::test_micro_batch_size_cuts_the_forward_backward_passes",
    "train.max_tokens_per_micro_batch": "tests/unit/test_micro_batches.py::"
                                        "test_the_budget_gives_the_fixed_micro_batches_gradient",
    "train.lr": f"{EFFECTS}::test_lr_is_the_size_of_adams_first_step",
    "train.weight_decay": f"{EFFECTS}::test_weight_decay_shrinks_parameters_the_loss_does_not_move",
    "train.grad_clip": f"{EFFECTS}::test_grad_clip_bounds_the_gradient_the_optimizer_steps_with",
    "train.shard_optimizer": "tests/mpi/test_sharded_optimizer.py::test_a_sharded_checkpoint_resumes_bitwise",
    "rollout.max_staleness": "tests/mpi/test_async_run.py::test_an_asynchronous_run_resumes_bitwise",
    "rollout.partial_rollouts": "tests/mpi/test_async_run.py::test_an_asynchronous_run_resumes_bitwise",
    "rollout.partial_segment_tokens": "tests/mpi/test_async_run.py::test_an_asynchronous_run_resumes_bitwise",
    # ---------------------------------------------------------------- train.critic (docs/critic.md)
    "train.critic.path": f"{CRITIC}::test_a_one_label_reward_model_gives_the_critic_its_decoder_and_head",
    "train.critic.head_init_std": f"{CRITIC}::test_a_new_head_is_drawn_with_head_init_std_and_zero_starts_at_zero",
    "train.critic.lam": f"{GAE}::test_the_train_config_chooses_gamma_lambda_and_whitening",
    "train.critic.whiten_advantages": f"{GAE}::test_the_train_config_chooses_gamma_lambda_and_whitening",
    "train.critic.level": f"{GAE}::test_the_train_config_chooses_the_gae_level",
    "train.critic.value_clip": f"{CRITIC}::test_value_clip_holds_the_loss_around_the_old_values",
    "train.critic.warmup_steps": "tests/mpi/test_critic_run.py::test_ppo_with_a_critic_learns_the_demo_and_resumes_bitwise",
    "train.critic.lr": f"{GAE}::test_the_critics_learning_rate_follows_its_own_schedule",
    "train.critic.lr_warmup_steps": f"{GAE}::test_the_critics_learning_rate_follows_its_own_schedule",
    "train.critic.lr_decay": f"{GAE}::test_the_critics_learning_rate_follows_its_own_schedule",
    "train.critic.lr_decay_steps": f"{GAE}::test_the_critics_learning_rate_follows_its_own_schedule",
    "train.critic.min_lr": f"{GAE}::test_the_critics_learning_rate_follows_its_own_schedule",
    "train.critic.adam_betas": OPTIM,
    "train.critic.adam_eps": OPTIM,
    "train.critic.weight_decay": OPTIM,
    "train.critic.grad_clip": OPTIM,
    "train.off_policy.proximal": "tests/mpi/test_off_policy_run.py::test_the_ratio_is_taken_against_the_trainers_own_weights",
    "train.off_policy.correction": "tests/mpi/test_off_policy_run.py::test_bf16_engines_are_corrected_and_measured",
    "train.off_policy.cap": "tests/mpi/test_off_policy_run.py::test_the_ratio_is_taken_against_the_trainers_own_weights",
    "train.off_policy.mask_low": "tests/mpi/test_off_policy_run.py::test_bf16_engines_are_corrected_and_measured",
    "train.off_policy.mask_high": "tests/mpi/test_off_policy_run.py::test_bf16_engines_are_corrected_and_measured",
    "train.clip_low": f"{EFFECTS}::test_clip_low_clips_ratios_below_one_for_negative_advantages",
    "train.clip_high": f"{EFFECTS}::test_clip_high_clips_ratios_above_one_for_positive_advantages",
    "train.kl_coef": f"{EFFECTS}::test_kl_coef_builds_the_reference_and_adds_its_kl",
    "train.entropy_coef": f"{EFFECTS}::test_entropy_coef_is_the_weight_of_the_entropy_bonus",
    "train.epochs": f"{EFFECTS}::test_epochs_is_the_number_of_passes_each_one_optimizer_step",
    "train.adv_estimator": f"{RECIPES}::test_adv_estimator_and_its_options_choose_the_advantages",
    "train.norm_adv_by_std": f"{RECIPES}::test_adv_estimator_and_its_options_choose_the_advantages",
    "train.adv_std": f"{RECIPES}::test_adv_estimator_and_its_options_choose_the_advantages",
    "train.adv_eps": f"{RECIPES}::test_adv_estimator_and_its_options_choose_the_advantages",
    "train.gamma": f"{RECIPES}::test_adv_estimator_and_its_options_choose_the_advantages",
    "train.loss_mode": f"{RECIPES}::test_loss_mode_gspo_clips_whole_sequences_and_cispo_weights_every_token",
    "train.loss_agg_mode": f"{RECIPES}::test_loss_agg_mode_is_the_normaliser_of_the_loss",
    "train.clip_ratio_c": f"{RECIPES}::test_clip_ratio_c_caps_negative_advantages_far_above_the_ratio",
    "train.kl_estimator": f"{RECIPES}::test_kl_estimator_decides_the_kl_term",
    "train.kl_in_reward": f"{RECIPES}::test_kl_in_reward_subtracts_coef_times_the_chosen_estimate_per_token",
    "train.kl_target": f"{RECIPES}::test_kl_target_and_horizon_adapt_the_coefficient",
    "train.kl_horizon": f"{RECIPES}::test_kl_target_and_horizon_adapt_the_coefficient",
    "train.mask_truncated": f"{RECIPES}::test_mask_truncated_takes_length_cut_samples_out_of_the_loss_counts",
    "train.mini_batches": f"{RECIPES}::test_mini_batches_cut_the_global_groups_and_count_each_part",
    "train.lr_warmup_steps": f"{RECIPES}::test_lr_warmup_decay_steps_and_floor_shape_the_rate_of_each_step",
    "train.lr_decay": f"{RECIPES}::test_lr_warmup_decay_steps_and_floor_shape_the_rate_of_each_step",
    "train.lr_decay_steps": f"{RECIPES}::test_lr_warmup_decay_steps_and_floor_shape_the_rate_of_each_step",
    "train.min_lr": f"{RECIPES}::test_lr_warmup_decay_steps_and_floor_shape_the_rate_of_each_step",
    "train.adam_betas": f"{RECIPES}::test_adam_betas_and_eps_reach_the_optimizer",
    "train.adam_eps": f"{RECIPES}::test_adam_betas_and_eps_reach_the_optimizer",
    "train.balance": f"{RUN}::test_balance_none_moves_nothing_and_flops_balances_every_step",
    "train.balance_flops_coeff": "tests/unit/test_balance.py::"
                                 "test_balance_and_balance_flops_coeff_choose_the_workload_groups_are_split_by",
    "train.share_prompts": "tests/unit/test_shared_prompt.py::test_policy_update_is_the_same_with_shared_prompts",
    "train.moe_routing_replay":
        "tests/unit/test_routing_replay.py::test_a_bf16_engines_log_prob_gap_to_the_fp32_trainer_falls_with_replay",
    "train.train_vision_tower": "tests/unit/test_vlm_policy.py::test_train_vision_tower_decides_whether_the_tower_moves",
    "train.lora.rank": f"{LORA}::test_lora_policy_steps_only_the_adapters_and_checkpoints_only_them",
    "train.lora.alpha": f"{LORA}::test_a_fused_qkv_layer_adds_each_modules_scaled_BAx_in_megatrons_group_order",
    "train.lora.dropout": f"{LORA}::test_dropout_masks_the_adapters_input_in_the_update_only",
    "train.lora.target_modules": f"{LORA}::test_a_fused_qkv_layer_adds_each_modules_scaled_BAx_in_megatrons_group_order",
    "train.recompute": f"{RECOMPUTE}::test_recompute_keeps_fewer_activations_for_the_backward",
    "train.recompute_method": f"{RECOMPUTE}::test_recompute_keeps_fewer_activations_for_the_backward",
    "train.recompute_num_layers": f"{RECOMPUTE}::test_recompute_keeps_fewer_activations_for_the_backward",
    # ---------------------------------------------------------------- rollout
    "rollout.engine": f"{EFFECTS}::test_rollout_requests_carry_the_configured_sampling",
    "rollout.samples_per_prompt": "tests/mpi/test_grpo_run.py::test_metrics_are_consistent",
    "rollout.max_new_tokens": f"{EFFECTS}::test_rollout_requests_carry_the_configured_sampling",
    "rollout.temperature": "tests/mpi/test_grpo_run.py::test_sampling_temperature_is_the_temperature_the_trainer_scores_at",
    "rollout.top_p": f"{EFFECTS}::test_refused_values_name_the_field_and_the_fix",  # only 1.0 is accepted
    "rollout.weight_sync_bucket_mb": f"{RUN}::test_weight_sync_bucket_mb_sets_the_buckets_of_a_sync",
    "rollout.weight_transport": "tests/mpi/test_placement_modes.py::"
                                "test_collective_weight_transport_serves_the_trainers_weights_and_moves_no_tensor_over_mpi",
    "rollout.stream_queue": f"{RUN}::test_stream_queue_bounds_the_sends_in_flight_to_genrm",
    "rollout.max_batch_size": f"{EFFECTS}::test_max_batch_size_cuts_the_engines_decode_batches_and_not_the_samples",
    "rollout.routing": f"{RUN}::test_routing_least_loaded_sends_every_replica_to_every_rollout_rank",
    "rollout.stream_chunk": "tests/mpi/test_placement_modes.py::test_mode_runs_and_scores_every_sample_once",
    "rollout.streaming": "tests/mpi/test_placement_modes.py::"
                         "test_finished_groups_are_scored_while_the_long_tail_still_decodes",
    "rollout.over_dispatch_ratio": "tests/mpi/test_overdispatch_run.py::test_over_dispatch_loses_and_repeats_no_prompt",
    "rollout.dynamic_sampling.enabled": "tests/mpi/test_dynamic_sampling_run.py::test_waves_pad_and_update_the_ema",
    # the next three: the exact counts follow from their defaults (1.2, 0.9, 10), which the test does not change
    "rollout.dynamic_sampling.oversampling": "tests/mpi/test_dynamic_sampling_run.py::test_waves_pad_and_update_the_ema",
    "rollout.dynamic_sampling.ema_decay": "tests/mpi/test_dynamic_sampling_run.py::test_waves_pad_and_update_the_ema",
    "rollout.dynamic_sampling.ema_cap": "tests/mpi/test_dynamic_sampling_run.py::test_waves_pad_and_update_the_ema",
    "rollout.dynamic_sampling.max_refill_waves": "tests/mpi/test_dynamic_sampling_run.py::test_waves_pad_and_update_the_ema",
    # ---------------------------------------------------------------- reward
    "reward.mode": f"{EFFECTS}::test_rule_only_mode_scores_without_a_judge",
    "reward.genrm_path": "tests/mpi/test_dynamic_split.py::test_split_follows_the_load_and_survives_a_resume",
    "reward.alpha": f"{EFFECTS}::test_reward_is_alpha_genrm_plus_beta_rule_with_the_parse_fail_score",
    "reward.beta": f"{EFFECTS}::test_reward_is_alpha_genrm_plus_beta_rule_with_the_parse_fail_score",
    "reward.parse_fail_score": f"{EFFECTS}::test_reward_is_alpha_genrm_plus_beta_rule_with_the_parse_fail_score",
    "reward.verdict_max_tokens": f"{EFFECTS}::test_verdict_max_tokens_cuts_the_verdict",
    "reward.verdict_temperature": f"{EFFECTS}::test_verdict_temperature_samples_the_verdict",
    "reward.terms": f"{REWARD}::test_terms_make_the_weighted_reward_and_each_term_its_metric",
    "reward.judge_template": f"{REWARD}::test_judge_template_is_what_the_judge_reads",
    "reward.judge_chat": f"{REWARD}::test_judge_chat_renders_through_the_judges_chat_template",
    "reward.judge_parser": f"{REWARD}::test_judge_parser_and_pattern_choose_how_a_verdict_is_read",
    "reward.judge_pattern": f"{REWARD}::test_judge_parser_and_pattern_choose_how_a_verdict_is_read",
    "reward.judge_score_min": f"{REWARD}::test_judge_score_min_and_max_set_the_scale",
    "reward.judge_score_max": f"{REWARD}::test_judge_score_min_and_max_set_the_scale",
    "reward.judge_dtype": f"{REWARD}::test_judge_dtype_and_batch_size_reach_the_judges_engine",
    "reward.judge_batch_size": f"{REWARD}::test_judge_dtype_and_batch_size_reach_the_judges_engine",
    "reward.overlong_buffer_len": f"{RECIPES}::test_overlong_buffer_penalises_responses_near_the_cap",
    "reward.overlong_penalty_factor": f"{RECIPES}::test_overlong_buffer_penalises_responses_near_the_cap",
    # ---------------------------------------------------------------- eval
    "eval.sources": f"{RECIPE_RUN}::test_validation_runs_on_schedule_and_a_resumed_run_keeps_it",
    "eval.every": f"{RECIPE_RUN}::test_validation_runs_on_schedule_and_a_resumed_run_keeps_it",
    "eval.before_train": f"{RECIPE_RUN}::test_greedy_validation_of_two_sources_after_every_step",
    "eval.samples_per_prompt": f"{RECIPE_RUN}::test_validation_runs_on_schedule_and_a_resumed_run_keeps_it",
    "eval.temperature": f"{RECIPES}::test_eval_temperature_and_samples_are_what_the_engines_are_asked_for",
    "eval.max_prompts": f"{RECIPE_RUN}::test_validation_runs_on_schedule_and_a_resumed_run_keeps_it",
    # ---------------------------------------------------------------- placement
    "placement.mode": "tests/unit/test_sbatch_render.py::test_disjoint_is_a_heterogeneous_job_with_one_component_per_group",
    "placement.trainer.nodes": "tests/unit/test_sbatch_render.py::test_shared_step_places_each_group_on_every_node_in_rank_order",
    "placement.trainer.tasks_per_node": "tests/unit/test_plan.py::test_dp_is_derived_when_null",
    "placement.trainer.devices_per_task": "tests/unit/test_plan.py::"
                                          "test_colocate_gpu_every_group_counts_from_the_first_device_of_its_node",
    "placement.trainer.cpus_per_task": f"{EFFECTS}::test_cpus_per_task_of_each_group_reach_its_component",
    "placement.trainer.tp": "tests/unit/test_plan.py::test_dp_is_derived_when_null",
    "placement.trainer.pp": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",  # refused above 1
    "placement.trainer.cp": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",  # refused above 1
    "placement.trainer.ep": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",  # refused above 1
    "placement.trainer.pp_layers": "tests/mpi/test_pipeline.py::test_uneven_stages_equal_pp1",
    "placement.trainer.dp": "tests/unit/test_plan.py::test_dp_is_derived_when_null",
    "placement.trainer.mem": f"{EFFECTS}::test_mem_of_each_group_reaches_its_component",
    "placement.rollout.nodes": "tests/unit/test_sbatch_render.py::test_shared_step_places_each_group_on_every_node_in_rank_order",
    "placement.rollout.tasks_per_node": "tests/unit/test_routing.py::test_every_replica_is_served_once",
    "placement.rollout.devices_per_task": "tests/unit/test_plan.py::test_partial_gpu_genrm_takes_the_devices_after_rollout",
    "placement.rollout.cpus_per_task": f"{EFFECTS}::test_cpus_per_task_of_each_group_reach_its_component",
    "placement.rollout.tp": "tests/unit/test_plan.py::test_1024_gpu_disjoint_layout",
    "placement.rollout.pp": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",  # refused above 1
    "placement.rollout.cp": f"{EFFECTS}::test_engine_group_shapes_the_planner_refuses",  # refused above 1
    "placement.rollout.dp": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",  # must match ranks
    "placement.rollout.mem": f"{EFFECTS}::test_mem_of_each_group_reaches_its_component",
    "placement.genrm.nodes": "tests/unit/test_sbatch_render.py::test_shared_step_places_each_group_on_every_node_in_rank_order",
    "placement.genrm.tasks_per_node": "tests/unit/test_plan.py::test_1024_gpu_disjoint_layout",
    "placement.genrm.devices_per_task": "tests/unit/test_plan.py::"
                                        "test_colocate_gpu_every_group_counts_from_the_first_device_of_its_node",
    "placement.genrm.cpus_per_task": f"{EFFECTS}::test_cpus_per_task_of_each_group_reach_its_component",
    "placement.genrm.tp": "tests/unit/test_plan.py::test_1024_gpu_disjoint_layout",
    "placement.genrm.pp": f"{EFFECTS}::test_engine_group_shapes_the_planner_refuses",  # refused above 1
    "placement.genrm.cp": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",  # refused above 1
    "placement.genrm.dp": f"{EFFECTS}::test_engine_group_shapes_the_planner_refuses",  # must match ranks
    "placement.genrm.mem": f"{EFFECTS}::test_mem_of_each_group_reaches_its_component",
    "placement.dynamic_split.enabled": "tests/unit/test_split.py::"
                                       "test_routes_of_a_split_cover_the_pool_and_send_weights_to_next_generators",
    "placement.dynamic_split.min_replicas": f"{EFFECTS}::test_min_replicas_bounds_how_far_the_split_moves",
    "placement.dynamic_split.hysteresis": f"{EFFECTS}::test_hysteresis_decides_whether_a_better_split_is_taken",
    "placement.node_cpus": "tests/unit/test_core_share.py::test_node_cpus_gives_the_running_phase_the_nodes_cores",
    "placement.host_memory": "tests/mpi/test_placement_modes.py::"
                             "test_kept_host_memory_trains_bitwise_like_memory_in_turns_and_gives_nothing_back",
    "placement.tools.nodes": f"{TOOLS_GROUP}::test_disjoint_tools_group_is_a_heterogeneous_component_without_gpus",
    "placement.tools.tasks_per_node": "tests/mpi/test_tool_calls.py::"
                                      "test_the_tools_group_runs_every_call_and_the_rollout_rank_none",
    "placement.tools.cpus_per_task": f"{TOOLS_GROUP}::test_disjoint_tools_group_is_a_heterogeneous_component_without_gpus",
    "placement.tools.mem": f"{TOOLS_GROUP}::test_disjoint_tools_group_is_a_heterogeneous_component_without_gpus",
    # ---------------------------------------------------------------- checkpoint
    "checkpoint.interval": "tests/mpi/test_ckpt_faults.py::"
                           "test_a_corrupt_latest_checkpoint_is_skipped_moved_aside_and_the_run_resumes_from_the_one_before",
    "checkpoint.keep_last": f"{RUN}::test_keep_last_keeps_the_newest_committed_checkpoints",
    "checkpoint.async_save": f"{RUN}::"
                             "test_async_false_commits_before_the_next_step_and_async_true_writes_in_the_background",
    "checkpoint.staging_mb": f"{RUN}::"
                             "test_async_false_commits_before_the_next_step_and_async_true_writes_in_the_background",
    "checkpoint.load_from": "tests/mpi/test_grpo_run.py::test_load_from_starts_fresh_with_another_runs_weights",
    "checkpoint.stop_grace_s": "tests/mpi/test_stop_grace.py::"
                               "test_signal_in_a_long_step_commits_the_last_step_within_the_grace_and_resumes_exactly",
    # ---------------------------------------------------------------- health
    "health.heartbeat_s": "tests/mpi/test_faults.py::test_a_stopped_rank_is_noticed_named_and_the_rerun_resumes_exactly",
    "health.stall_timeout_s": "tests/mpi/test_faults.py::test_a_stopped_rank_is_noticed_named_and_the_rerun_resumes_exactly",
    # ---------------------------------------------------------------- slurm
    "slurm.job_name": "tests/unit/test_sbatch_render.py::test_rendered_script_runs_only_what_we_meant",
    "slurm.partition": "tests/unit/test_sbatch_render.py::test_rendered_script_runs_only_what_we_meant",
    "slurm.time": f"{EFFECTS}::test_submitit_executor_takes_max_requeues_and_the_time_limit",
    "slurm.account": f"{EFFECTS}::test_account_and_qos_go_to_every_component",
    "slurm.qos": f"{EFFECTS}::test_account_and_qos_go_to_every_component",
    "slurm.signal": "tests/unit/test_sbatch_render.py::"
                    "test_every_script_requeues_signals_logs_per_restart_and_execs_the_launcher",
    "slurm.max_requeues": f"{EFFECTS}::test_submitit_executor_takes_max_requeues_and_the_time_limit",
    "slurm.step_exit_timeout_s": "tests/unit/test_step_watch.py::"
                                 "test_step_exit_timeout_s_is_how_long_the_launcher_waits_for_srun_after_the_last_exit",
    "slurm.extra_flags": "tests/unit/test_sbatch_render.py::test_disjoint_is_a_heterogeneous_job_with_one_component_per_group",
    "slurm.env": "tests/unit/test_sbatch_render.py::test_rendered_script_runs_only_what_we_meant",
    # ---------------------------------------------------------------- logging
    "logging.trackers": f"{TRACKERS_RUN}::test_a_stopped_and_resumed_run_logs_every_step_once_in_one_mlflow_and_one_wandb_run",
    "logging.project": f"{TRACKERS}::test_wandb_runs_offline_in_the_run_dir_under_the_configured_project_and_name",
    "logging.run_name": f"{TRACKERS}::test_mlflow_logs_to_the_tracking_uri_given_and_reopens_the_same_run",
    "logging.mlflow_tracking_uri": f"{TRACKERS}::test_mlflow_logs_to_the_tracking_uri_given_and_reopens_the_same_run",
    "logging.samples_every": f"{TRACKERS_RUN}::"
                             "test_a_stopped_and_resumed_run_logs_every_step_once_in_one_mlflow_and_one_wandb_run",
    "logging.samples_per_replica": f"{TRACKERS_RUN}::"
                                   "test_a_stopped_and_resumed_run_logs_every_step_once_in_one_mlflow_and_one_wandb_run",
    "logging.level": f"{RUN}::test_logging_level_warning_hides_the_info_lines_of_every_rank",
    "logging.progress": f"{RUN}::test_logging_progress_prints_the_leaders_step_line",
    # ---------------------------------------------------------------- agent (AgentLoop, ToolBox, PythonSandbox)
    "agent.tools": "tests/mpi/test_agent_run.py::test_a_multi_turn_run_calls_the_tool_masks_its_results_and_trains",
    "agent.environment": f"{AGENT}::test_an_environment_steps_on_turns_without_calls_and_its_rewards_add_up",
    "agent.environment_args": f"{AGENT}::test_an_environment_steps_on_turns_without_calls_and_its_rewards_add_up",
    "agent.max_turns": f"{AGENT}::test_trajectories_end_at_the_turn_limit_the_budget_and_a_cut_turn",
    "agent.max_response_tokens": f"{AGENT}::test_trajectories_end_at_the_turn_limit_the_budget_and_a_cut_turn",
    "agent.tool_call_pattern": f"{AGENT}::test_a_tool_turn_is_appended_as_template_tokens_with_mask_zero",
    "agent.tool_role": f"{AGENT}::test_tool_role_output_cut_and_workers_come_from_the_config",
    "agent.tool_timeout_s": f"{AGENT}::test_bad_calls_become_error_text_for_the_model_and_are_counted",
    "agent.tool_workers": f"{AGENT}::test_tool_role_output_cut_and_workers_come_from_the_config",
    "agent.max_tool_output_chars": f"{AGENT}::test_tool_role_output_cut_and_workers_come_from_the_config",
    "agent.turn_schedule": f"{TURNS}::test_as_ready_fast_trajectories_take_their_later_turns_while_a_slow_tool_waits",
    "agent.sandbox.timeout_s": f"{SANDBOX}::test_an_endless_program_is_killed",
    "agent.sandbox.cpu_s": f"{SANDBOX}::test_an_endless_program_is_killed",
    "agent.sandbox.memory_mb": f"{SANDBOX}::test_memory_past_the_limit_is_an_error",
    "agent.sandbox.file_mb": f"{SANDBOX}::test_writing_outside_its_directory_fails_and_leaves_nothing",
    "agent.sandbox.processes": f"{SANDBOX}::test_a_fork_bomb_is_contained",
    "agent.sandbox.output_chars": f"{SANDBOX}::test_a_huge_output_is_cut_and_the_program_stopped",
    "agent.sandbox.python": f"{SANDBOX}::test_an_unusable_interpreter_is_refused_naming_the_setting",
    "agent.sandbox.allow_network": f"{SANDBOX}::test_allow_network_gives_the_program_the_ranks_network",
}

REFUSED: dict[str, str] = {
    "train.moe_routing_replay": "tests/unit/test_routing_replay.py::test_what_cannot_record_routing_is_refused_naming_the_field",
    "agent.tools": AGENT_TOOLS,
    "agent.environment_args": AGENT_TOOLS,
    "agent.tool_call_pattern": AGENT_TOOLS,
    "agent.max_response_tokens": AGENT_TOOLS,
    "agent.turn_schedule": f"{TURNS}::test_as_ready_without_a_tool_is_refused_naming_the_field_and_the_fix",
    "data.system_prompt": "tests/unit/test_chat_prompts.py::test_chat_fields_are_refused_in_text_format",
    "data.chat_template": "tests/unit/test_chat_prompts.py::test_chat_fields_are_refused_in_text_format",
    "data.num_prompts": "tests/unit/test_config.py::test_bad_values_name_field_value_and_fix",
    "data.images_key": f"{IMAGES}::test_image_fields_are_refused_where_they_cannot_act",  # with a demo source
    "data.max_image_pixels": f"{IMAGES}::test_image_fields_are_refused_where_they_cannot_act",  # without images
    "model.dtype": f"{EFFECTS}::test_refused_values_name_the_field_and_the_fix",
    "train.steps": "tests/unit/test_config.py::test_bad_values_name_field_value_and_fix",
    "train.prompts_per_step": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",
    "rollout.engine": f"{EFFECTS}::test_refused_values_name_the_field_and_the_fix",
    "rollout.top_p": f"{EFFECTS}::test_refused_values_name_the_field_and_the_fix",
    "rollout.over_dispatch_ratio": "tests/unit/test_overdispatch.py::"
                                   "test_over_dispatch_ratio_out_of_range_names_field_and_value",
    "rollout.routing": "tests/unit/test_overdispatch.py::test_routing_knob_lists_its_choices",
    "rollout.weight_transport": "tests/unit/test_weight_transport.py::"
                                "test_collective_is_refused_before_launch_where_it_cannot_work",
    "placement.mode": "tests/unit/test_config.py::test_bad_values_name_field_value_and_fix",
    "placement.trainer.tp": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",
    "placement.trainer.dp": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",
    "placement.trainer.devices_per_task": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",
    "placement.trainer.mem": "tests/unit/test_sbatch_render.py::test_bad_values_are_rejected_naming_the_field",
    "placement.trainer.pp_layers": "tests/unit/test_pipeline_split.py::test_refused_splits_name_the_field_and_the_fix",
    "placement.rollout.nodes": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",
    "placement.rollout.tasks_per_node": "tests/unit/test_config.py::test_bad_values_name_field_value_and_fix",
    "placement.rollout.tp": "tests/unit/test_plan.py::test_impossible_layouts_name_field_and_fix",
    "placement.genrm.cpus_per_task": "tests/unit/test_split.py::test_impossible_dynamic_split_names_field_and_fix",
    "placement.dynamic_split.min_replicas": "tests/unit/test_split.py::test_impossible_dynamic_split_names_field_and_fix",
    "placement.node_cpus": "tests/unit/test_core_share.py::test_other_placements_keep_cpus_per_task_and_refuse_node_cpus",
    "placement.host_memory": "tests/unit/test_core_share.py::"
                             "test_host_memory_kept_is_refused_where_no_rank_hands_memory_over",
    "placement.tools.tasks_per_node": f"{TOOLS_GROUP}::"
                                      "test_a_tools_group_that_cannot_run_is_refused_naming_the_field_and_the_fix",
    "placement.tools.nodes": f"{TOOLS_GROUP}::test_a_shared_placement_refuses_a_tools_group_on_other_nodes",
    "checkpoint.keep_last": "tests/unit/test_config.py::test_bad_values_name_field_value_and_fix",
    "checkpoint.stop_grace_s": f"{EFFECTS}::test_refused_values_name_the_field_and_the_fix",
    "health.heartbeat_s": "tests/unit/test_health.py::test_the_timeout_must_leave_room_for_late_beats",
    "slurm.job_name": "tests/unit/test_sbatch_render.py::test_bad_values_are_rejected_naming_the_field",
    "slurm.partition": "tests/unit/test_sbatch_render.py::test_bad_values_are_rejected_naming_the_field",
    "slurm.time": f"{EFFECTS}::test_refused_values_name_the_field_and_the_fix",
    "slurm.signal": "tests/unit/test_sbatch_render.py::test_bad_values_are_rejected_naming_the_field",
    "slurm.extra_flags": "tests/unit/test_sbatch_render.py::test_bad_values_are_rejected_naming_the_field",
    "slurm.env": "tests/unit/test_sbatch_render.py::test_bad_values_are_rejected_naming_the_field",
    "train.max_tokens_per_micro_batch": "tests/unit/test_micro_batches.py::"
                                        "test_nonsense_budgets_are_refused_at_load_naming_the_field_value_and_fix",
    "train.lora.rank": f"{LORA}::test_lora_settings_that_cannot_act_are_refused_at_load",  # with load_from
    "train.lora.alpha": f"{LORA}::test_lora_settings_that_cannot_act_are_refused_at_load",  # without a rank
    "train.lora.dropout": f"{LORA}::test_lora_settings_that_cannot_act_are_refused_at_load",
    "train.lora.target_modules": f"{LORA}::test_lora_modules_the_model_does_not_have_are_refused_before_launch",
    "train.recompute": f"{RECOMPUTE}::test_recompute_settings_that_cannot_act_are_refused_at_load",
    "train.critic.path": f"{CRITIC}::test_critic_settings_the_run_cannot_take_are_refused_before_launch",
    "train.critic.lam": f"{GAE}::test_critic_settings_that_cannot_act_are_refused_at_load",
    "train.critic.value_clip": f"{GAE}::test_critic_settings_that_cannot_act_are_refused_at_load",
    "train.critic.min_lr": f"{GAE}::test_critic_settings_that_cannot_act_are_refused_at_load",
    "train.critic.lr_decay_steps": f"{GAE}::test_critic_settings_that_cannot_act_are_refused_at_load",
    "train.critic.adam_betas": f"{GAE}::test_critic_settings_that_cannot_act_are_refused_at_load",
    "train.critic.warmup_steps": f"{GAE}::test_critic_settings_that_cannot_act_are_refused_at_load",
    "rollout.max_staleness": "tests/unit/test_config.py::test_bad_values_name_field_value_and_fix",
    "rollout.partial_rollouts": "tests/unit/test_config.py::test_bad_values_name_field_value_and_fix",
    "rollout.partial_segment_tokens": "tests/unit/test_config.py::test_bad_values_name_field_value_and_fix",
    "train.off_policy.correction": "tests/unit/test_off_policy.py::test_settings_that_cannot_act_are_refused",
    "train.off_policy.cap": "tests/unit/test_off_policy.py::test_settings_that_cannot_act_are_refused",
    "train.off_policy.mask_low": "tests/unit/test_off_policy.py::test_settings_that_cannot_act_are_refused",
    "train.off_policy.mask_high": "tests/unit/test_off_policy.py::test_settings_that_cannot_act_are_refused",
    "train.recompute_method": f"{RECOMPUTE}::test_recompute_settings_that_cannot_act_are_refused_at_load",
    "train.recompute_num_layers": f"{RECOMPUTE}::test_recomputed_layers_the_model_cannot_take_are_refused",
    "train.adv_estimator": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.loss_agg_mode": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.clip_ratio_c": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.adv_std": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.adv_eps": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.gamma": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.kl_in_reward": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.kl_estimator": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.kl_horizon": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.min_lr": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.lr_decay_steps": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.mini_batches": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "train.adam_betas": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "reward.overlong_buffer_len": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "reward.overlong_penalty_factor": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "eval.every": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "eval.temperature": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "eval.sources": f"{RECIPES}::test_refused_recipe_settings_name_the_field_and_the_fix",
    "reward.mode": TERMS,  # disagreeing with reward.terms
    "reward.alpha": TERMS,  # other than its default with reward.terms
    "reward.beta": TERMS,
    "reward.terms": TERMS,
    "reward.judge_template": TERMS,  # without a judge
    "reward.judge_batch_size": TERMS,  # without a judge
    "reward.judge_pattern": TERMS,
    "reward.judge_score_min": TERMS,
    "reward.judge_score_max": TERMS,
    "logging.trackers": f"{TRACKERS}::test_a_tracker_whose_library_is_missing_is_refused_at_load_with_the_install_command",
    "logging.project": f"{TRACKERS}::test_refused_logging_settings_name_the_field_the_value_and_the_fix",
    "logging.run_name": f"{TRACKERS}::test_refused_logging_settings_name_the_field_the_value_and_the_fix",
    "logging.mlflow_tracking_uri": f"{TRACKERS}::test_refused_logging_settings_name_the_field_the_value_and_the_fix",
    "logging.samples_per_replica": f"{TRACKERS}::test_refused_logging_settings_name_the_field_the_value_and_the_fix",
}

# Entries whose test file names neither the field nor its leaf; each with why the test still shows it.
UNMENTIONED: dict[str, str] = {
    "rollout.dynamic_sampling.ema_decay": "its docstring derives the counts from 'EMA decay 0.9' and the test "
                                          "computes `0.9 * ema + 0.1 * 10.0`",
    "rollout.dynamic_sampling.ema_cap": "its docstring derives the counts from 'cap 10' and the test computes "
                                        "`0.9 * ema + 0.1 * 10.0` (the expansion of a step with no valid group)",
}


def _sections(annotation) -> list[type[Section]]:
    """The Section classes an annotation holds (`X`, or `X | None`)."""
    if isinstance(annotation, type):
        return [annotation] if issubclass(annotation, Section) else []
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, Section)]
    return []


def schema_fields(model: type[Section] = RunConfig, prefix: str = "") -> dict[str, object]:
    """Dotted name -> FieldInfo of every leaf field (dict- and list-valued fields are leaves)."""
    out: dict[str, object] = {}
    for name, info in model.model_fields.items():
        nested = _sections(info.annotation)
        if nested:
            assert len(nested) == 1, f"{prefix}{name}: a field of several section types cannot be walked"
            out.update(schema_fields(nested[0], f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = info
    return out


FIELDS = schema_fields()


@functools.cache
def _test_functions(path: str) -> set[str]:
    """`name` and `Class::name` of every test function in a file (module level or in a class)."""
    file = REPO / path
    if not file.is_file():
        return set()
    found: set[str] = set()
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found |= {item.name, f"{node.name}::{item.name}"}
    return found


def _missing_test(node_id: str) -> str | None:
    path, sep, name = node_id.partition("::")
    if not sep or not name:
        return f"{node_id!r} is not of the form tests/<dir>/test_x.py::test_name"
    if not (REPO / path).is_file():
        return f"{node_id}: no file {path}"
    if name not in _test_functions(path):
        return f"{node_id}: {path} has no test function {name}"
    return None


def test_the_walk_finds_every_section_and_keeps_mappings_whole():
    assert {"placement.trainer.tp", "placement.rollout.tp", "placement.genrm.tp",
            "rollout.dynamic_sampling.oversampling", "placement.dynamic_split.hysteresis"} <= FIELDS.keys()
    assert {"slurm.env", "slurm.extra_flags"} <= FIELDS.keys()
    assert not any(name.startswith(("slurm.env.", "slurm.extra_flags.")) for name in FIELDS)
    assert not ({"placement.trainer", "rollout.dynamic_sampling", "model"} & FIELDS.keys()), "sections are not leaves"
    assert len(FIELDS) > 90


def test_every_config_field_names_the_test_that_shows_its_effect():
    missing = sorted(FIELDS.keys() - EFFECT.keys())
    problems = [f"  {name}: no test shows its effect" for name in missing]
    problems += [f"  {name}: not a field of RunConfig any more; remove its EFFECT entry"
                 for name in sorted(EFFECT.keys() - FIELDS.keys())]
    problems += [f"  {name}: REFUSED names a field RunConfig does not have" for name in sorted(REFUSED.keys() - FIELDS.keys())]
    problems += [f"  {name}: UNMENTIONED exempts a field EFFECT does not map"
                 for name in sorted(UNMENTIONED.keys() - EFFECT.keys())]
    assert not problems, (
        f"{len(missing)} of {len(FIELDS)} config fields have no test that shows their effect:\n" + "\n".join(problems)
        + f"\nFor each: write a test that sets the field and asserts what it changes (or that a validator refuses "
        f"it, naming the field and the fix), and add it to EFFECT in {Path(__file__).relative_to(REPO)}.")


@pytest.mark.parametrize("registry", [pytest.param(EFFECT, id="EFFECT"), pytest.param(REFUSED, id="REFUSED")])
def test_every_named_test_exists(registry):
    problems = [f"  {field}: {why}" for field, node_id in sorted(registry.items()) if (why := _missing_test(node_id))]
    assert not problems, "registry entries naming no test:\n" + "\n".join(problems)


def _mentions(text: str, field: str) -> bool:
    info = FIELDS[field]
    section, _, leaf = field.rpartition(".")
    names = [field, leaf] + ([f"{section}.{info.alias}" if section else info.alias, info.alias] if info.alias else [])
    return any(re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) for name in names)


@pytest.mark.parametrize("registry", [pytest.param(EFFECT, id="EFFECT"), pytest.param(REFUSED, id="REFUSED")])
def test_each_named_test_file_mentions_its_field(registry):
    problems = []
    for field, node_id in sorted(registry.items()):
        path = REPO / node_id.partition("::")[0]
        if field in FIELDS and path.is_file() and not _mentions(path.read_text(), field):
            if registry is EFFECT and field in UNMENTIONED:
                continue
            problems.append(f"  {field}: {path.relative_to(REPO)} names neither {field} nor its leaf")
        elif registry is EFFECT and field in UNMENTIONED and path.is_file():
            problems.append(f"  {field}: {path.relative_to(REPO)} names it now; drop its UNMENTIONED exemption")
    assert not problems, ("an entry must point at a test that sets the field or relies on its value; if it does "
                          "without naming it, exempt it in UNMENTIONED with the reason:\n" + "\n".join(problems))
    assert all(why.strip() for why in UNMENTIONED.values())
