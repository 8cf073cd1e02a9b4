"""The train step: train (on this machine, or through a TrainJob), then log the metrics, the checkpoints,
the recoveries, system metrics and plots to this run's MLflow train run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from components import tracking
from components.context import step_context, write_step_result
from components.train.local import run_local_training
from components.train.plots import training_plots
from components.train.report import checkpoint_metric_records, read_metrics
from components.train.system_metrics import SystemMetricsSampler
from components.train.trainjob import InfrastructureError, TrainJobLauncher
from trainer.config import Config
from trainer.events import read_events
from trainer.planning.measured import measured_costs
from trainer.run_dir import RunDir


def run_train(cfg: Config, data_dir: str) -> dict[str, Any]:
    run_dir = RunDir(cfg.run_dir)
    with step_context(cfg, "train") as (mlflow, run):
        with SystemMetricsSampler(interval_seconds=10) as system:
            result = run_on_cluster(cfg, data_dir) if cfg.kubernetes.enabled else run_local_training(cfg, Path(data_dir))
        metrics = read_metrics(Path(result["metrics_file"]))
        checkpoints = checkpoint_metric_records(cfg.run_dir)
        stalls = [c["checkpoint_loop_wait_seconds"] for c in checkpoints]
        result["checkpoint_saves"] = len(stalls)
        result["checkpoint_stall_mean_seconds"] = sum(stalls) / len(stalls) if stalls else 0.0
        mlflow.log_metrics(run, metrics)
        mlflow.log_metrics(run, checkpoints)
        mlflow.log_metrics(run, system.records)
        log_recovery(mlflow, run, cfg, result)
        for path in training_plots(metrics, checkpoints, read_events(cfg.run_dir, "fault"),
                                   read_events(cfg.run_dir, "recovery"), run_dir.plots):
            mlflow.log_artifact(run, path, "plots")
        mlflow.log_artifact(run, run_dir.train_log)
        if result.get("checkpoint") is None:
            raise RuntimeError(f"training wrote no checkpoint into {cfg.checkpoint_dir}")
        write_step_result(cfg, "train", result)
    return result


def run_on_cluster(cfg: Config, data_dir: str) -> dict[str, Any]:
    """The TrainJob launcher with in-cluster credentials (the pipeline pod's ServiceAccount)."""
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException as err:
        raise InfrastructureError(f"kubernetes.enabled is true but this pod has no in-cluster credentials: {err}") from err
    return TrainJobLauncher(cfg, k8s_client.CustomObjectsApi(), k8s_client.CoreV1Api()).run(data_dir)


def log_recovery(mlflow: tracking.Tracker, run: str, cfg: Config, result: dict[str, Any]) -> None:
    """Recovery events as an MLflow table; their totals, the job's goodput, its badput by category (fraction
    of the wall time) and the costs the planner reads (`python -m pipelines plan --run-id`) as metrics."""
    recoveries = read_events(cfg.run_dir, "recovery")
    totals = {"step": result["steps"], "faults_injected": len(read_events(cfg.run_dir, "fault")),
              **result["recovery_totals"]}
    if result.get("goodput") is not None:
        totals["goodput"] = result["goodput"]
        wall = result["job_wall_seconds"]
        totals.update({f"badput_{name}": seconds / wall for name, seconds in result["badput_seconds"].items()})
    totals.update({f"cost_{name}": value for name, value in measured_costs(cfg.run_dir).items()})
    chosen = read_events(cfg.run_dir, "checkpoint_interval_chosen")  # checkpoint.interval_steps=auto
    if chosen:
        totals["checkpoint_interval_steps_chosen"] = chosen[-1]["interval_steps"]
        mlflow.set_tags(run, {"checkpoint_interval_reason": chosen[-1]["reason"][:5000]})
    mlflow.log_metrics(run, [totals])
    if recoveries:
        columns = sorted({key for r in recoveries for key in r})
        mlflow.log_table(run, data={c: [r.get(c) for r in recoveries] for c in columns},
                         artifact_file="recovery_events.json")
