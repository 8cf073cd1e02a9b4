"""The pipeline's steps as plain functions: what each KFP component runs, callable without KFP.

Each step resolves the run's configuration from the same three inputs (the config as JSON, the override
list and KFP's job id), does its work, logs a nested MLflow run under the pipeline's parent run, and
writes its result to ``<run_dir>/steps/<step>.json`` (or ``<step>.error.json`` when it fails), where the
exit handler picks everything up for ``summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

from components import tracking
from trainer.config import Config, config_from_yaml_text

log = logging.getLogger(__name__)

STEPS_DIR = "steps"
SUMMARY = "summary.json"


class RunFolderError(RuntimeError):
    """The run folder cannot be created; the message says why and what to do."""


def resolve_config(config_json: str, overrides: list[str], kfp_job_id: str = "") -> Config:
    """The run's Config (config_json may also be YAML); run.run_id falls back to KFP's job id."""
    overrides = list(overrides or [])
    cfg = config_from_yaml_text(config_json, overrides)
    if not cfg.run.run_id:
        if not kfp_job_id:
            raise ValueError("run.run_id: empty and no KFP job id to fall back on; pass --run.run_id=NAME")
        cfg = config_from_yaml_text(config_json, [*overrides, f"run.run_id={kfp_job_id.lower()}"])
    return cfg


def _write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)
    return path


def read_step_result(cfg: Config, step: str) -> dict[str, Any] | None:
    path = cfg.run_dir / STEPS_DIR / f"{step}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def tracker(cfg: Config) -> tracking.Tracker:
    """The run's MLflow writer (spooled in the run folder while the tracking server is unreachable)."""
    artifact_location = cfg.mlflow.artifact_location
    if not artifact_location and cfg.tracking_uri.startswith("sqlite:"):
        artifact_location = (cfg.work_dir / "mlartifacts").as_uri()
    return tracking.Tracker(cfg.tracking_uri, cfg.run.experiment, cfg.run.run_id, cfg.run_dir,
                            artifact_location=artifact_location)


@contextlib.contextmanager
def _step(cfg: Config, name: str) -> Iterator[tuple[tracking.Tracker, str]]:
    """Nested MLflow run + error record for one step: yields (tracker, the step run's spool key)."""
    steps_dir = cfg.run_dir / STEPS_DIR
    (steps_dir / f"{name}.error.json").unlink(missing_ok=True)  # a retried step starts clean
    mlflow = tracker(cfg)
    run = mlflow.start_step(name)
    try:
        yield mlflow, run
    except BaseException as err:
        _write_json(steps_dir / f"{name}.error.json",
                    {"step": name, "error_type": type(err).__name__, "message": str(err),
                     "traceback": traceback.format_exc()})
        mlflow.end_run(run, "FAILED")
        raise
    mlflow.end_run(run, "FINISHED")


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def prepare_step(cfg: Config) -> dict[str, Any]:
    """Create the run folder and the MLflow parent run (found again, not duplicated, on a retry)."""
    from components.stage import not_writable_hint

    try:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
    except PermissionError as err:
        raise RunFolderError(f"cannot create {cfg.run_dir} as uid {os.getuid()}: {err.strerror}. "
                             f"{not_writable_hint(cfg.kubernetes.namespace)}") from err
    (cfg.run_dir / "config.yaml").write_text(cfg.to_yaml())
    mlflow = tracker(cfg)
    mlflow.start_parent(params=tracking.flatten(cfg.to_dict()),
                        tags={"trigger": cfg.run.trigger, "config_hash": cfg.config_hash(),
                              "git_commit": _git_commit(), "run_dir": str(cfg.run_dir)})
    parent = mlflow.run_id()  # None while the tracking server is unreachable (the parent is spooled)
    result = {"mlflow_tracking_uri": cfg.tracking_uri, "mlflow_parent_run_id": parent, "run_dir": str(cfg.run_dir),
              "started_at": time.time()}
    _write_json(cfg.run_dir / STEPS_DIR / "prepare.json", result)
    log.info("run %s: folder %s, MLflow parent run %s", cfg.run.run_id, cfg.run_dir, parent)
    return result


STAGE_ERROR = "stage.error.json"


def staging_config_json(cfg: Config) -> str:
    """What the stage step depends on and nothing else (no run id, trigger or training settings): its KFP
    cache key is this plus the listing's fingerprint, so runs over unchanged data share one staging."""
    return json.dumps({"run": {"work_dir": str(cfg.work_dir)}, "data": cfg.to_dict()["data"]}, sort_keys=True,
                      separators=(",", ":"))


def stage_only(cfg: Config, data_fingerprint: str = "") -> dict[str, Any]:
    """Stage the data (no MLflow, nothing in the run folder): what the cached KFP stage task runs.

    A failure is also written to <dataset_dir>/stage.error.json, where the exit handler finds it (a cached
    task cannot know the pipeline run it serves).
    """
    from components.stage import stage_dataset

    error_path = cfg.dataset_dir / STAGE_ERROR
    error_path.unlink(missing_ok=True)
    try:
        manifest = stage_dataset(cfg.data, cfg.dataset_dir, cfg.fsx_root)
    except BaseException as err:
        _write_json(error_path, {"step": "stage", "error_type": type(err).__name__, "message": str(err),
                                 "traceback": traceback.format_exc(), "time": time.time()})
        raise
    splits = manifest["tokens"]["splits"]
    return {"data_dir": str(cfg.dataset_dir), "s3_uri": cfg.data.s3_uri, "mode": manifest["mode"],
            "objects": manifest["object_count"], "bytes": manifest["bytes"], "downloaded": manifest["downloaded"],
            "deleted": len(manifest["deleted"]), "skipped": manifest["skipped_count"],
            "content_hash": manifest["tokens"]["content_hash"],
            "manifest_hash": manifest["manifest_hash"], "dra": manifest["dra"], "data_fingerprint": data_fingerprint,
            "stage_seconds": manifest["stage_seconds"], "train_tokens": splits["train"]["tokens"],
            "val_tokens": splits["val"]["tokens"]}


def record_stage_step(cfg: Config, staged: dict[str, Any]) -> dict[str, Any]:
    """Log a staging result (fresh or from KFP's cache) as this run's stage step."""
    with _step(cfg, "stage") as (mlflow, run):
        mlflow.log_metrics(run, [{
            "step": 0, "objects": staged["objects"], "bytes": staged["bytes"],
            "downloaded_objects": staged["downloaded"], "stage_seconds": staged["stage_seconds"],
            "train_tokens": staged["train_tokens"], "val_tokens": staged["val_tokens"]}])
        hashes = {"dataset_content_hash": staged["content_hash"], "dataset_manifest_hash": staged["manifest_hash"]}
        mlflow.set_tags(run, {"stage_mode": staged["mode"], **hashes})
        mlflow.set_tags(tracking.PARENT, hashes)  # runs are compared by the data they trained on
        mlflow.log_artifact(run, Path(staged["data_dir"]) / "stage-manifest.json")
        _write_json(cfg.run_dir / STEPS_DIR / "stage.json", staged)
    return staged


def train_step(cfg: Config, data_dir: str) -> dict[str, Any]:
    from components.plots import training_plots
    from components.system_metrics import SystemMetricsSampler
    from components.train import checkpoint_metric_records, read_metrics, run_local_training
    from trainer.events import read_events

    with _step(cfg, "train") as (mlflow, run):
        with SystemMetricsSampler(interval_seconds=10) as system:
            result = run_on_cluster(cfg, data_dir) if cfg.kubernetes.enabled else run_local_training(cfg, Path(data_dir))
        metrics = read_metrics(Path(result["metrics_file"]))
        checkpoints = checkpoint_metric_records(cfg.run_dir)
        stalls = [c["checkpoint_blocking_seconds"] for c in checkpoints]
        result["checkpoint_saves"] = len(stalls)
        result["checkpoint_stall_mean_seconds"] = sum(stalls) / len(stalls) if stalls else 0.0
        mlflow.log_metrics(run, metrics)
        mlflow.log_metrics(run, checkpoints)
        mlflow.log_metrics(run, system.records)
        log_recovery(mlflow, run, cfg, result)
        for path in training_plots(metrics, checkpoints, read_events(cfg.run_dir, "fault"),
                                   read_events(cfg.run_dir, "recovery"), cfg.run_dir / "plots"):
            mlflow.log_artifact(run, path, "plots")
        mlflow.log_artifact(run, cfg.run_dir / "train.log")
        if result.get("checkpoint") is None:
            raise RuntimeError(f"training wrote no checkpoint into {cfg.checkpoint_dir}")
        _write_json(cfg.run_dir / STEPS_DIR / "train.json", result)
    return result


def run_on_cluster(cfg: Config, data_dir: str) -> dict[str, Any]:
    """The TrainJob launcher with in-cluster credentials (the pipeline pod's ServiceAccount)."""
    from kubernetes import client, config

    from components.trainjob import InfrastructureError, TrainJobLauncher

    try:
        config.load_incluster_config()
    except config.ConfigException as err:
        raise InfrastructureError(f"kubernetes.enabled is true but this pod has no in-cluster credentials: {err}") from err
    return TrainJobLauncher(cfg, client.CustomObjectsApi(), client.CoreV1Api()).run(data_dir)


def _delete_unfinished_trainjob(cfg: Config) -> None:
    from kubernetes import client, config

    from components.trainjob import delete_unfinished_trainjob

    try:
        config.load_incluster_config()
        delete_unfinished_trainjob(cfg, client.CustomObjectsApi())
    except Exception as err:  # noqa: BLE001 - the summary must still be written; the log says what to do
        log.error("could not delete this run's TrainJob (%s): check `kubectl -n %s get trainjobs` and delete it "
                  "by hand if it still runs", err, cfg.kubernetes.namespace)


def log_recovery(mlflow: tracking.Tracker, run: str, cfg: Config, result: dict[str, Any]) -> None:
    """Recovery events as an MLflow table, plus their totals and the job's goodput as metrics."""
    from trainer.events import read_events

    recoveries = read_events(cfg.run_dir, "recovery")
    totals = {"step": result["steps"], "faults_injected": len(read_events(cfg.run_dir, "fault")),
              **result["recovery_totals"]}
    if result.get("goodput") is not None:
        totals["goodput"] = result["goodput"]
    mlflow.log_metrics(run, [totals])
    if recoveries:
        columns = sorted({key for r in recoveries for key in r})
        mlflow.log_table(run, data={c: [r.get(c) for r in recoveries] for c in columns},
                         artifact_file="recovery_events.json")


def validate_step(cfg: Config, checkpoint: str) -> dict[str, Any]:
    from components.validate import validate_checkpoint

    with _step(cfg, "validate") as (mlflow, run):
        report = validate_checkpoint(Path(checkpoint), expected_run_id=cfg.run.run_id)
        mlflow.log_metrics(run, [{
            "step": report["step"], "checkpoint_bytes": report["bytes"], "checkpoint_files": report["files"],
            "load_seconds": report["load_seconds"], "checks_passed": report["num_checks"]}])
        _write_json(cfg.run_dir / STEPS_DIR / "validate.json", report)
    return report


def evaluate_step(cfg: Config, checkpoint: str, data_dir: str) -> dict[str, Any]:
    from components.evaluate import evaluate_checkpoint, heldout_loss

    windows = dict(seq_len=cfg.training.seq_len, batch_size=cfg.eval.batch_size, max_batches=cfg.eval.max_batches)
    with _step(cfg, "evaluate") as (mlflow, run):
        result = evaluate_checkpoint(Path(checkpoint), Path(data_dir), **windows, prompts=cfg.eval.prompt_list,
                                     max_new_tokens=cfg.eval.max_new_tokens)
        mlflow.log_metrics(run, [{
            "step": result["step"], "heldout_loss": result["heldout_loss"], "perplexity": result["perplexity"],
            "eval_tokens_per_second": result["eval_tokens_per_second"]}])
        if result["generations"]:
            generations = cfg.run_dir / "generations.json"
            generations.write_text(json.dumps(result["generations"], indent=2, ensure_ascii=False))
            mlflow.log_artifact(run, generations)
        if cfg.eval.register:
            result["promotion"] = _promotion_gate(cfg, mlflow, run, checkpoint, result,
                                                  lambda model: heldout_loss(model, Path(data_dir), **windows)["heldout_loss"])
            decision = result["promotion"]
            tags = {"promoted": str(decision["promote"]).lower(), "promotion_reason": decision["reason"]}
            if decision.get("new_version"):
                tags["registered_version"] = decision["new_version"]
            mlflow.set_tags(run, tags)
            mlflow.set_tags(tracking.PARENT, tags)
            if decision.get("champion_loss") is not None:
                mlflow.log_metrics(run, [{"step": result["step"], "champion_heldout_loss": decision["champion_loss"]}])
        _write_json(cfg.run_dir / STEPS_DIR / "evaluate.json", result)
    return result


def _promotion_gate(cfg: Config, mlflow: tracking.Tracker, run: str, checkpoint: str, result: dict[str, Any],
                    evaluate_champion) -> dict[str, Any]:
    """The registry side needs the tracking server now: without it the decision is deferred, not guessed."""
    from mlflow.tracking import MlflowClient

    from components.promotion import GateDecision, promote_if_better
    from trainer.export import export_hf

    run_id = mlflow.run_id(run)
    if run_id is None:
        why = (f"MLflow at {cfg.tracking_uri} is unreachable, so the champion cannot be read" if mlflow.pending()
               else f"MLflow refused this run's records (see {mlflow.rejected_path})")
        return GateDecision(False, f"deferred: {why}; re-evaluate later", result["heldout_loss"],
                            threshold=cfg.eval.promotion_threshold).as_dict()
    try:
        decision = promote_if_better(
            MlflowClient(cfg.tracking_uri), tracking_uri=cfg.tracking_uri, model_name=cfg.eval.registered_model_name,
            threshold=cfg.eval.promotion_threshold, candidate_loss=result["heldout_loss"], run_id=run_id,
            export=lambda out: export_hf(Path(checkpoint), out, overwrite=True), evaluate_champion=evaluate_champion,
            tags={"pipeline_run_id": cfg.run.run_id, "checkpoint": checkpoint, "step": str(result["step"])},
            wait_seconds=cfg.eval.promotion_wait_seconds)
    except Exception as err:  # noqa: BLE001 - only outages are deferred; everything else fails the step
        if not tracking.is_outage(err):
            raise
        return GateDecision(False, f"deferred: MLflow became unreachable during the gate ({err}); re-evaluate later",
                            result["heldout_loss"], threshold=cfg.eval.promotion_threshold).as_dict()
    return decision.as_dict()


def finalize_step(cfg: Config, pipeline_state: str) -> dict[str, Any]:
    """Exit handler: compose summary.json from the step results and close the MLflow parent run; on the
    cluster, a run that did not succeed (failed, cancelled) also deletes a TrainJob still holding GPUs."""
    from trainer.events import read_events

    if cfg.kubernetes.enabled and pipeline_state != "SUCCEEDED":
        _delete_unfinished_trainjob(cfg)

    steps = {name: read_step_result(cfg, name) for name in ("prepare", "stage", "train", "validate", "evaluate")}
    errors = []
    error_files = sorted((cfg.run_dir / STEPS_DIR).glob("*.error.json"))
    stage_error = cfg.dataset_dir / STAGE_ERROR
    started = (steps["prepare"] or {}).get("started_at", float("inf"))
    if steps["stage"] is None and stage_error.is_file() and json.loads(stage_error.read_text()).get("time", 0) >= started:
        error_files.append(stage_error)  # the cached stage task wrote it beside the dataset
    for path in error_files:
        error = json.loads(path.read_text())
        if any(e["step"] == error["step"] for e in errors):
            continue
        errors.append({"step": error["step"], "error_type": error["error_type"], "message": error["message"]})
    train, evaluate = steps["train"] or {}, steps["evaluate"] or {}
    succeeded = pipeline_state == "SUCCEEDED" and not errors
    mlflow = tracker(cfg)
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
        "recovery_events": read_events(cfg.run_dir, "recovery"),
        "goodput": train.get("goodput"),
        "errors": errors,
        "steps": steps,
        "finished_at": time.time(),
    }
    path = cfg.run_dir / SUMMARY
    if steps["prepare"] is not None:  # the parent run exists (or is spooled) only once prepare has run
        metrics = {k: summary[k] for k in ("steps_trained", "final_train_loss", "heldout_loss", "goodput")
                   if summary[k] is not None}
        if train:
            totals = train["recovery_totals"]
            metrics.update(recoveries=totals["recoveries"], lost_steps=totals["lost_steps"],
                           checkpoint_stall_mean_seconds=train.get("checkpoint_stall_mean_seconds", 0.0))
        if metrics:
            mlflow.log_metrics(tracking.PARENT, [{"step": summary["steps_trained"] or 0, **metrics}])
        _write_json(path, summary)
        mlflow.log_artifact(tracking.PARENT, path)
        mlflow.end_run(tracking.PARENT, "FINISHED" if succeeded else "FAILED")
    summary["mlflow_parent_run_id"] = mlflow.run_id()
    summary["mlflow_pending_records"] = mlflow.pending()
    summary["mlflow_rejected_records"] = mlflow.rejected()
    _write_json(path, summary)
    return summary
