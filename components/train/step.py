"""The train step: train (on this machine, or through a TrainJob) while the run folder is forwarded to this
run's MLflow train run (components.forwarder); at the end — success or failure — the recovery totals, goodput,
the planner's costs, plots and train.log, so a failed run explains itself in MLflow."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from mlflow.tracking import MlflowClient

from components import tracking
from components.context import step_context, write_step_result
from components.forwarder import RunFolderForwarder
from components.registry import record_champion
from components.train.local import run_local_training
from components.train.report import TrainingReport
from components.train.trainjob import InfrastructureError, TrainJobLauncher
from trainer.checkpoint.export_store import check_writable
from trainer.config import Config, ConfigError
from trainer.config.rules import is_s3_uri
from trainer.data.shards import load_meta
from trainer.resilience.budget import read_gave_up
from trainer.run.run_dir import RunDir

log = logging.getLogger(__name__)


def run_train(cfg: Config, data_dir: str) -> dict[str, Any]:
    started = time.time()
    with step_context(cfg, "train", one_per_pipeline_run=True) as (mlflow, run):
        prepare_evaluation(cfg, mlflow, run, Path(data_dir))
        try:
            with RunFolderForwarder(mlflow, run, cfg.run_dir, cfg.mlflow.forward_interval_seconds,
                                    cfg.mlflow.step_metric_every):
                outcome = (run_on_cluster(cfg, data_dir) if cfg.kubernetes.enabled
                           else run_local_training(cfg, Path(data_dir)))
        except BaseException:  # MLflow gets what the failed training left; step_context tags the reason
            try:
                report = TrainingReport.read(cfg.run_dir, started)
                figures = report.figures()
                log_outcome(mlflow, run, cfg, {"steps": figures["steps_recorded"], **figures}, report)
            except Exception:  # noqa: BLE001 - the training's own error is the one to raise
                log.exception("could not log the failed training's outcome to MLflow")
            raise
        report = TrainingReport.read(cfg.run_dir, outcome["launched_at"])  # the run folder, read once
        result = {**outcome, **report.figures()}
        log_outcome(mlflow, run, cfg, result, report)
        if result.get("checkpoint") is None:
            raise RuntimeError(f"training wrote no checkpoint into {cfg.checkpoint_dir}")
        write_step_result(cfg, "train", result)
    return result


def prepare_evaluation(cfg: Config, mlflow: tracking.Tracker, run: str, data_dir: Path) -> None:
    """Before any GPU time: the export's destination must be writable (ExportUriNotWritable, exit 2, otherwise);
    the champion the training evaluates against at its end (components.registry); the training data as the run's
    input dataset (mlflow.data: its name, content hash and source)."""
    export_root = cfg.eval.export_uri or str(RunDir(cfg.run_dir).path / "export")
    if cfg.eval.register and cfg.tracking_uri.startswith(("http://", "https://")) and not is_s3_uri(export_root):
        raise ConfigError(f"eval.export_uri: the tracking server at {cfg.tracking_uri} refuses a local path as a "
                          f"registered version's source ({export_root}): give an S3 prefix (or eval.register=false)")
    check_writable(export_root, cfg.data.s3_endpoint_url)
    if cfg.eval.register:
        record_champion(MlflowClient(cfg.tracking_uri), cfg.eval.registered_model_name, cfg.run_dir)
    meta = load_meta(data_dir)
    corpora = cfg.data.datasets or [cfg.data]
    for corpus in corpora:
        mlflow.log_dataset(run, getattr(corpus, "name", None) or cfg.data.dataset_name, meta["content_hash"],
                           corpus.s3_uri)


def run_on_cluster(cfg: Config, data_dir: str) -> dict[str, Any]:
    """The TrainJob launcher with in-cluster credentials (the pipeline pod's ServiceAccount)."""
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException as err:
        raise InfrastructureError(f"kubernetes.enabled is true but this pod has no in-cluster credentials: {err}") from err
    return TrainJobLauncher(cfg, k8s_client.CustomObjectsApi(), k8s_client.CoreV1Api()).run(data_dir)


def log_outcome(mlflow: tracking.Tracker, run: str, cfg: Config, result: dict[str, Any], report: TrainingReport) -> None:
    """Totals at the end (the per-step points, checkpoints, faults and recoveries went live): recovery
    totals, goodput and badput by category (fractions of the run's wall time), the costs the planner reads
    (`python -m pipelines plan --run-id`), the interval choice's reason, a give-up's record, plots, train.log."""
    run_dir = RunDir(cfg.run_dir)
    totals = {"step": result["steps"], "faults_injected": result["faults_injected"], **result["recovery_totals"],
              "samples_trained": result["samples_trained"], "samples_skipped": result["samples_skipped"]}
    if result.get("goodput") is not None:
        totals["goodput"] = result["goodput"]
        wall = result["job_wall_seconds"]
        totals.update({f"badput_{name}": seconds / wall for name, seconds in result["badput_seconds"].items()})
    totals.update({f"cost_{name}": value for name, value in result["costs"].items()})
    tags = {}
    chosen = result.get("checkpoint_interval_chosen")  # checkpoint.interval_steps=auto
    if chosen:
        totals["checkpoint_interval_steps_chosen"] = chosen["interval_steps"]
        tags["checkpoint_interval_reason"] = chosen["reason"][:5000]
    tags.update(schedule_and_data_tags(result.get("lr_schedule"), result.get("data_phase")))
    gave_up = read_gave_up(cfg.run_dir)
    if gave_up is not None:
        tags["restart_budget_gave_up"] = gave_up["message"][:5000]
    mlflow.log_metrics(run, [totals])
    if tags:
        mlflow.set_tags(run, tags)
    for path in report.plots(run_dir.plots):
        mlflow.log_artifact(run, path, "plots")
    if run_dir.train_log.is_file():
        mlflow.log_artifact(run, run_dir.train_log)


def schedule_and_data_tags(schedule: dict[str, Any] | None, phase: dict[str, Any] | None) -> dict[str, str]:
    """The learning-rate schedule the run trained with (its kind, horizon, the step its phase began at, and what a
    continuation decided: trainer.job.schedule) and its data phase (trainer.data.phases), as the train run's tags."""
    tags = {}
    if schedule:
        tags.update({"lr_schedule": schedule["kind"], "lr_schedule_horizon": str(schedule["horizon"]),
                     "lr_schedule_start": str(schedule["start"]), "lr_schedule_decision": schedule["decision"],
                     "lr_schedule_why": schedule["why"][:5000]})
        if schedule["kind"] == "wsd":
            tags["lr_schedule_decay_start"] = str(schedule["decay_start"])
    if phase:
        tags.update({"data_phase": str(phase["phase"]), "data_phase_start_sample": str(phase["start"]),
                     "data_phase_mixture": ", ".join(f"{c['name']} x{c['weight']:g} from its sample {c['offset']}"
                                                     for c in phase["corpora"])[:5000]})
    return tags
