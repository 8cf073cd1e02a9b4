"""Refused is not delivered: records the tracking server answers with a 4xx are counted, reported and kept
until they are delivered; records refused only because an earlier one was are delivered once it is.

Against a real `mlflow server` on loopback. MLflow refuses to change a logged param's value
(INVALID_PARAMETER_VALUE: "Changing param values is not allowed", mlflow/store/tracking/sqlalchemy_store.py)
and to create a run in a deleted experiment ("must be in the 'active' state").
"""

import pytest

from components.context import tracker
from components.finalize.step import run_finalize
from components.prepare.step import run_prepare
from pipelines.cli import mlflow_sync
from pipelines.local_stack import MlflowServer
from trainer.config import load_config
from trainer.run.run_dir import RunDir, read_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with MlflowServer(tmp_path_factory.mktemp("mlflow")) as running:
        yield running


def config(tmp_path, server, run_id, experiment):
    return load_config("local", [f"--run.work_dir={tmp_path}", f"--run.run_id={run_id}",
                                 f"--mlflow.tracking_uri={server.tracking_uri}", f"--run.experiment={experiment}"])


def test_a_refused_record_is_counted_in_the_summary_and_mlflow_sync_fails(tmp_path, server, capsys):
    cfg = config(tmp_path, server, "refused", "refusals")
    run_prepare(cfg)
    mlflow = tracker(cfg)
    mlflow.start_parent(params={"training.lr": "999"}, tags={})  # a retried prepare with another value
    assert mlflow.pending() == 0 and mlflow.rejected() == 1

    RunDir(cfg.run_dir).steps.mkdir(exist_ok=True)
    summary = run_finalize(cfg, "SUCCEEDED")
    assert summary["mlflow_pending_records"] == 0 and summary["mlflow_rejected_records"] == 1
    assert summary["status"] == "succeeded"  # training did succeed; the record says MLflow lacks part of it

    assert mlflow_sync(cfg.run_dir, []) == 1
    out = capsys.readouterr().out
    assert "1 record(s) refused by the tracking server" in out and "rejected.jsonl" in out
    assert mlflow_sync(cfg.run_dir, ["--retry-rejected"]) == 1  # refused again: the value still differs


def test_records_blocked_by_a_refused_parent_are_delivered_once_the_cause_is_fixed(tmp_path, server):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.tracking_uri)
    experiment_id = client.create_experiment("deleted-experiment")
    client.delete_experiment(experiment_id)  # the cause: runs cannot be created in it

    cfg = config(tmp_path, server, "blocked", "deleted-experiment")
    run_prepare(cfg)
    mlflow = tracker(cfg)
    run = mlflow.start_step("train")
    mlflow.log_metrics(run, [{"step": s, "loss": 1.0 / s, "time": 1_700_000_000 + s} for s in range(1, 11)])
    mlflow.end_run(run, "FINISHED")
    # The parent was refused; the step run and everything logged to it could not even be tried.
    assert mlflow.rejected() == 4 and mlflow.pending() == 0
    reasons = [r["error"] for r in read_jsonl(mlflow.rejected_path)]
    assert "active" in reasons[0] and all("refused earlier" in r for r in reasons[1:])
    assert mlflow_sync(cfg.run_dir, []) == 1

    client.restore_experiment(experiment_id)  # the cause fixed
    assert mlflow_sync(cfg.run_dir, ["--retry-rejected"]) == 0
    assert tracker(cfg).rejected() == 0
    parent = client.get_run(tracker(cfg).run_id())
    [train] = client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert [m.step for m in client.get_metric_history(train.info.run_id, "loss")] == list(range(1, 11))
    assert train.info.status == "FINISHED"


def test_losing_the_race_to_create_the_experiment_is_not_a_refusal(tmp_path, server, monkeypatch):
    """Two runs start at once: both see no experiment, one creates it, the other's create answers
    RESOURCE_ALREADY_EXISTS — it must use the experiment, not give up on the run."""
    from mlflow.tracking import MlflowClient

    MlflowClient(server.tracking_uri).create_experiment("raced")
    cfg = config(tmp_path, server, "late", "raced")
    mlflow = tracker(cfg)
    real = MlflowClient.get_experiment_by_name
    calls = []

    def stale_first(self, name):  # the read that happened before the other run created it
        calls.append(name)
        return None if len(calls) == 1 else real(self, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", stale_first)
    run_prepare(cfg)
    assert mlflow.rejected() == 0 and mlflow.run_id() is not None
