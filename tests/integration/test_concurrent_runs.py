"""Four pipeline runs at once against one real MLflow server, one S3 server and one FSx folder.

What races: creating the experiment (MLflow answers RESOURCE_ALREADY_EXISTS to the loser), staging the same
dataset folder, and the promotion gate (the registry has no compare-and-set on aliases; it does number
versions atomically, mlflow/store/model_registry/sqlalchemy_store.py create_model_version).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.demo_data import upload_corpus
from pipelines.local_stack import MlflowServer

pytestmark = pytest.mark.integration

RUNS = 4
FAST = ["--training.num_steps=6", "--checkpoint.interval_steps=3", "--training.batch_size=4",
        "--training.seq_len=32", "--training.warmup_steps=2", "--eval.max_batches=2", "--eval.max_new_tokens=4",
        "--training.nproc_per_node=1", "--resilience.launcher=torchrun", "--faults.schedule=",
        "--local.s3_server=false", "--local.upload_demo_data=false",
        "--eval.export_uri=s3://resilient-train-data/exports"]


def test_concurrent_runs_each_keep_their_whole_record_and_exactly_one_promotion_wins(tmp_path, s3_server):
    import boto3
    from mlflow.tracking import MlflowClient

    upload_corpus(boto3.client("s3"), "resilient-train-data", "datasets/demo", num_documents=200)
    work = tmp_path / "work"
    with MlflowServer(tmp_path / "mlflow") as server:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        procs = [subprocess.Popen([sys.executable, "-m", "pipelines", "run", "--config", "local",
                                   f"--run.work_dir={work}", f"--run.run_id=race-{i}", *FAST,
                                   f"--mlflow.tracking_uri={server.tracking_uri}"],
                                  cwd=Path(__file__).resolve().parents[2], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for i in range(RUNS)]
        outputs = [proc.communicate(timeout=900)[0] for proc in procs]
        for proc, output in zip(procs, outputs):
            assert proc.returncode == 0, output[-3000:]

        client = MlflowClient(server.tracking_uri)
        summaries = [json.loads((work / "fsx" / "runs" / f"race-{i}" / "summary.json").read_text()) for i in range(RUNS)]
        for summary in summaries:
            refused = Path(summary["run_dir"]) / "mlflow-spool" / "rejected.jsonl"
            assert summary["mlflow_pending_records"] == 0 and summary["mlflow_rejected_records"] == 0, (
                refused.read_text() if refused.is_file() else summary)
            parent = client.get_run(summary["mlflow_parent_run_id"])
            assert parent.info.status == "FINISHED"
            children = client.search_runs([parent.info.experiment_id],
                                          filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
            by_step = {run.data.tags["pipeline_step"]: run for run in children}
            assert sorted(by_step) == ["evaluate", "stage", "train", "validate"]
            lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
            for key in ("loss", "tokens_per_second"):
                history = client.get_metric_history(by_step["train"].info.run_id, key)
                assert len(history) == len(lines) == 6, (summary["pipeline_run_id"], key)

        winners = [s for s in summaries if s["promotion"]["promote"]]
        assert len(winners) == 1, [s["promotion"]["reason"] for s in summaries]
        versions = client.search_model_versions("name = 'resilient-train-llama'")
        assert [v.version for v in versions] == [winners[0]["promotion"]["new_version"]]
        champion = client.get_model_version_by_alias("resilient-train-llama", "champion")
        assert champion.version == winners[0]["promotion"]["new_version"]
        assert champion.tags["pipeline_run_id"] == winners[0]["pipeline_run_id"]
        for loser in (s for s in summaries if s is not winners[0]):
            assert loser["promotion"]["promote"] is False and loser["promotion"]["new_version"] is None


def test_candidates_that_all_saw_no_champion_are_decided_one_at_a_time(tmp_path, monkeypatch):
    """The race made certain: every candidate reads "no champion" before any of them registers."""
    import threading

    from mlflow.tracking import MlflowClient

    from components.evaluate import promotion

    real_champion_version = promotion.champion_version
    everyone_has_read = threading.Barrier(RUNS)
    first_read = threading.local()

    def champion_version_then_wait(client, name):
        found = real_champion_version(client, name)
        if not getattr(first_read, "done", False):
            first_read.done = True
            everyone_has_read.wait(timeout=60)
        return found

    monkeypatch.setattr(promotion, "champion_version", champion_version_then_wait)
    with MlflowServer(tmp_path / "mlflow") as server:
        client = MlflowClient(server.tracking_uri)
        experiment = client.create_experiment("gate")
        decisions = {}

        def gate(index: int) -> None:
            run_id = client.create_run(experiment).info.run_id
            # Each candidate's evaluation record, as the training's ranks write it: the same windows, the same loss.
            record = {"candidate": {"heldout_loss": 1.5}, "windows": "8x32-samewindows",
                      "export": {"uri": f"s3://exports/run-{index}/step-000006", "complete": True}}
            decisions[index] = promotion.promote_if_better(
                MlflowClient(server.tracking_uri), model_name="raced-model", threshold=0.0, record=record,
                run_id=run_id, model_id=None, tags={"candidate": str(index)}, poll_seconds=0.2)

        threads = [threading.Thread(target=gate, args=(i,)) for i in range(RUNS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)

        assert len(decisions) == RUNS
        winners = [d for d in decisions.values() if d.promote]
        assert len(winners) == 1 and winners[0].reason == "no champion registered yet"
        losers = [d for d in decisions.values() if not d.promote]
        assert all(d.reason.startswith("lost to a concurrent promotion: held-out loss 1.5000 does not beat")
                   for d in losers), [d.reason for d in losers]
        versions = client.search_model_versions("name = 'raced-model'")
        assert [v.version for v in versions] == [winners[0].new_version]  # losers deleted their versions
        assert client.get_model_version_by_alias("raced-model", "champion").version == winners[0].new_version
        assert versions[0].tags[promotion.PROMOTION_TAG] == "champion"
        winner = next(index for index, decision in decisions.items() if decision.promote)
        assert versions[0].source == f"s3://exports/run-{winner}/step-000006"  # registered from its export's URI
