"""Config loading: every shipped config validates; every bad input is one clear error, exit 2 from the CLI."""
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from yatt_hpc.config import ConfigError, load_config, to_yaml
from yatt_hpc.config.docs import reference_markdown
from yatt_hpc.config.schema import RunConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in CONFIGS])
def test_shipped_configs_load_and_roundtrip(path, tmp_path):
    cfg = load_config(path)
    again = tmp_path / "resolved.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg


def test_overrides_parse_yaml_values_and_nested_keys():
    cfg = load_config(REPO / "configs/demo_cpu.yaml",
                      ["train.steps=3", "checkpoint.async=false", "placement.trainer.dp=null", "slurm.partition=gpu"])
    assert cfg.train.steps == 3 and cfg.checkpoint.async_save is False
    assert cfg.placement.trainer.dp is None and cfg.slurm.partition == "gpu"


def test_config_is_frozen():
    cfg = load_config(REPO / "configs/demo_cpu.yaml")
    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.steps = 5


def test_every_field_has_a_docstring():
    text = reference_markdown()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 50
    assert all(not line.rstrip().endswith("|  |") for line in rows), [r for r in rows if r.rstrip().endswith("|  |")]


BAD = [
    pytest.param(["train.stepz=3"], ["unknown key 'train.stepz'", "valid keys here: steps, seed"], id="unknown-key"),
    pytest.param(["placement.bogus=1"], ["unknown key 'placement.bogus'", "mode, trainer, rollout, genrm"],
        id="unknown-section-key"),
    pytest.param(["train.steps=ten"], ["train.steps", "'ten'", "valid integer"], id="wrong-type"),
    pytest.param(["train.steps=-1"], ["train.steps", "-1", "greater than or equal to 0"], id="negative-steps"),
    pytest.param(["placement.mode=ring"], ["placement.mode", "'ring'", "'colocate', 'partial' or 'disjoint'"], id="bad-mode"),
    pytest.param(["placement.rollout.tasks_per_node=0"], ["placement.rollout.tasks_per_node", "0"], id="zero-rollout-ranks"),
    pytest.param(["train.steps"], ["is not of the form section.field=value"], id="override-without-value"),
    pytest.param(["checkpoint.keep_last=1"], ["checkpoint.keep_last", "greater than or equal to 2"], id="keep-last-1"),
    pytest.param(["data.source=x.jsonl", "data.num_prompts=10"], ["data.num_prompts=10 sizes the demo task only"],
                 id="num-prompts-with-a-file"),
    pytest.param(["train.lr=inf"], ["train.lr", "'inf'", "finite number"], id="lr-inf"),
    pytest.param(["checkpoint.stop_grace_s=nan"], ["checkpoint.stop_grace_s", "finite number"], id="grace-nan"),
    pytest.param(["slurm.time=abc"], ["slurm.time='abc' is not a Slurm time limit", "4:00:00"], id="slurm-time"),
    pytest.param(["rollout.top_p=0.9"], ["rollout.top_p=0.9 is not supported", "set rollout.top_p=1.0"], id="top-p"),
    pytest.param(["model.dtype=float16"], ["model.dtype=float16 is not supported", "model.dtype=bfloat16"],
                 id="fp16"),
    pytest.param(["rollout.engine=sglang"], ["rollout.engine=sglang", "placement.rollout.devices_per_task=0"],
                 id="sglang-on-cpu"),
    pytest.param(["rollout.engine=sglang", "placement.rollout.devices_per_task=1"],
                 ["placement.genrm.devices_per_task=0", "GenRM"], id="sglang-judge-on-cpu"),
    pytest.param(["placement.genrm.devices_per_task=2", "placement.genrm.tp=2"],
                 ["placement.genrm.tp=2: the hf engine runs one device per replica"], id="hf-engine-tp2"),
    pytest.param(["rollout.max_staleness=1"], ["rollout.max_staleness=1 with placement.mode=colocate",
                                               "use placement.mode=partial or disjoint"], id="async-colocate"),
    pytest.param(["rollout.max_staleness=1", "placement.mode=disjoint", "rollout.dynamic_sampling.enabled=true"],
                 ["rollout.max_staleness=1 with rollout.dynamic_sampling.enabled"], id="async-dynamic-sampling"),
    pytest.param(["rollout.max_staleness=2", "placement.mode=partial", "placement.dynamic_split.enabled=true",
                  "eval.sources=[]", "eval.samples_per_prompt=1", "eval.max_prompts=null"],
                 ["rollout.max_staleness=2 with placement.dynamic_split.enabled"], id="async-dynamic-split"),
    pytest.param(["rollout.partial_rollouts=true", "rollout.over_dispatch_ratio=1.5"],
                 ["rollout.partial_rollouts=true with rollout.max_staleness=0", "set rollout.max_staleness >= 1"],
                 id="partial-synchronous"),
    pytest.param(["rollout.partial_rollouts=true", "rollout.max_staleness=1", "placement.mode=disjoint"],
                 ["rollout.over_dispatch_ratio=1", "rollout.over_dispatch_ratio > 1"], id="partial-no-over-dispatch"),
    pytest.param(["rollout.partial_rollouts=true", "rollout.max_staleness=1", "placement.mode=disjoint",
                  "rollout.over_dispatch_ratio=1.5", "rollout.streaming=finished_groups"],
                 ["rollout.streaming=finished_groups with rollout.partial_rollouts=true", "rollout.streaming=chunks"],
                 id="partial-finished-groups"),
    pytest.param(["rollout.partial_rollouts=true", "rollout.max_staleness=1", "placement.mode=disjoint",
                  "rollout.over_dispatch_ratio=1.5", "rollout.partial_segment_tokens=12"],
                 ["rollout.partial_segment_tokens=12 with rollout.max_new_tokens=12", "below max_new_tokens"],
                 id="partial-segment-too-long"),
    pytest.param(["rollout.partial_segment_tokens=4"],
                 ["rollout.partial_segment_tokens=4 without rollout.partial_rollouts", "rollout.partial_rollouts=true"],
                 id="segment-without-partial"),
]


@pytest.mark.parametrize("overrides, needles", BAD)
def test_bad_values_name_field_value_and_fix(overrides, needles):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/demo_cpu.yaml", overrides)
    for needle in needles:
        assert needle in str(err.value)


def test_partial_rollouts_segment_defaults_to_a_quarter_of_the_response_cap():
    sets = ["rollout.partial_rollouts=true", "rollout.max_staleness=1", "placement.mode=disjoint",
            "rollout.over_dispatch_ratio=1.5"]
    assert load_config(REPO / "configs/demo_cpu.yaml", sets).rollout.segment_tokens == 3  # max_new_tokens 12
    assert load_config(REPO / "configs/demo_cpu.yaml", [*sets, "rollout.max_new_tokens=13"]).rollout.segment_tokens == 4


def test_missing_and_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(bad)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(binary)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)


def test_defaults_are_a_valid_config():
    assert RunConfig().placement.mode == "colocate"


CLI_BAD = [
    pytest.param(["plan", "configs/demo_cpu.yaml", "--set", "train.stepz=1"], "unknown key", id="plan-unknown-key"),
    pytest.param(["config", "show", "configs/demo_cpu.yaml", "--set", "train.steps=-2"], "train.steps", id="show-negative"),
    pytest.param(["plan", "configs/demo_cpu.yaml", "--set", "placement.trainer.tp=3"], "does not divide",
        id="plan-tp-not-dividing"),
    pytest.param(["plan", "configs/missing.yaml"], "does not exist", id="plan-missing-file"),
    pytest.param(["plan", "configs/demo_cpu.yaml", "--set", "train.prompts_per_step=15"], "multiple of the trainer's dp=2",
        id="plan-batch-not-divisible"),
]


@pytest.mark.parametrize("argv, needle", CLI_BAD)
def test_cli_user_errors_exit_2_without_traceback(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "yatt_hpc.cli", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in CONFIGS])
def test_cli_plan_prints_every_shipped_config(path):
    proc = subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "plan", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for word in ("trainer", "rollout", "genrm", "mpirun", "srun --mpi=pmix"):
        assert word in proc.stdout
