"""The evaluate step: held-out loss, perplexity and generations of the validated checkpoint, and the
promotion gate against the registered champion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from components import tracking
from components.context import step_context, write_step_result
from components.evaluate.heldout import evaluate_checkpoint, heldout_loss
from components.evaluate.promotion import GateDecision, promote_if_better
from components.mlflow_server import is_outage
from trainer.checkpoint.export import export_hf
from trainer.config import Config
from trainer.run.run_dir import RunDir, write_json


def run_evaluate(cfg: Config, checkpoint: str, data_dir: str) -> dict[str, Any]:
    windows = dict(seq_len=cfg.training.seq_len, batch_size=cfg.eval.batch_size, max_batches=cfg.eval.max_batches)
    with step_context(cfg, "evaluate") as (mlflow, run):
        result = evaluate_checkpoint(Path(checkpoint), Path(data_dir), **windows, prompts=cfg.eval.prompt_list,
                                     max_new_tokens=cfg.eval.max_new_tokens)
        mlflow.log_metrics(run, [{
            "step": result["step"], "heldout_loss": result["heldout_loss"], "perplexity": result["perplexity"],
            "eval_tokens_per_second": result["eval_tokens_per_second"]}])
        if result["generations"]:
            generations = RunDir(cfg.run_dir).generations
            write_json(generations, result["generations"], ensure_ascii=False)
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
        write_step_result(cfg, "evaluate", result)
    return result


def _promotion_gate(cfg: Config, mlflow: tracking.Tracker, run: str, checkpoint: str, result: dict[str, Any],
                    evaluate_champion) -> dict[str, Any]:
    """The registry side needs the tracking server now: without it the decision is deferred, not guessed."""
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
        if not is_outage(err):
            raise
        return GateDecision(False, f"deferred: MLflow became unreachable during the gate ({err}); re-evaluate later",
                            result["heldout_loss"], threshold=cfg.eval.promotion_threshold).as_dict()
    return decision.as_dict()
