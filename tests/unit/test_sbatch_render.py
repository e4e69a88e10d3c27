"""The job script renderer: shape per placement mode, required flags, and injection safety."""
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yatt_hpc.config import load_config
from yatt_hpc.config.schema import RunConfig
from yatt_hpc.launch.commands import rank_hosts, srun_launch
from yatt_hpc.launch.failures import first_failure
from yatt_hpc.launch.jobs import group_label
from yatt_hpc.launch.sbatch import LAUNCHER_MODULE, SbatchError, directive_lines, render_sbatch, time_minutes
from yatt_hpc.placement import plan

REPO = Path(__file__).resolve().parents[2]
PY = "/opt/venv/bin/python"


def _cfg(*overrides: str, config: str = "configs/demo_cpu.yaml") -> RunConfig:
    return load_config(REPO / config, overrides)


def _render(cfg: RunConfig, run_dir: str = "/runs/a", python: str = PY, **kw) -> str:
    return render_sbatch(cfg, plan(cfg), run_dir, python, **kw)


def _directives(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_disjoint_is_a_heterogeneous_job_with_one_component_per_group():
    cfg = _cfg("placement.mode=disjoint", "slurm.extra_flags.rollout=['--constraint=fast']")
    lines = _directives(_render(cfg))
    assert lines.count("#SBATCH hetjob") == 2
    blocks = "\n".join(lines).split("#SBATCH hetjob")
    assert "--ntasks-per-node=2" in blocks[0] and "--ntasks-per-node=1" in blocks[1]
    assert "--constraint=fast" in blocks[1] and "--constraint" not in blocks[0] + blocks[2]
    assert all("--time=00:30:00" in b for b in blocks), "every component needs the time limit"
    assert "--job-name" in blocks[0] and "--job-name" not in blocks[1]


def test_colocate_is_one_allocation_holding_every_rank_per_node():
    lines = _directives(_render(_cfg()))
    assert "#SBATCH hetjob" not in lines
    assert "#SBATCH --nodes=1" in lines and "#SBATCH --ntasks-per-node=4" in lines


def test_partial_gpu_asks_for_the_nodes_devices_not_the_sum():
    text = _render(load_config(REPO / "configs/partial_gpu.yaml"))
    assert "#SBATCH --gpus-per-node=8" in text and "#SBATCH --ntasks-per-node=15" in text


@pytest.mark.parametrize("mode", ["colocate", "disjoint"])
def test_every_script_requeues_signals_logs_per_restart_and_execs_the_launcher(mode):
    text = _render(_cfg(f"placement.mode={mode}", "slurm.signal=USR1@120"))
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@120" in text
    assert "#SBATCH --output=/runs/a/logs/slurm-%j.out" in text
    assert 'job_${SLURM_JOB_ID}_${SLURM_RESTART_COUNT:-0}.log' in text
    assert "export SUBMITIT_PREEMPT_SIGNAL=USR1" in text
    assert text.rstrip().endswith(f"exec {PY} -u -m {LAUNCHER_MODULE} --run-dir /runs/a")


def test_submitit_form_runs_submitits_runner_on_the_same_script():
    text = _render(_cfg(), submitit_folder="/runs/a/submitit")
    assert "export SUBMITIT_EXECUTOR=slurm" in text
    assert text.rstrip().endswith(f"exec {PY} -u -m submitit.core._submit /runs/a/submitit")
    assert _directives(text) == _directives(_render(_cfg()))


def test_percent_in_run_dir_is_escaped_for_slurm_filename_patterns():
    assert "#SBATCH --output=/runs/50%%/logs/slurm-%j.out" in _render(_cfg(), run_dir="/runs/50%")


@pytest.mark.parametrize("override, field", [
    pytest.param('slurm.job_name="a\\nb"', "slurm.job_name", id="newline-in-name"),
    pytest.param("slurm.partition='gpu\\\\x'", "slurm.partition", id="backslash-in-partition"),
    pytest.param("slurm.extra_flags.trainer=['constraint=x']", "slurm.extra_flags.trainer", id="flag-without-dash"),
    pytest.param("slurm.env={'A B': x}", "slurm.env", id="bad-env-name"),
    pytest.param("slurm.signal=USR2", "slurm.signal", id="signal-without-time"),
    pytest.param("placement.trainer.mem=lots", "placement.trainer.mem", id="bad-mem"),
])
def test_bad_values_are_rejected_naming_the_field(override, field):
    with pytest.raises(SbatchError, match=re.escape(field)):
        _render(_cfg(override))


@pytest.mark.parametrize("text, minutes", [("90", 90), ("1:30", 2), ("01:00:00", 60), ("1-00:00:00", 1440),
                                           ("2-3", 3060), ("0-0:10", 10)])
def test_time_minutes(text, minutes):
    assert time_minutes(text) == minutes


def test_shared_step_places_each_group_on_every_node_in_rank_order():
    p = plan(_cfg("placement.trainer.nodes=2", "placement.rollout.nodes=2", "placement.genrm.nodes=2",
                  "placement.trainer.dp=null"))
    assert rank_hosts(p, ["n1", "n2"]) == ["n1", "n1", "n2", "n2", "n1", "n2", "n1", "n2"]
    argv = srun_launch(p, "/r", python="py")
    assert "--distribution=arbitrary" in argv and "--ntasks=8" in argv and ":" not in argv
    assert "trainer=0-3,rollout=4-5,genrm=6-7" in argv


def test_first_failure_maps_het_component_task_to_world_rank():
    p = plan(_cfg("placement.mode=disjoint"))
    lines = ["srun: error: n2: task 0: Exited with exit code 7\n", "srun: error: n1: tasks 0-1: Terminated\n"]
    assert first_failure(lines, p, {"n1": "trainer", "n2": "rollout", "n3": "genrm"}) == \
        "rollout (world rank 2) on n2: Exited with exit code 7"
    worker = ["x\n", "yatt-hpc [genrm rank 3] failed: ValueError: boom (traceback in /r/logs/x.log)\n"]
    assert first_failure(worker + lines, p).startswith("genrm (world rank 3): ValueError: boom")


def test_a_rank_that_lost_its_peer_is_not_named_when_mpirun_saw_the_peer_killed():
    """A trainer killed mid all-reduce: the other trainer's Gloo read fails at once and its line comes
    before mpirun's notice (CI saw exactly these lines); the killed rank is the first failure. A line of
    the killed rank itself, or any other error, still names its rank."""
    p = plan(_cfg())
    lost = "yatt-hpc [trainer rank 0] failed: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error " \
           "[127.0.0.1]:30622: Connection reset by peer. (traceback in /r/logs/rank-0000-trainer.log)\n"
    notice = "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).\n"
    assert first_failure([lost, notice], p) == "trainer (world rank 1) on vm: killed by signal 9 (Killed)"
    own = "yatt-hpc [trainer rank 1] failed: RuntimeError: Connection reset by peer\n"
    assert first_failure([own, notice], p).startswith("trainer (world rank 1): RuntimeError")
    other = "yatt-hpc [rollout rank 2] failed: ValueError: boom\n"
    assert first_failure([other, notice], p).startswith("rollout (world rank 2): ValueError: boom")
    assert first_failure([lost], p).startswith("trainer (world rank 0): RuntimeError")  # nobody else named


@pytest.mark.parametrize("job_id, group", [("42+1.0", "rollout"), ("42+0", "trainer"), ("42.batch", "launcher"),
                                           ("42.0", "all groups"), ("42", "job"), ("42+2", "genrm")])
def test_group_label(job_id, group):
    assert group_label(job_id) == group


@pytest.mark.parametrize("script, config", [("grpo_colocate.sbatch", "configs/demo_cpu.yaml"),
                                            ("grpo_disjoint.sbatch", "configs/disjoint_cpu.yaml")])
def test_hand_scripts_match_their_configs_plan(script, config):
    text = (REPO / "sbatch" / script).read_text()
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    cfg = load_config(REPO / config)
    want = [line for line in directive_lines(cfg, plan(cfg), "X") if "--output" not in line]
    assert [line for line in _directives(text) if "--output" not in line] == want, \
        f"sbatch/{script} drifted from {config}; copy the lines of `yatt-hpc plan {config} --sbatch`"
    assert f"CONFIG=${{CONFIG:-{config}}}" in text and f"-m {LAUNCHER_MODULE}" in text


# --- injection: whatever reaches the script is quoted exactly, or rejected -------------------------------

SHELLY = list("ab /'\"$()`;|&%#*?~{}!<>=-")
QUOTABLE = st.text(alphabet=st.sampled_from(SHELLY), min_size=1, max_size=12)  # must render, quoted
NASTY = st.one_of(QUOTABLE, st.text(alphabet=st.sampled_from(SHELLY + ["\n", "\\", "\r"]), min_size=1, max_size=12))
BODY_ONLY = st.text(alphabet=st.sampled_from(SHELLY + ["\\"]), min_size=1, max_size=12)  # bash-quoted only


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=NASTY, partition=NASTY, flag=NASTY, run_dir=NASTY, python=BODY_ONLY, env_value=BODY_ONLY)
def test_rendered_script_runs_only_what_we_meant(name, partition, flag, run_dir, python, env_value):
    base = _cfg("placement.mode=disjoint")
    slurm = base.slurm.model_copy(update={"job_name": name, "partition": partition,
                                          "extra_flags": {"trainer": ["--comment=" + flag]},
                                          "env": {"YATT_X": env_value}})
    cfg = base.model_copy(update={"slurm": slurm})
    run_dir = "/r/" + run_dir
    try:
        text = render_sbatch(cfg, plan(cfg), run_dir, python)
    except SbatchError as err:
        # rejected: only for what no quoting makes safe in a #SBATCH line (control characters, backslashes)
        assert any(ch in name + partition + flag + run_dir for ch in "\n\r\\"), err
        return
    assert subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True).returncode == 0, text
    lines = text.splitlines()
    # the header: only `#SBATCH` lines (no line broke out of its comment), each ONE word as sbatch parses it
    header = [line for line in lines[3:] if line][:len(_directives(text))]
    assert all(line.startswith("#SBATCH ") for line in header), header
    words = {shlex.split(line[len("#SBATCH "):])[0] for line in header if line != "#SBATCH hetjob"}
    assert all(len(shlex.split(line[len("#SBATCH "):])) == 1 for line in header)
    assert {f"--job-name={name}", f"--partition={partition}", "--comment=" + flag,
            f"--output={run_dir.replace('%', '%%').rstrip('/')}/logs/slurm-%j.out"} <= words
    # the body: exactly the commands we wrote, with our values as single words
    body = [shlex.split(line, comments=True) for line in lines[len(header) + 4:]]
    body = [cmd for cmd in body if cmd]
    assert body[2] == [f"run_dir={run_dir}"]
    assert ["export", f"YATT_X={env_value}"] in body
    assert body[-1] == ["exec", python, "-u", "-m", LAUNCHER_MODULE, "--run-dir", run_dir]
    assert len(body) == 9, body
