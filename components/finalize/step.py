"""The exit handler: compose summary.json from the step results and close the MLflow parent run, on
success and failure alike; on the cluster, a run that did not succeed (failed, cancelled) also deletes a
TrainJob still holding GPUs."""

from __future__ import annotations

import logging
import time
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from components import tracking
from components.context import read_step_result, tracker
from components.stage.staging import STAGE_ERROR
from components.train.trainjob import delete_unfinished_trainjob
from trainer.config import Config
from trainer.resilience.budget import read_gave_up
from trainer.run.history import control_state, recent_recoveries
from trainer.run.run_dir import RunDir, read_json, write_json

log = logging.getLogger(__name__)

STEPS = ("prepare", "stage", "train", "validate", "evaluate")


def run_finalize(cfg: Config, pipeline_state: str) -> dict[str, Any]:
    run_dir = RunDir(cfg.run_dir)
    if cfg.kubernetes.enabled and pipeline_state != "SUCCEEDED":
        _delete_unfinished_trainjob(cfg)
    steps = {name: read_step_result(cfg, name) for name in STEPS}
    errors = _errors(cfg, run_dir, steps)
    train, evaluate = steps["train"] or {}, steps["evaluate"] or {}
    succeeded = pipeline_state == "SUCCEEDED" and not errors
    mlflow = tracker(cfg)
    history = control_state(cfg.run_dir)  # bounded: the totals, however long the run
    summary = {
        "status": "succeeded" if succeeded else "failed",
        "pipeline_run_id": cfg.run.run_id,
        "mlflow_tracking_uri": cfg.tracking_uri,
        "mlflow_experiment": cfg.run.experiment,
        "mlflow_parent_run_id": mlflow.run_id(),
        "mlflow_pending_records": mlflow.pending(),
        "mlflow_rejected_records": mlflow.rejected(),
        "run_dir": str(cfg.run_dir),
        "checkpoint_dir": str(cfg.checkpoint_dir),
        "checkpoint": (steps["validate"] or {}).get("checkpoint") or train.get("checkpoint"),
        "steps_trained": train.get("steps"),
        "final_train_loss": train.get("final_loss"),
        "heldout_loss": evaluate.get("heldout_loss"),
        "heldout_perplexity": evaluate.get("perplexity"),
        "promotion": evaluate.get("promotion"),
        "recoveries": history.recoveries["count"],
        "recovery_events": recent_recoveries(cfg.run_dir),  # the last few; all: MLflow's recovery table
        "straggler_events": list(history.stragglers.values()),  # a line per straggling rank
        "restart_budget_gave_up": (read_gave_up(cfg.run_dir) or {}).get("message"),
        "goodput": train.get("goodput"),
        "errors": errors,
        "steps": steps,
        "finished_at": time.time(),
    }
    if steps["prepare"] is not None:  # the parent run exists (or is spooled) only once prepare has run
        metrics = {k: summary[k] for k in ("steps_trained", "final_train_loss", "heldout_loss", "goodput")
                   if summary[k] is not None}
        if train:
            totals = train["recovery_totals"]
            metrics["straggler_events"] = sum(s["streaks"] for s in summary["straggler_events"])
            metrics.update(recoveries=totals["recoveries"], lost_steps=totals["lost_steps"],
                           checkpoint_stall_mean_seconds=train.get("checkpoint_stall_mean_seconds", 0.0))
            if train.get("job_wall_seconds"):  # badput by category, as a fraction of the job's wall time
                metrics.update({f"badput_{name}": seconds / train["job_wall_seconds"]
                                for name, seconds in (train.get("badput_seconds") or {}).items()})
        if metrics:
            mlflow.log_metrics(tracking.PARENT, [{"step": summary["steps_trained"] or 0, **metrics}])
        write_json(run_dir.summary, summary)
        mlflow.log_artifact(tracking.PARENT, run_dir.summary)
        mlflow.end_run(tracking.PARENT, "FINISHED" if succeeded else "FAILED")
    summary["mlflow_parent_run_id"] = mlflow.run_id()
    summary["mlflow_pending_records"] = mlflow.pending()
    summary["mlflow_rejected_records"] = mlflow.rejected()
    write_json(run_dir.summary, summary)
    return summary


def _errors(cfg: Config, run_dir: RunDir, steps: dict[str, Any]) -> list[dict[str, str]]:
    """Each failed step once: its error record, and the cached stage task's beside the dataset when it
    failed during this run (a cached task cannot know the pipeline run it serves)."""
    error_files = run_dir.step_errors()
    stage_error = read_json(cfg.dataset_dir / STAGE_ERROR)
    started = (steps["prepare"] or {}).get("started_at", float("inf"))
    if steps["stage"] is None and stage_error and stage_error.get("time", 0) >= started:
        error_files.append(cfg.dataset_dir / STAGE_ERROR)
    errors: list[dict[str, str]] = []
    for path in error_files:
        error = read_json(path)
        if not any(e["step"] == error["step"] for e in errors):
            errors.append({"step": error["step"], "error_type": error["error_type"], "message": error["message"],
                           "input_error": bool(error.get("input_error"))})
    return errors


def _delete_unfinished_trainjob(cfg: Config) -> None:
    try:
        k8s_config.load_incluster_config()
        delete_unfinished_trainjob(cfg, k8s_client.CustomObjectsApi())
    except Exception as err:  # noqa: BLE001 - the summary must still be written; the log says what to do
        log.error("could not delete this run's TrainJob (%s): check `kubectl -n %s get trainjobs` and delete it "
                  "by hand if it still runs", err, cfg.kubernetes.namespace)
