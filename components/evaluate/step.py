"""The evaluate step: compares, decides and records; it loads no weights.

The training's ranks evaluated the final checkpoint, exported it and evaluated the registered champion on the same
windows at the end of training (trainer.evaluate.evaluator: <run dir>/eval/step-N.json). This step reads that
record, logs it (metrics of the run and of the checkpoint's LoggedModel, the tasks, generations.json), checks the
export is complete at its URI, and runs the promotion gate (components.evaluate.promotion)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from components import tracking
from components.tracking import checkpoint_model_name, checkpoint_model_run
from components.context import step_context, write_step_result
from components.evaluate.promotion import GateDecision, promote_if_better
from components.mlflow_server import is_outage
from trainer.checkpoint.export_store import ExportIncomplete, read_marker
from trainer.checkpoint.format import MANIFEST
from trainer.config import Config
from trainer.config.model import DEFAULT_MODEL_TYPE
from trainer.run.run_dir import RunDir, read_json, write_json


class EvaluationMissing(RuntimeError):
    """No evaluation of the checkpoint's step (no record, or no held-out window); the message says where it was
    looked for and what to do."""


class ExportFailed(RuntimeError):
    """The checkpoint's export did not complete; the message names the URI, the cause and the checkpoint that stays."""


class EvaluationTaskFailed(RuntimeError):
    """An evaluation task raised and eval.tasks_required is true; the message names the task."""


def task_metrics(tasks: dict[str, Any]) -> dict[str, float]:
    """{'multiple_choice': {'metrics': {'accuracy': …}}} -> {'multiple_choice_accuracy': …}."""
    return {f"{name.replace(':', '.')}_{key}": value for name, result in tasks.items()
            for key, value in (result.get("metrics") or {}).items()}


def run_evaluate(cfg: Config, checkpoint: str) -> dict[str, Any]:
    with step_context(cfg, "evaluate") as (mlflow, run):
        manifest = json.loads((Path(checkpoint) / MANIFEST).read_text())
        step = manifest["step"]
        path = RunDir(cfg.run_dir).evaluation(step)
        record = read_json(path)
        if record is None:
            raise EvaluationMissing(f"no evaluation of step {step} at {path}: the training job writes it at its end, "
                                    f"after the final checkpoint {checkpoint}; run the pipeline again (its training is "
                                    "complete, so its job only evaluates and exports)")
        candidate = record["candidate"]
        if "error" in candidate:
            raise EvaluationMissing(f"the held-out evaluation of step {step} failed ({path}): {candidate['error']}; "
                                    f"the checkpoint {checkpoint} and its export ({record['export'].get('uri')}) stay")
        figures = {"heldout_loss": candidate["heldout_loss"], "perplexity": candidate["perplexity"],
                   "eval_tokens_per_second": candidate["eval_tokens_per_second"],
                   **task_metrics(candidate.get("tasks", {}))}
        champion = record.get("champion") or {}
        if champion.get("heldout_loss") is not None:
            figures["champion_heldout_loss"] = champion["heldout_loss"]
            figures.update({f"champion_{k}": v for k, v in task_metrics(champion.get("tasks", {})).items()})
        mlflow.log_metrics(run, [{"step": step, **figures}])
        export = record["export"]
        mlflow.logged_model(checkpoint_model_run(cfg.run_dir, run), checkpoint_model_name(step), step, metrics=figures,
                            model_type=manifest["model_config"].get("model_type", DEFAULT_MODEL_TYPE),
                            tags={"export_uri": export["uri"] if export.get("complete") else "",
                                  "eval_windows": record["windows"]}, ready=bool(export.get("complete")))
        if candidate.get("generations"):
            generations = RunDir(cfg.run_dir).generations
            write_json(generations, candidate["generations"], ensure_ascii=False)
            mlflow.log_artifact(run, generations)
        result = {"checkpoint": checkpoint, "step": step, "evaluation": str(path), "export_uri": export["uri"],
                  **figures, "generations": candidate.get("generations", []), "tasks": candidate.get("tasks", {})}
        failed = {name: r["error"] for name, r in candidate.get("tasks", {}).items() if "error" in r}
        if failed and cfg.eval.tasks_required:
            raise EvaluationTaskFailed("evaluation task(s) failed and eval.tasks_required is true, so nothing is "
                                       "promoted: " + "; ".join(f"{n}: {e}" for n, e in failed.items()))
        if not export.get("complete"):
            raise ExportFailed(f"the export of step {step} to {export['uri']} failed: {export.get('error')}. The "
                               f"validated checkpoint {checkpoint} stays; fix eval.export_uri and run the pipeline "
                               "again (its training is complete, so its job only evaluates and exports)")
        if cfg.eval.register:
            decision = _promotion_gate(cfg, mlflow, run, checkpoint, record, step)
            if failed:
                decision["reason"] += " (decided on the held-out loss alone: " + "; ".join(
                    f"task {n} failed: {e}" for n, e in failed.items()) + ")"
            result["promotion"] = decision
            tags = {"promoted": str(decision["promote"]).lower(), "promotion_reason": decision["reason"][:5000]}
            if decision.get("new_version"):
                tags["registered_version"] = decision["new_version"]
            mlflow.set_tags(run, tags)
            mlflow.set_tags(tracking.PARENT, tags)
        write_step_result(cfg, "evaluate", result)
    return result


def _promotion_gate(cfg: Config, mlflow: tracking.Tracker, run: str, checkpoint: str, record: dict[str, Any],
                    step: int) -> dict[str, Any]:
    """The registry side needs the tracking server now: without it the decision is deferred, not guessed."""
    candidate_loss = record["candidate"]["heldout_loss"]
    run_id = mlflow.run_id(checkpoint_model_run(cfg.run_dir, run))
    if run_id is None:
        why = (f"MLflow at {cfg.tracking_uri} is unreachable, so the champion cannot be read" if mlflow.pending()
               else f"MLflow refused this run's records (see {mlflow.rejected_path})")
        return GateDecision(False, f"deferred: {why}; re-evaluate later", candidate_loss,
                            threshold=cfg.eval.promotion_threshold).as_dict()
    try:
        read_marker(record["export"]["uri"], cfg.data.s3_endpoint_url)  # still whole at the moment it is registered
    except ExportIncomplete as err:
        raise ExportFailed(f"{err}. The validated checkpoint {checkpoint} stays; run the pipeline again to export it "
                           "(its training is complete, so its job only evaluates and exports)") from err
    try:
        decision = promote_if_better(
            MlflowClient(cfg.tracking_uri), model_name=cfg.eval.registered_model_name,
            threshold=cfg.eval.promotion_threshold, record=record, run_id=run_id,
            model_id=mlflow.model_id(checkpoint_model_run(cfg.run_dir, run), checkpoint_model_name(step)),
            tags={"pipeline_run_id": cfg.run.run_id, "checkpoint": checkpoint, "step": str(step)},
            champion_missing=cfg.eval.champion_missing, wait_seconds=cfg.eval.promotion_wait_seconds)
    except Exception as err:  # noqa: BLE001 - only outages are deferred; everything else fails the step
        if not is_outage(err):
            raise
        return GateDecision(False, f"deferred: MLflow became unreachable during the gate ({err}); re-evaluate later",
                            candidate_loss, threshold=cfg.eval.promotion_threshold).as_dict()
    return decision.as_dict()
