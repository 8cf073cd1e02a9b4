"""The whole pipeline through the CLI, as a user runs it: kfp.local, S3 server on loopback, MLflow sqlite."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

FAST = ["--training.num_steps=6", "--checkpoint.interval_steps=3", "--training.batch_size=4",
        "--training.seq_len=32", "--training.warmup_steps=2", "--local.demo_documents=200", "--eval.max_batches=4"]


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "pipelines", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def successful_run(work):
    proc = run_cli("run", "--config", "local", f"--run.work_dir={work}", "--run.run_id=e2e", *FAST,
                   "--faults.schedule=sigkill@4:rank=1", cwd=work)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_run_prints_summary_path_last_and_summary_has_the_outcome(successful_run, work):
    summary_path = successful_run.stdout.strip().splitlines()[-1]
    assert summary_path == str(work / "fsx" / "runs" / "e2e" / "summary.json")
    summary = json.loads(open(summary_path).read())
    assert summary["status"] == "succeeded" and summary["errors"] == []
    assert summary["steps_trained"] == 6
    assert summary["final_train_loss"] < 5.5 and summary["heldout_loss"] < 5.5
    assert summary["checkpoint"].endswith("checkpoints/step-000006")
    assert summary["mlflow_tracking_uri"] == f"sqlite:///{work}/mlflow.db"
    [recovery] = summary["recovery_events"]
    assert recovery["fault_type"] == "sigkill" and recovery["mechanism"] == "ft_launcher"
    assert recovery["fault_step"] == 4 and recovery["lost_steps"] == 4 - recovery["reloaded_step"]
    assert 0 < summary["goodput"] < 1
    assert "sigkill on rank 1 at step 4: ft_launcher restart" in successful_run.stdout
    assert "mlflow ui --backend-store-uri" in successful_run.stdout


def test_mlflow_has_a_parent_run_with_a_nested_run_per_step(successful_run, work):
    from mlflow.tracking import MlflowClient

    summary = json.loads((work / "fsx" / "runs" / "e2e" / "summary.json").read_text())
    client = MlflowClient(summary["mlflow_tracking_uri"])
    parent = client.get_run(summary["mlflow_parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["pipeline_run_id"] == "e2e" and parent.data.tags["trigger"] == "manual"
    assert parent.data.params["training.num_steps"] == "6"
    assert parent.data.metrics["heldout_loss"] == pytest.approx(summary["heldout_loss"])
    assert "summary.json" in [a.path for a in client.list_artifacts(parent.info.run_id)]

    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_step = {run.data.tags["pipeline_step"]: run for run in children}
    assert sorted(by_step) == ["evaluate", "stage", "train", "validate"]
    assert all(run.info.status == "FINISHED" for run in children)
    losses = client.get_metric_history(by_step["train"].info.run_id, "loss")
    assert [m.step for m in losses] == [1, 2, 3, 4, 5, 6]
    stalls = client.get_metric_history(by_step["train"].info.run_id, "checkpoint_blocking_seconds")
    assert [m.step for m in stalls] == [3, 6]  # checkpoint.interval_steps=3
    assert by_step["validate"].data.metrics["checks_passed"] == 4
    assert by_step["stage"].data.metrics["objects"] == 4
    train = by_step["train"]
    assert train.data.metrics["recoveries"] == 1 and train.data.metrics["recoveries_ft_launcher"] == 1
    assert "recovery_events.json" in [a.path for a in client.list_artifacts(train.info.run_id)]


def test_missing_bucket_fails_clearly_and_touches_nothing_saved(successful_run, work):
    checkpoint = work / "fsx" / "runs" / "e2e" / "checkpoints" / "step-000006"
    before = {p.name: p.stat().st_mtime_ns for p in checkpoint.iterdir()}

    proc = run_cli("run", "--config", "local", f"--run.work_dir={work}", "--run.run_id=nobucket",
                   "--local.upload_demo_data=false", "--data.s3_uri=s3://no-such-bucket/data", *FAST, cwd=work)
    assert proc.returncode == 1
    assert "FAILED at stage: StageError: S3 bucket 'no-such-bucket' does not exist" in proc.stdout
    summary = json.loads((work / "fsx" / "runs" / "nobucket" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["errors"][0]["step"] == "stage"
    assert {p.name: p.stat().st_mtime_ns for p in checkpoint.iterdir()} == before

    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary["mlflow_tracking_uri"])
    assert client.get_run(summary["mlflow_parent_run_id"]).info.status == "FAILED"


@pytest.mark.parametrize("args, message", [
    (["--training.num_stepz=3"], "unknown key 'training.num_stepz'"),
    (["--training.num_steps=many"], "training.num_steps: expected an integer, got 'many'"),
    (["--config", "does-not-exist.yaml"], "config file 'does-not-exist.yaml' not found"),
])
def test_bad_config_exits_2_naming_the_field(tmp_path, args, message):
    proc = run_cli("run", *args, f"--run.work_dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "fsx").exists()  # nothing was started or written


def test_compile_writes_ir_with_the_steps_and_the_exit_handler(tmp_path):
    import yaml

    out = tmp_path / "pipeline.yaml"
    proc = run_cli("compile", "--config", "local", "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load(out.read_text())
    assert spec["pipelineInfo"]["name"] == "resilient-train"
    root_tasks = spec["root"]["dag"]["tasks"]
    assert set(root_tasks) == {"exit-handler-1", "finalize-run"}
    assert root_tasks["finalize-run"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert set(inner) == {"prepare-run", "stage-data", "train-model", "validate-checkpoint", "evaluate-model"}
    assert inner["train-model"]["cachingOptions"] == {}  # caching off for training
    defaults = spec["root"]["inputDefinitions"]["parameters"]
    assert json.loads(defaults["config_json"]["defaultValue"])["model"]["preset"] == "tiny"
