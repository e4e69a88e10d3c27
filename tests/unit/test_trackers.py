"""Experiment trackers without MPI: what the config refuses, a missing library, a failing tracker dropped
once, a resume that sends no step twice, sample rows and tables, and W&B and MLflow taking the run's
names and store (the real libraries, offline and on a local SQLite store)."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.trackers import wandb_history, wandb_run_record
from yatt_hpc.batch import SampleBatch
from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.metrics.tables import markdown_table, table_of
from yatt_hpc.metrics.tracking import BaseTracker, TrackerFailed, TrackerSettings
from yatt_hpc.metrics.writer import RunMetrics
from yatt_hpc.roles.samples import TermLabels, pick, sample_rows, samples_due

DEMO = "configs/demo_cpu.yaml"


@pytest.mark.parametrize("sets, says", [
    pytest.param(["logging.tensorboard=false"], ["logging.tensorboard=False", "logging.trackers: [tensorboard]", "[]"],
                 id="the-old-switch"),
    pytest.param(["logging.trackers=[mlflow,mlflow]"], ["logging.trackers", "mlflow twice", "list each tracker once"],
                 id="twice"),
    pytest.param(["logging.project=team"], ["logging.project='team'", "wandb and mlflow", "add one to logging.trackers"],
                 id="project-without-a-tracker-that-reads-it"),
    pytest.param(["logging.run_name=a"], ["logging.run_name='a'", "drop logging.run_name"], id="run-name-alone"),
    pytest.param(["logging.mlflow_tracking_uri=http://host:5000"], ["mlflow is not in logging.trackers"],
                 id="uri-without-mlflow"),
    pytest.param(["logging.trackers=[mlflow]", "logging.mlflow_tracking_uri=mlruns"],
                 ["logging.mlflow_tracking_uri='mlruns' is not a tracking URI", "sqlite:////abs/path/mlflow.db"],
                 id="uri-not-a-uri"),
    pytest.param(["logging.samples_every=0", "logging.samples_per_replica=4"],
                 ["logging.samples_per_replica=4", "logging.samples_every=0", "writes no sample table"],
                 id="rows-without-tables"),
    pytest.param(["logging.samples_every=-1"], ["logging.samples_every", "-1"], id="negative-every"),
])
def test_refused_logging_settings_name_the_field_the_value_and_the_fix(sets, says):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, sets)
    for text in says:
        assert text in str(err.value), str(err.value)


@pytest.mark.parametrize("tracker, hidden", [("wandb", "wandb"), ("mlflow", "mlflow"), ("mlflow", "sqlalchemy")])
def test_a_tracker_whose_library_is_missing_is_refused_at_load_with_the_install_command(monkeypatch, tracker, hidden):
    monkeypatch.setitem(sys.modules, hidden, None)  # Python's own "this module cannot be imported"
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [f"logging.trackers=[tensorboard,{tracker}]"])
    text = str(err.value)
    assert f"logging.trackers names {tracker}, but {hidden}" in text and "pip install 'yatt-hpc[trackers]'" in text
    assert f"drop {tracker} from logging.trackers" in text


def test_loading_a_config_with_trackers_imports_none_of_their_libraries():
    import subprocess

    code = ("import sys; from yatt_hpc.config import load_config; "
            "load_config('configs/demo_cpu.yaml', ['logging.trackers=[tensorboard,wandb,mlflow]']); "
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", "every rank loads the config: it must not import a tracker's library"


# ------------------------------------------------------------------ the leader's writer, with fake trackers

class Recording(BaseTracker):
    """A tracker that keeps what it was given; `fail_at`: the step whose log raises (as a full disk would)."""

    def __init__(self, name: str, purges: bool = False, fail_at: int | None = None) -> None:
        self.name, self.purges_on_resume, self.fail_at = name, purges, fail_at
        self.steps, self.tables, self.images, self.closed = [], [], [], []
        self.opened: tuple | None = None

    def open(self, resume_step, saved):
        self.opened = (resume_step, saved)
        return {"run_id": (saved or {}).get("run_id", f"{self.name}-1")}

    def log(self, step, scalars):
        if step == self.fail_at:
            raise OSError(28, "No space left on device")
        self.steps.append(step)

    def log_table(self, step, name, columns, rows):
        self.tables.append((step, name, len(rows)))

    def log_image(self, step, name, path):
        self.images.append((step, name, Path(path).name))

    def close(self, outcome):
        self.closed.append(outcome)


def writer(run_dir, trackers, stream=None) -> RunMetrics:
    return RunMetrics(run_dir, TrackerSettings(names=[t.name for t in trackers], run_dir=run_dir),
                      failed=TrackerFailed(stream), build=lambda _: trackers)


def test_a_tracker_that_raises_is_reported_once_and_dropped_while_the_others_and_metrics_jsonl_go_on(tmp_path):
    failing, other, err = Recording("mlflow", fail_at=2), Recording("wandb"), io.StringIO()
    metrics = writer(tmp_path, [failing, other], err)
    metrics.resume_at(-1)
    for step in range(1, 5):
        metrics.log(step, {"reward/mean": step / 10})
        metrics.log_samples(step, "train", [{"step": step, "table": "train", "prompt": "p"}])
    metrics.close("complete")
    assert err.getvalue().count("the mlflow tracker failed") == 1 and "No space left on device" in err.getvalue()
    assert failing.steps == [1] and failing.tables == [(1, "train", 1)] and failing.closed == []
    assert other.steps == [1, 2, 3, 4] and other.closed == ["complete"]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert other.images == [(4, "report", "report.png")], "report.png at the last step, to the trackers still on"


def test_a_resume_reopens_each_run_and_sends_no_step_a_stopped_attempt_already_sent(tmp_path):
    remote, board = Recording("wandb"), Recording("tensorboard", purges=True)
    first = writer(tmp_path, [remote, board])
    first.resume_at(-1)
    for step in (1, 2, 3):  # checkpoint at 2; step 3 logged, then the attempt was stopped
        first.log(step, {"reward/mean": 0.5})
    first.close("requeue")
    assert remote.closed == ["stopped"]
    state = json.loads((tmp_path / "trackers.json").read_text())
    assert state["wandb"] == {"run_id": "wandb-1", "logged_through": 3}

    remote2, board2 = Recording("wandb"), Recording("tensorboard", purges=True)
    again = writer(tmp_path, [remote2, board2])
    again.resume_at(2)
    for step in (3, 4):
        again.log(step, {"reward/mean": 0.5})
    again.close("complete")
    assert remote2.opened == (2, {"run_id": "wandb-1", "logged_through": 3}), "the same run, reopened"
    assert remote2.steps == [4], "step 3 reached W&B in the stopped attempt: not again"
    assert board2.steps == [3, 4], "TensorBoard drops its events past the checkpoint and takes the redone step"
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


# ------------------------------------------------------------------ sample rows and tables

class Chars:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def scored_batch(n: int = 4, groups: int = 3) -> SampleBatch:
    ids = np.arange(groups * n, dtype=np.int64)[::-1].copy()  # arrival order must not matter
    count = len(ids)
    return SampleBatch(sample_id=ids, prompt_id=ids // n, prompt_len=np.full(count, 2, np.int32),
                       prompt_tokens=np.tile(np.array([0, 1], np.int32), count),
                       response_len=np.full(count, 3, np.int32),
                       response_tokens=np.concatenate([np.array([2, 3, i % 5], np.int32) for i in ids]),
                       logprobs=np.zeros(3 * count, np.float32),
                       reward=(ids % 2).astype(np.float32), rule_score=(ids % 2).astype(np.float32),
                       genrm_score=np.full(count, 0.5, np.float32), parse_fail=(ids == 4).astype(np.int8),
                       finish=np.ones(count, np.int8))


def test_a_replica_picks_the_first_sample_of_its_first_groups_in_sample_id_order():
    batch = scored_batch()
    assert list(batch.sample_id[pick(batch, 2)]) == [0, 4]
    assert list(batch.sample_id[pick(batch, 10)]) == [0, 4, 8]


def test_sample_rows_carry_the_decoded_texts_the_scores_and_the_judges_verdict():
    rows = sample_rows(scored_batch(), Chars(), TermLabels("rule", "genrm"), step=5, table="train", replica=1, count=2)
    assert [r["sample"] for r in rows] == [0, 4]
    first, second = rows
    assert (first["prompt"], first["response"], first["finish"], first["tokens"]) == ("ab", "cda", "length", 3)
    assert first["terms"] == {"rule": 0.0, "genrm": 0.5} and first["verdict"] == "0.5"
    assert second["verdict"] == "parse failed"
    rule_only = sample_rows(scored_batch(), Chars(), TermLabels("exact", None), step=5, table="train", replica=0,
                            count=1)
    assert rule_only[0]["terms"] == {"exact": 0.0} and rule_only[0]["verdict"] is None


def test_samples_are_due_every_samples_every_steps_and_never_at_zero():
    cfg = load_config(DEMO, ["logging.samples_every=3"])
    assert [s for s in range(1, 10) if samples_due(cfg, s)] == [3, 6, 9]
    assert not any(samples_due(load_config(DEMO, ["logging.samples_every=0"]), s) for s in range(1, 10))


def test_a_table_has_a_column_per_reward_term_and_markdown_escapes_its_cells():
    columns, rows = table_of([{"step": 1, "prompt": "a|b\nc", "terms": {"rule": 1.0}},
                              {"step": 1, "prompt": "x", "terms": {"genrm": 0.5}}])
    assert columns[columns.index("reward") + 1:columns.index("reward") + 3] == ["term/rule", "term/genrm"]
    assert rows[1][columns.index("term/rule")] is None
    text = markdown_table(columns, rows)
    assert "a\\|b<br>c" in text and text.count("\n") == 3


# ------------------------------------------------------------------ the real libraries

def settings(tmp_path, **kw) -> TrackerSettings:
    return TrackerSettings(run_dir=tmp_path, config_yaml="train:\n  steps: 2\n",
                           params={"train.steps": "2", "code_version": "v-test"}, **kw)


def test_wandb_runs_offline_in_the_run_dir_under_the_configured_project_and_name(tmp_path):
    from yatt_hpc.metrics.wandb_tracker import WandbTracker

    tracker = WandbTracker(settings(tmp_path, names=["wandb"], project="team-rl", run_name="grpo-7"))
    entry = tracker.open(-1, None)
    tracker.log(1, {"reward/mean": 0.25})
    tracker.log_table(1, "train", ["prompt", "reward"], [["2+2", 1.0]])
    tracker.close("complete")
    files = list((tmp_path / "wandb").glob(f"offline-run-*-{entry['run_id']}/run-{entry['run_id']}.wandb"))
    assert len(files) == 1, "offline, in RUN_DIR/wandb"
    run = wandb_run_record(files[0])
    assert (run.run_id, run.project, run.display_name) == (entry["run_id"], "team-rl", "grpo-7")
    history = wandb_history(files[0])
    assert [(h["_step"], h["reward/mean"]) for h in history if "reward/mean" in h] == [(1, 0.25)]
    table = next(h for h in history if h.get("samples/train/_type") == "table-file")
    content = json.loads((files[0].parent / "files" / table["samples/train/path"]).read_text())
    assert content["columns"] == ["prompt", "reward"] and content["data"] == [["2+2", 1.0]]


def test_mlflow_logs_to_the_tracking_uri_given_and_reopens_the_same_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # a store given by URI keeps MLflow's default artifact root: ./mlruns

    from yatt_hpc.metrics.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    tracker = MlflowTracker(settings(tmp_path, names=["mlflow"], project="team-rl", run_name="grpo-7",
                                     mlflow_tracking_uri=uri))
    entry = tracker.open(-1, None)
    tracker.log(1, {"val/x/pass@4": 0.5})
    tracker.close("stopped")
    again = MlflowTracker(settings(tmp_path, names=["mlflow"], mlflow_tracking_uri=uri))
    assert again.open(1, entry)["run_id"] == entry["run_id"]
    again.log(2, {"val/x/pass@4": 0.75})
    again.close("complete")
    assert not (tmp_path / "mlflow").exists(), "the URI given, not the store in the run directory"
    assert (tmp_path / "mlruns").is_dir(), "artifacts where MLflow puts them for that store"
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(entry["run_id"])
    assert run.info.run_name == "grpo-7" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "team-rl"
    assert run.data.params == {"train.steps": "2", "code_version": "v-test"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/x/pass_4")] == [(1, 0.5), (2, 0.75)]


def test_a_resume_sends_a_tracker_the_checkpointed_steps_it_had_not_taken_when_the_attempt_was_killed(tmp_path):
    first = writer(tmp_path, [Recording("mlflow")])
    first.resume_at(-1)
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": step / 10})
        first.log_samples(step, "train", [{"step": step, "table": "train", "prompt": "p"}])
    first.close("stopped")
    state = json.loads((tmp_path / "trackers.json").read_text())
    state["mlflow"]["logged_through"] = 1  # a kill while steps 2 and 3 still waited in the tracker's queue
    (tmp_path / "trackers.json").write_text(json.dumps(state))

    remote = Recording("mlflow")
    again = writer(tmp_path, [remote])
    again.resume_at(3)  # checkpoint 3: the resume does not redo steps 2 and 3
    again.log(4, {"reward/mean": 0.4})
    again.close("complete")
    assert remote.steps == [2, 3, 4] and [t[0] for t in remote.tables] == [2, 3]
