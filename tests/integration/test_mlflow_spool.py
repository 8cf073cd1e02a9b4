"""MLflow outage: the steps go on, records are spooled in the run folder and delivered once the tracking
server is back — nothing missing, nothing duplicated, even when the journal is replayed from the start."""

import json
import time

import pytest

from components.context import tracker
from components.finalize.step import run_finalize
from components.prepare.step import run_prepare
from pipelines.cli import mlflow_sync
from pipelines.local_stack import MlflowServer
from trainer.config import load_config
from trainer.run.run_dir import RunDir

pytestmark = pytest.mark.integration


def _history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_outage_mid_run_is_spooled_and_delivered_exactly_once(tmp_path):
    from mlflow.tracking import MlflowClient

    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        cfg = load_config("local", [f"--run.work_dir={tmp_path / 'work'}", "--run.run_id=outage",
                                    f"--mlflow.tracking_uri={server.tracking_uri}"])
        prepared = run_prepare(cfg)
        assert prepared["mlflow_parent_run_id"]  # delivered while the server is up

        mlflow = tracker(cfg)
        run = mlflow.start_step("train")
        mlflow.log_metrics(run, [{"step": s, "loss": 1.0 / s, "time": 1_700_000_000 + s} for s in range(1, 51)])
        assert mlflow.pending() == 0

        server.stop()  # the outage
        started = time.monotonic()
        mlflow.log_metrics(run, [{"step": s, "loss": 1.0 / s, "time": 1_700_000_000 + s} for s in range(51, 101)])
        mlflow.set_tags(run, {"dataset_content_hash": "abc"})
        log_file = tmp_path / "train.log"
        log_file.write_text("step 100 loss 0.01\n")
        mlflow.log_artifact(run, log_file)
        log_file.write_text("overwritten after logging\n")  # the spool keeps what was logged
        mlflow.log_table(run, {"fault_type": ["sigkill"], "lost_steps": [3]}, "recovery_events.json")
        mlflow.logged_model(run, "step-000100", 100, model_type="qwen3", metrics={"heldout_loss": 2.5}, ready=True)
        mlflow.end_run(run, "FINISHED")
        RunDir(cfg.run_dir).steps.mkdir(exist_ok=True)
        summary = run_finalize(cfg, "SUCCEEDED")  # the exit handler, server still down
        assert time.monotonic() - started < 60  # bounded: no minutes of client retries per record
        assert summary["mlflow_pending_records"] == 8  # 6 step records + summary artifact + end
        assert mlflow_sync(cfg.run_dir, []) == 1  # still down: non-zero, nothing lost

        server.start()  # same port, same store
        assert mlflow_sync(cfg.run_dir, []) == 0
        assert tracker(cfg).pending() == 0

        client = MlflowClient(server.tracking_uri)
        parent = client.get_run(prepared["mlflow_parent_run_id"])
        assert parent.info.status == "FINISHED"
        [train] = client.search_runs([parent.info.experiment_id],
                                     filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        history = _history(client, train.info.run_id, "loss")
        assert sorted(history) == [(s, 1.0 / s) for s in range(1, 101)]
        assert train.info.status == "FINISHED" and train.data.tags["dataset_content_hash"] == "abc"
        logged = client.download_artifacts(train.info.run_id, "train.log", str(tmp_path / "dl"))
        assert open(logged).read() == "step 100 loss 0.01\n"
        table = json.loads(open(client.download_artifacts(train.info.run_id, "recovery_events.json",
                                                          str(tmp_path / "dl"))).read())
        assert table["data"] == [["sigkill", 3]]
        assert "summary.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}
        [model] = client.search_logged_models([parent.info.experiment_id])
        assert (model.name, model.source_run_id, model.model_type) == ("step-000100", train.info.run_id, "qwen3")

        # A lost bookmark (crash between the server's commit and ours) replays the whole journal: still one
        # parent, one step run, 100 loss values, one table row.
        tracker(cfg).state_path.unlink()
        assert tracker(cfg).flush()
        runs = client.search_runs([parent.info.experiment_id], filter_string="tags.pipeline_run_id = 'outage'")
        assert len(runs) == 2
        assert sorted(_history(client, train.info.run_id, "loss")) == [(s, 1.0 / s) for s in range(1, 101)]
        assert len(client.search_logged_models([parent.info.experiment_id])) == 1
        table = json.loads(open(client.download_artifacts(train.info.run_id, "recovery_events.json",
                                                          str(tmp_path / "dl2"))).read())
        assert table["data"] == [["sigkill", 3]]
    finally:
        server.stop()


def test_prepare_goes_on_when_the_tracking_server_never_answers(tmp_path):
    from pipelines.local_stack import free_port

    cfg = load_config("local", [f"--run.work_dir={tmp_path}", "--run.run_id=down",
                                f"--mlflow.tracking_uri=http://127.0.0.1:{free_port()}"])
    prepared = run_prepare(cfg)
    assert prepared["mlflow_parent_run_id"] is None
    assert tracker(cfg).pending() == 1
    journal = [json.loads(line) for line in (cfg.run_dir / "mlflow-spool" / "journal.jsonl").read_text().splitlines()]
    assert journal[0]["op"] == "start_run" and journal[0]["params"]["training.num_steps"] == str(cfg.training.num_steps)


@pytest.mark.parametrize("kfp_tracks_to", ["this server", "another server", "nothing"])
def test_kfps_own_mlflow_runs_are_adopted_not_doubled(tmp_path, monkeypatch, kfp_tracks_to):
    """KFP >= 2.17 with its MLflow integration (KEP-12862) makes a run per pipeline run and a nested run per task,
    and gives each task's container MLFLOW_RUN_ID (its nested run), MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_ID
    (kubeflow/pipelines backend/src/v2/common/plugins/mlflow/handler.go). Then KFP's pipeline run is the parent and
    its task runs are the steps' runs: no second parent. Without it (or tracking elsewhere), our own parent."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config("local", [f"--run.work_dir={tmp_path / 'work'}", "--run.run_id=kfp-run",
                                f"--mlflow.tracking_uri={uri}"])
    client = MlflowClient(uri)
    kfp_experiment = client.create_experiment("Default-kfp")
    kfp_parent = client.create_run(kfp_experiment, run_name="resilient-train-abc12").info.run_id

    def kfp_task(name: str) -> str:  # what the KFP driver does before a task's container starts
        task = client.create_run(kfp_experiment, run_name=name, tags={"mlflow.parentRunId": kfp_parent}).info.run_id
        if kfp_tracks_to != "nothing":
            monkeypatch.setenv("MLFLOW_RUN_ID", task)
            monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", kfp_experiment)
            monkeypatch.setenv("MLFLOW_TRACKING_URI", uri if kfp_tracks_to == "this server" else "http://kfp-mlflow:5000")
        return task

    prepare_task = kfp_task("prepare")
    prepared = run_prepare(cfg)
    train_task = kfp_task("train")
    mlflow = tracker(cfg)  # another task's process
    run = mlflow.start_step("train", one_per_pipeline_run=True)
    mlflow.log_metrics(run, [{"step": 1, "loss": 2.5, "time": 1_700_000_000}])
    mlflow.end_run(run, "FINISHED")
    assert mlflow.pending() == 0

    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=100)
    if kfp_tracks_to == "this server":
        assert prepared["mlflow_parent_run_id"] == kfp_parent == mlflow.run_id()
        assert mlflow.run_id(run) == train_task
        parent = client.get_run(kfp_parent)
        assert parent.data.tags["pipeline_run_id"] == "kfp-run" and parent.data.params  # our tags and params on it
        assert client.get_metric_history(train_task, "loss")[0].value == 2.5
        assert {r.info.run_id for r in runs} == {kfp_parent, prepare_task, train_task}  # nothing made twice
        assert client.get_experiment_by_name(cfg.run.experiment) is None
    else:
        ours = mlflow.run_id()
        assert ours not in (kfp_parent, prepare_task, train_task) and prepared["mlflow_parent_run_id"] == ours
        assert client.get_run(mlflow.run_id(run)).data.tags["mlflow.parentRunId"] == ours


def test_two_runs_logging_the_same_dataset_at_once_both_link_it(tmp_path):
    """MLflow's log_inputs reads whether (experiment, name, digest) exists and inserts it if not, in one transaction
    without a lock (mlflow/store/tracking/sqlalchemy_store.py _log_inputs_impl; the datasets table's primary key is
    those three): concurrent runs on the same corpus race, and the loser is answered BAD_REQUEST (the
    IntegrityError). Made certain here: the other run logs the dataset between this one's read and its insert."""
    import sqlalchemy
    from mlflow.tracking import MlflowClient
    from sqlalchemy.orm import Session

    from components.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trackers = [Tracker(uri, "same-corpus", f"race-{i}", tmp_path / f"run-{i}") for i in range(2)]
    runs = []
    for mlflow in trackers:
        mlflow.start_parent({}, {})
        runs.append(mlflow.start_step("train", one_per_pipeline_run=True))
    raced = []

    def the_other_run_logs_it_first(session, flush_context, instances):
        if not raced and any(type(obj).__name__ == "SqlDataset" for obj in session.new):
            raced.append(True)
            trackers[1].log_dataset(runs[1], "corpus", "ab" * 32, "s3://data/corpus")

    sqlalchemy.event.listen(Session, "before_flush", the_other_run_logs_it_first)
    try:
        trackers[0].log_dataset(runs[0], "corpus", "ab" * 32, "s3://data/corpus")
    finally:
        sqlalchemy.event.remove(Session, "before_flush", the_other_run_logs_it_first)

    assert raced
    client = MlflowClient(uri)
    for mlflow, run in zip(trackers, runs):
        assert mlflow.pending() == 0 and mlflow.rejected() == 0, mlflow.rejected_path.read_text()
        inputs = client.get_run(mlflow.run_id(run)).inputs.dataset_inputs
        assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("corpus", "ab" * 16)]
